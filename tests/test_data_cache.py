"""The rendered-data cache (engine.data.cache): reuse, a new entry for a change of each key part,
torn builds never used, concurrent ranks of one node (one builds, the others wait and map),
build errors reaching every rank, narrow token dtypes, every input format (JSON lines, Parquet,
globs, directories of shards, Arrow files, datasets.save_to_disk folders), RL prompts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import engine.data.datasets as data_mod
from engine.data.datasets import DataError, load_prompt_rows, load_sft_dataset, render_prompt
from engine.data.files import read_rows, resolve_data_files
from tests.conftest import REPO_ROOT
from tools.tiny_models import build_tokenizer

SINGLE = [{"role": "user", "content": "what is 2 + 3 ?"},
          {"role": "assistant", "content": "\\boxed{5}"}]
PR_ROW = {"prompt": "sum of 1 and 2", "response": "3"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(out), 200)
    return str(out)


@pytest.fixture
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Counts the cache builds of load_sft_dataset in this process."""
    calls: list[str] = []
    real = data_mod._build_sft

    def counting(tmp, *args, **kwargs):
        calls.append(tmp)
        return real(tmp, *args, **kwargs)

    monkeypatch.setattr(data_mod, "_build_sft", counting)
    return calls


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def samples(ds) -> list:
    return [(ds[i].tokens, ds[i].labels, ds[i].loss_mask) for i in range(len(ds))]


def test_reuse_and_memory_mapped_narrow_arrays(tok, tmp_path, builds):
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": SINGLE}, PR_ROW] * 3)
    cache = str(tmp_path / "cache")
    first = load_sft_dataset([path], tok, 64, cache_dir=cache)
    second = load_sft_dataset([path], tok, 64, cache_dir=cache)
    assert len(builds) == 1 and first.cache_path == second.cache_path
    assert samples(first) == samples(second) and len(first) == 6
    assert isinstance(second._ids, np.memmap) and second._ids.dtype == np.uint8  # vocab 200
    assert isinstance(second.lengths, np.memmap) and second.lengths.tolist() == [18, 14] * 3
    assert sorted(os.listdir(cache)) == [os.path.basename(first.cache_path),
                                         os.path.basename(first.cache_path) + ".lock"]


def test_token_dtype_is_the_narrowest():
    from engine.data.cache import token_dtype

    assert [token_dtype(n).name for n in (200, 256, 257, 65536, 151_936, 2 ** 32 + 1)] == [
        "uint8", "uint8", "uint16", "uint16", "uint32", "int64"]


def test_each_key_part_makes_a_new_entry(tok, tok_dir, tmp_path, builds):
    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": SINGLE}, PR_ROW])
    cache = str(tmp_path / "cache")
    seen = {load_sft_dataset([path], tok, 64, cache_dir=cache).cache_path}

    def new_entry(ds) -> None:
        assert ds.cache_path not in seen
        seen.add(ds.cache_path)

    new_entry(load_sft_dataset([path], tok, 32, cache_dir=cache))                 # seq_length
    new_entry(load_sft_dataset([path], tok, 64, "error", cache_dir=cache))        # truncation
    other = AutoTokenizer.from_pretrained(tok_dir)
    other.chat_template = other.chat_template.replace("<|im_start|>assistant", "<|im_start|>bot")
    new_entry(load_sft_dataset([path], other, 64, cache_dir=cache))              # template
    bigger = tmp_path / "tok300"
    build_tokenizer(str(bigger), 300)
    new_entry(load_sft_dataset([path], AutoTokenizer.from_pretrained(str(bigger)), 64,
                               cache_dir=cache))                                   # tokenizer
    import engine.data.cache as data_cache

    data_cache.RENDERER_VERSION += 1000
    try:
        new_entry(load_sft_dataset([path], tok, 64, cache_dir=cache))             # renderer
    finally:
        data_cache.RENDERER_VERSION -= 1000
    write_jsonl(path, [{"messages": SINGLE}, PR_ROW, PR_ROW])                      # file content
    changed = load_sft_dataset([path], tok, 64, cache_dir=cache)
    new_entry(changed)
    assert len(changed) == 3
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))                  # mtime only
    new_entry(load_sft_dataset([path], tok, 64, cache_dir=cache))
    assert len(builds) == 8


def _script(body: str) -> str:
    return textwrap.dedent("""
        import hashlib, json, os, sys
        sys.path.insert(0, {root!r})
        from transformers import AutoTokenizer
        import engine.data.datasets as D
        tok = AutoTokenizer.from_pretrained(sys.argv[1])
    """).format(root=str(REPO_ROOT)) + textwrap.dedent(body)


def _run(script: str, *args: str, env: dict | None = None, wait: bool = True):
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_torn_build_is_never_used(tok, tok_dir, tmp_path, builds):
    """A build killed after writing some files leaves no entry; the next load rebuilds and
    removes the torn temp folder."""
    path = write_jsonl(tmp_path / "a.jsonl", [{"messages": SINGLE}, PR_ROW] * 5)
    cache = tmp_path / "cache"
    killed = _script("""
        import engine.data.cache as C
        def die(*a, **k):
            os._exit(9)  # killed mid-build: part files written, nothing renamed
        C.write_meta = die
        D.load_sft_dataset([sys.argv[2]], tok, 64, cache_dir=sys.argv[3], num_workers=0)
    """)
    rc, _, err = _run(killed, tok_dir, path, str(cache))
    assert rc == 9, err
    left = os.listdir(cache)
    torn = [n for n in left if ".tmp-" in n]
    assert len(torn) == 1 and os.listdir(cache / torn[0])  # a torn build with files ...
    assert not [n for n in left if n.startswith("sft-") and "." not in n]  # ... and no entry
    ds = load_sft_dataset([path], tok, 64, cache_dir=str(cache))
    assert len(builds) == 1 and len(ds) == 10
    assert not [n for n in os.listdir(cache) if ".tmp-" in n]


# Each rank loads a good file (argv 2, cache argv 3), prints its samples' hash, then the file
# whose last row is bad (argv 4, cache argv 5): two concurrent builds in one launch of the
# ranks (their imports, most of a launch's time, paid once). SPLIT, on stderr between them,
# separates the two builds' logs.
SPLIT = "=== the bad file ==="
CONCURRENT = """
    rank = int(os.environ["RANK"])
    ds = D.load_sft_dataset([sys.argv[2]], tok, 64, cache_dir=sys.argv[3], num_workers=1)
    h = hashlib.sha256(json.dumps([ds[i].tokens + ds[i].loss_mask
                                   for i in range(len(ds))]).encode()).hexdigest()
    print(json.dumps({"rank": rank, "n": len(ds), "hash": h, "path": ds.cache_path}), flush=True)
    print("%s", file=sys.stderr, flush=True)
    try:
        D.load_sft_dataset([sys.argv[4]], tok, 64, cache_dir=sys.argv[5], num_workers=1)
    except D.DataError as e:
        print("DATAERROR " + str(e))
        sys.exit(2)
""" % SPLIT


def _ranks(script: str, tok_dir: str, *args: str, n: int = 3):
    procs = [_run(script, tok_dir, *args, wait=False,
                  env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})
             for r in range(n)]
    return [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]


def test_concurrent_ranks_one_builds_the_others_wait_and_errors_reach_every_rank(tok_dir,
                                                                                 tmp_path):
    """Three ranks of one node load a file at once: one builds (with a worker), the others wait
    and map the same entry. Then they load a file whose last row is bad: the build error
    reaches every rank (exit 2, the file and row named), from the one build."""
    rows = [{"messages": SINGLE * k} for k in range(1, 8)] + [PR_ROW]
    path = write_jsonl(tmp_path / "a.jsonl", rows * 400)  # 3200 rows: workers, a second or so
    bad = write_jsonl(tmp_path / "bad.jsonl", [PR_ROW] * 2500 + [{"prompt": "a"}])
    results = _ranks(_script(CONCURRENT), tok_dir, path, str(tmp_path / "cache"), bad,
                     str(tmp_path / "bad_cache"))
    assert [rc for rc, _, _ in results] == [2, 2, 2], [err[-2000:] for _, _, err in results]
    assert all(err.count(SPLIT) == 1 for _, _, err in results), results
    good = [err.split(SPLIT)[0] for _, _, err in results]
    outs = [json.loads(next(line for line in out.splitlines() if line.startswith("{")))
            for _, out, _ in results]
    assert len({o["hash"] for o in outs}) == 1 and {o["n"] for o in outs} == {3200}
    assert len({o["path"] for o in outs}) == 1
    errs = "".join(good)
    assert errs.count("] rank") and errs.count("rendered 3200 rows") == 1, errs[-3000:]
    # ranks that started before the build finished waited (a late one reads the cache)
    assert 1 <= errs.count("waiting for another process to build the data cache") <= 2
    # the bad file
    for _, out, _ in results:
        assert f"DATAERROR {bad}:2501: missing field 'response'" in out
    # one build: only one rank renders; the others waited for it or, started after it
    # failed, read the recorded error
    builders = [err for _, _, err in results if "rendering SFT rows" in err.split(SPLIT)[1]]
    assert len(builders) == 1, [err[-1000:] for _, _, err in results]


# ----------------------------------------------------------------------------- formats

def table_of(rows: list[dict]):
    """An Arrow table whose schema is the union of the rows' fields (from_pylist would take the
    first row's)."""
    import pyarrow as pa

    return pa.Table.from_struct_array(pa.array(rows))


def _save_to_disk(folder, rows: list[dict], shards: int) -> None:
    """The layout datasets.Dataset.save_to_disk writes: Arrow IPC stream shards + state.json."""
    import pyarrow as pa

    folder.mkdir()
    table = table_of(rows)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(rows) // shards)
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink:
            part = table.slice(i * per, per)
            with pa.ipc.new_stream(sink, part.schema) as writer:
                writer.write_table(part)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x",
         "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
         "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text("{}")


def test_every_format_gives_the_same_samples(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    share = {"conversations": [{"from": "human", "value": "what is 2 + 3 ?"},
                               {"from": "gpt", "value": "\\boxed{5}"}]}
    rows = [{"messages": SINGLE}, PR_ROW, share] * 3
    want = None
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "shards").mkdir()
    for i in range(3):
        pq.write_table(table_of(rows[3 * i:3 * i + 3]),
                       str(tmp_path / "shards" / f"part-{i}.parquet"))
    _save_to_disk(tmp_path / "saved", rows, shards=2)
    arrow = tmp_path / "one.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(
            sink, table_of(rows).schema) as writer:
        writer.write_table(table_of(rows))
    for spec in ([jsonl], [str(tmp_path / "shards")], [str(tmp_path / "shards" / "*.parquet")],
                 [str(tmp_path / "saved")], [str(arrow)]):
        ds = load_sft_dataset(spec, tok, 64, cache_dir=str(tmp_path / "cache"))
        got = samples(ds)
        want = want or got
        assert got == want and len(got) == 9, spec
    assert samples(load_sft_dataset(str(tmp_path / "**" / "*.parquet"), tok, 64,
                                    cache_dir=str(tmp_path / "cache"))) == want
    assert want[0] == want[2]  # ShareGPT row == messages row


def test_real_datasets_save_to_disk(tok, tmp_path):
    import datasets

    # one schema for both row kinds (Dataset.from_list takes the columns of the first row), the
    # other kind's columns null, as datasets writes a mixed dataset
    rows = [{"messages": SINGLE, "prompt": None, "response": None}, {"messages": None, **PR_ROW}]
    datasets.Dataset.from_list(rows * 3).save_to_disk(str(tmp_path / "saved"))
    ds = load_sft_dataset(str(tmp_path / "saved"), tok, 64, cache_dir=str(tmp_path / "c"))
    assert len(ds) == 6
    path = write_jsonl(tmp_path / "same.jsonl", [{"messages": SINGLE}, PR_ROW] * 3)
    same = load_sft_dataset([path], tok, 64, cache_dir=str(tmp_path / "c"))
    assert samples(ds) == samples(same) and samples(ds)[0] != samples(ds)[1]


def test_shard_errors_name_file_and_row(tok, tmp_path):
    rows = [PR_ROW] * 4 + [{"prompt": "a", "response": None}]
    _save_to_disk(tmp_path / "saved", rows, shards=2)
    with pytest.raises(DataError, match=r"data-00001-of-00002\.arrow:2: field 'response' must "
                                        r"be a string"):
        load_sft_dataset(str(tmp_path / "saved"), tok, 64, cache_dir=str(tmp_path / "c"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=r"DatasetDict folder \(splits: train, test\); give one "
                                        r"split's folder, e.g. .*dd/train"):
        resolve_data_files([str(tmp_path / "dd")])
    with pytest.raises(DataError, match=r"no file matches this pattern"):
        resolve_data_files([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"directory holds no data files"):
        resolve_data_files([str(tmp_path / "empty")])
    assert [n for _, n, _ in read_rows(str(tmp_path / "saved"))] == [1, 2, 3, 1, 2]


def test_parquet_nulls_of_a_union_schema_are_dropped(tok, tmp_path):
    """Parquet gives every message every key of the union schema (null where absent): a user
    message with tool_calls=None must render like the JSON lines row without the key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    chat = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "b"}, {"role": "assistant", "content": "c"}]
    pq.write_table(pa.Table.from_pylist([{"messages": chat}]), str(tmp_path / "t.parquet"))
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"messages": chat}])
    a = load_sft_dataset(str(tmp_path / "t.parquet"), tok, 64, cache_dir=str(tmp_path / "c"))
    b = load_sft_dataset(jsonl, tok, 64, cache_dir=str(tmp_path / "c"))
    assert samples(a) == samples(b)


def test_config_accepts_globs_and_directories(tmp_path):
    from engine.config.schema import SFTConfig, data_file_problems

    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [PR_ROW])
    cfg = SFTConfig()
    cfg.data.train_files = [str(tmp_path / "d"), str(tmp_path / "d" / "*.jsonl")]
    cfg.data.eval_files = [str(tmp_path / "none-*.jsonl"), str(tmp_path / "d" / "a.txt")]
    cfg.data.num_workers = -1
    problems = data_file_problems(cfg)
    assert len(problems) == 3, problems
    assert "none-*.jsonl: no file matches this pattern" in problems[0]
    assert "a.txt has extension '.txt'; supported: .jsonl, .parquet, .arrow" in problems[1]
    assert "data.num_workers=-1 must be >= 0" in problems[2]


# ----------------------------------------------------------------------------- RL prompts

def test_prompt_rows_through_the_cache(tok, tmp_path):
    chat = [{"role": "system", "content": "copy"}, {"role": "user", "content": "a"}]
    rows = [{"prompt": "sum of 1 and 2", "answer": 3, "id": 7}, {"prompt": chat, "answer": "a"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    locations, ids = [], []
    got = load_prompt_rows([path], locations, tokenizer=tok, prompt_ids=ids,
                           cache_dir=str(tmp_path / "c"))
    assert got == load_prompt_rows([path]) == [{**rows[0], "answer": "3"}, rows[1]]
    assert locations == [f"{path}:1", f"{path}:2"]
    assert ids == [render_prompt(r["prompt"], tok) for r in rows]
    again: list = []
    load_prompt_rows([path], tokenizer=tok, prompt_ids=again, cache_dir=str(tmp_path / "c"))
    assert again == ids
    bad = write_jsonl(tmp_path / "q.jsonl", [rows[0], {"prompt": "b"}])
    with pytest.raises(DataError, match=r"q\.jsonl:2: missing field 'answer'"):
        load_prompt_rows([bad], tokenizer=tok, cache_dir=str(tmp_path / "c"))


def test_parquet_units_are_whole_row_groups(tok, tmp_path, monkeypatch):
    """Workers get whole row groups (never decoding one twice); rows keep their numbers."""
    import pyarrow.parquet as pq

    from engine.data.files import row_units

    rows = [{"messages": SINGLE}, PR_ROW, PR_ROW] * 3
    path = str(tmp_path / "g.parquet")
    pq.write_table(table_of(rows), path, row_group_size=2)
    units = row_units([path], rows_per_unit=3)
    assert [(u.start, u.stop, u.first) for u in units] == [(0, 4, 1), (4, 8, 5), (8, 9, 9)]
    assert [n for _, n, _ in read_rows(path)] == list(range(1, 10))
    monkeypatch.setattr("engine.data.cache.ROWS_PER_UNIT", 3)
    jsonl = write_jsonl(tmp_path / "g.jsonl", rows)
    a = load_sft_dataset(path, tok, 64, cache_dir=str(tmp_path / "c"), num_workers=2)
    b = load_sft_dataset(jsonl, tok, 64, cache_dir=str(tmp_path / "c"), num_workers=0)
    assert samples(a) == samples(b) and len(a) == 9
