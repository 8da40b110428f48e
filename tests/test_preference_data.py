"""Preference data (engine.data.preference): every TRL format and a file mixing them, Parquet
and save_to_disk input, the SFT-equality of a side, prompt assistant turns untrained, every
refusal named by file and line, truncation, the cache. Single process, rendering in process."""
from __future__ import annotations

import json

import numpy as np
import pytest

import engine.data.preference as pref_mod
from engine.data.datasets import render_prompt, render_sft_row
from engine.data.files import DataError
from engine.data.preference import load_preference_dataset
from engine.data.preference_render import fit_pair, render_preference_row
from engine.data.preference_rows import extract_prompt
from tools.char_tokenizer import FAMILIES, build_char_tokenizer
from tools.tiny_models import build_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Sky colour?"}
BLUE = {"role": "assistant", "content": "It is blue."}
GREEN = {"role": "assistant", "content": "Green."}
EXPLICIT = {"prompt": [SYSTEM, USER], "chosen": [BLUE], "rejected": [GREEN]}
IMPLICIT = {"chosen": [SYSTEM, USER, BLUE], "rejected": [SYSTEM, USER, GREEN]}
TEXT = {"prompt": "Sky colour?", "chosen": "It is blue.", "rejected": "Green."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    out = {f: build_char_tokenizer(None, f) for f in FAMILIES}
    out["tiny"] = build_tokenizer(str(tmp_path_factory.mktemp("tok")), 200)  # generation tags
    return out


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def trained_text(tok, ids, mask) -> list[str]:
    runs, cur = [], None
    for i, m in zip(ids, mask):
        if m:
            cur = (cur or "") + tok.convert_ids_to_tokens(int(i))
        elif cur is not None:
            runs, cur = runs + [cur], None
    return runs + ([cur] if cur is not None else [])


@pytest.mark.parametrize("family", [*FAMILIES, "tiny"])
def test_side_equals_sft_rendering(toks, family):
    """A single-turn prompt: each side's (ids, trained) are render_sft_row of prompt + side,
    exactly; the prompt is the tokens before the first trained one, shared by both sides."""
    tok = toks[family]
    words = family == "tiny"   # the word-level tokenizer knows few words
    user = {"role": "user", "content": "what is 1 + 2 ?" if words else "Sky colour?"}
    chosen = {"role": "assistant", "content": "3" if words else "It is blue."}
    rejected = {"role": "assistant", "content": "4" if words else "Green."}
    prompts = [[user]] if words else [[user], [SYSTEM, user]]
    for prompt in prompts:
        pair = render_preference_row({"prompt": prompt, "chosen": [chosen],
                                      "rejected": [rejected]}, tok, "x:1")
        for side, reply in ((pair.chosen, chosen), (pair.rejected, rejected)):
            ids, trained = render_sft_row({"messages": prompt + [reply]}, tok, "x:1")
            assert side.ids == ids and side.trained.tolist() == trained
            assert side.trained[pair.prompt_length] == 1
            assert not side.trained[:pair.prompt_length].any()
        assert pair.chosen.ids[:pair.prompt_length] == render_prompt(prompt, tok)
    if words:  # the ids themselves: <|im_start|>=2 <|im_end|>=3 "\n"=4 user=5 assistant=6
        assert pair.chosen.ids == [2, 5, 4, 59, 60, 9, 44, 10, 49, 3, 4, 2, 6, 4, 11, 3, 4]
        assert pair.chosen.trained.tolist() == [0] * 14 + [1, 1, 0]
        assert pair.rejected.ids[14] == 12 and pair.prompt_length == 14


def test_trained_text_per_family(toks):
    row = {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}
    expect = {"chatml": "It is blue.<|im_end|>", "qwen2.5": "It is blue.<|im_end|>",
              "qwen3": "<think>\n\n</think>\n\nIt is blue.<|im_end|>",
              "llama3.1": "It is blue.<|eot_id|>"}
    for family, text in expect.items():
        pair = render_preference_row(row, toks[family], "x:1")
        assert trained_text(toks[family], pair.chosen.ids, pair.chosen.trained) == [text]


def test_prompt_assistant_turns_are_context(toks):
    """Multi-turn prompt: the SFT rendering trains both assistant turns, the side only its own;
    Qwen3 drops the earlier turn's reasoning (as SFT renders it), a side keeps its own."""
    tok = toks["qwen3"]
    prompt = [SYSTEM, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
              {"role": "user", "content": "2+2?"}]
    four = {"role": "assistant", "content": "4", "reasoning_content": "add"}
    pair = render_preference_row({"prompt": prompt, "chosen": [four],
                                  "rejected": [{"role": "assistant", "content": "5"}]}, tok, "f:3")
    ids, trained = render_sft_row({"messages": prompt + [four]}, tok, "f:3")
    assert pair.chosen.ids == ids
    assert trained_text(tok, ids, trained) == ["Hello!<|im_end|>",
                                               "<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert trained_text(tok, ids, pair.chosen.trained) == ["<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert trained_text(tok, pair.rejected.ids, pair.rejected.trained) == [
        "<think>\n\n</think>\n\n5<|im_end|>"]
    assert "greet" not in tok.decode(ids)


def test_formats_render_alike(toks):
    """Implicit = explicit (TRL's prompt split); text = one user + one assistant turn; tools
    reach the template; extract_prompt reproduces TRL's loop."""
    tok = toks["qwen2.5"]
    explicit = render_preference_row(EXPLICIT, tok, "x:1")
    implicit = render_preference_row(IMPLICIT, tok, "x:1")
    assert (implicit.chosen.ids, implicit.rejected.ids) == (explicit.chosen.ids,
                                                           explicit.rejected.ids)
    assert implicit.form == "implicit" and explicit.form == "explicit"
    text = render_preference_row(TEXT, tok, "x:1")
    assert text.chosen.ids == render_sft_row({"messages": [USER, BLUE]}, tok, "x")[0]
    with_tools = render_preference_row({**EXPLICIT, "tools": TOOLS}, tok, "x:1")
    assert "# Tools" in tok.decode(with_tools.chosen.ids)
    a, b, c, d = ({"role": r, "content": x} for r, x in
                  (("user", "u"), ("assistant", "a"), ("assistant", "b"), ("user", "v")))
    assert extract_prompt([a, b], [a, c]) == ([a], [b], [c])
    assert extract_prompt([a, b], [a, b, d, c]) == ([a], [b], [b, d, c])   # TRL's loop end
    assert extract_prompt([a, b], [a, b]) == ([a], [b], [b])


def test_mixed_file_dataset_and_cache(toks, tmp_path, monkeypatch):
    tok = toks["qwen3"]
    rows = [{**EXPLICIT, "margin": 1.5}, IMPLICIT, {**TEXT, "margin": -2},
            {**EXPLICIT, "tools": TOOLS}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    ds = load_preference_dataset(path, tok, 512, "right", cache_dir=str(tmp_path / "c"))
    assert len(ds) == 4 and ds.stats["explicit"] == 2 and ds.stats["implicit"] == 1
    assert ds.stats["text"] == 1 and ds.stats["with_margin"] == 2 and ds.stats["truncated"] == 0
    assert [ds[i].margin for i in range(4)] == [1.5, None, -2.0, None]
    for i, row in enumerate(rows):
        pair = render_preference_row(row, tok, "x")
        for sample, side in ((ds[i].chosen, pair.chosen), (ds[i].rejected, pair.rejected)):
            assert sample.tokens == side.ids[:-1] and sample.labels == side.ids[1:]
            assert sample.loss_mask == side.trained[1:].tolist()
        assert ds.chosen_lengths[i] == len(pair.chosen.ids) - 1
        assert ds.rejected_loss_tokens[i] == pair.rejected.trained.sum()
        assert ds.prompt_lengths[i] == pair.prompt_length
    # <think> \n \n </think> \n \n (6 tokens) + the reply's characters + <|im_end|>
    assert ds.chosen_loss_tokens.tolist() == [18] * 4 and ds.rejected_loss_tokens.tolist() == [13] * 4
    assert ds.prompt_lengths.tolist() == [49, 49, 30, 464]
    assert ds.chosen_lengths.dtype == np.int64 and ds.chosen_lengths.tolist() == [67, 67, 48, 482]
    assert ds.describe() == (
        "4 preference pairs from 4 rows (explicit 2, implicit 1, text 1); truncated: 0 pairs "
        "(chosen 0, rejected 0; sides longer than train.seq_length=512 tokens cut on the "
        "right, prompts kept); with margin: 2; dropped: 0")

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached entry")

    monkeypatch.setattr(pref_mod, "_build", no_build)
    again = load_preference_dataset(path, tok, 512, "right", cache_dir=str(tmp_path / "c"))
    assert again.cache_path == ds.cache_path and again[3].chosen == ds[3].chosen


def test_parquet_and_save_to_disk(toks, tmp_path):
    """A Parquet file mixing explicit and implicit rows (null prompt) and a save_to_disk
    folder load the same pairs as JSON lines, margins and nulls included."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = toks["chatml"]
    rows = [{**EXPLICIT, "margin": 0.25}, {**IMPLICIT, "prompt": None, "margin": None}]
    ref = load_preference_dataset(write_jsonl(tmp_path / "r.jsonl", rows), tok, 256, "error",
                                  cache_dir=str(tmp_path / "c"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for spec in (str(tmp_path / "r.parquet"), str(tmp_path / "saved")):
        ds = load_preference_dataset(spec, tok, 256, "error", cache_dir=str(tmp_path / "c"))
        assert ds.cache_path != ref.cache_path and len(ds) == 2
        assert [ds[i].margin for i in range(2)] == [0.25, None]
        for i in range(2):
            assert ds[i].chosen == ref[i].chosen and ds[i].rejected == ref[i].rejected
        assert ds.stats["implicit"] == 1


def test_truncation(toks, tmp_path):
    tok = toks["chatml"]
    long = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "x" * 40}],
            "rejected": [GREEN]}
    pair = render_preference_row(long, tok, "x")
    p = pair.prompt_length
    assert p == len(render_prompt([USER], tok)) == 30
    path = write_jsonl(tmp_path / "long.jsonl", [{**EXPLICIT, "prompt": [USER]}, long])
    ds = load_preference_dataset(path, tok, p + 15, "right", cache_dir=str(tmp_path / "c"))
    assert ds.stats["truncated"] == ds.stats["truncated_chosen"] == 1
    assert ds.stats["truncated_rejected"] == 0 and ds.chosen_lengths[1] == p + 15
    assert ds[1].chosen.tokens[:p] == pair.chosen.ids[:p]          # the prompt stays
    assert ds.chosen_loss_tokens[1] == 16 and ds.rejected_loss_tokens[1] == 7
    assert "truncated: 1 pairs (chosen 1, rejected 0;" in ds.describe()
    edge = fit_pair(render_preference_row(long, tok, "x"), p, "right", "x")
    assert edge.chosen.trained[1:].sum() == 1       # prompt == seq_length: one trained label
    with pytest.raises(DataError, match=r"long\.jsonl:2: the chosen side renders to 72 tokens, "
                                        r"more than train\.seq_length \+ 1 = 46 "
                                        r"\(data\.truncation=error\)"):
        load_preference_dataset(path, tok, p + 15, "error", cache_dir=str(tmp_path / "c"))


def test_sides_identical_after_truncation_are_refused(toks, tmp_path):
    """Sides that differ only after the cut: refused by file and line once cut (they would
    add a constant ln 2 to the loss and count in its mean), as identical renderings are. The
    same row loads when seq_length keeps the difference (the control), and it renders to two
    different sides before the cut (the identical-sides check of render_preference_row passes
    it: the refusal must come after the cut)."""
    tok = toks["chatml"]
    row = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "x" * 40 + "a"}],
           "rejected": [{"role": "assistant", "content": "x" * 40 + "b"}]}
    pair = render_preference_row(row, tok, "x")
    p = pair.prompt_length
    assert pair.chosen.ids != pair.rejected.ids and pair.differ_at > p + 16
    path = write_jsonl(tmp_path / "cut.jsonl", [{**EXPLICIT, "prompt": [USER]}, row])
    with pytest.raises(DataError, match=r"cut\.jsonl:2: the chosen and rejected sides are "
                                        r"identical after truncation to train\.seq_length \+ "
                                        rf"1 = {p + 16} tokens \(they first differ at token "
                                        rf"{pair.differ_at}\)"):
        load_preference_dataset(path, tok, p + 15, "right", num_workers=0,
                                cache_dir=str(tmp_path / "c"))
    ds = load_preference_dataset(path, tok, pair.differ_at + 1, "right", num_workers=0,
                                 cache_dir=str(tmp_path / "c"))
    assert len(ds) == 2 and ds.stats["truncated"] == 1
    assert ds[1].chosen.tokens != ds[1].rejected.tokens or \
        ds[1].chosen.labels != ds[1].rejected.labels

PART = {"type": "image", "image": "x.png"}
REFUSED = {
    "no_chosen": ({"prompt": [USER], "rejected": [GREEN]}, r"missing field 'chosen'"),
    "no_rejected": ({"prompt": "q", "chosen": "a"}, r"missing field 'rejected'"),
    "empty_reply": ({**EXPLICIT, "rejected": [{"role": "assistant", "content": ""}]},
                    r"field 'rejected': assistant message 0 is an empty reply"),
    "empty_text": ({**TEXT, "chosen": ""}, r"field 'chosen': assistant message 0 is an empty"),
    "no_assistant": ({**EXPLICIT, "chosen": [USER]},
                     r"field 'chosen' has no assistant message \(roles: user\)"),
    "implicit_no_assistant": ({"chosen": [USER, BLUE], "rejected": [USER, USER]},
                              r"field 'rejected' has no assistant message after the shared"),
    "long_prompt": ({"prompt": [{"role": "user", "content": "q" * 80}], "chosen": [BLUE],
                     "rejected": [GREEN]}, r"the prompt renders to 99 tokens, more than "
                                           r"train\.seq_length=64"),
    "prompts_differ": ({"chosen": [SYSTEM, USER, BLUE],
                        "rejected": [SYSTEM, {"role": "user", "content": "Why?"}, BLUE]},
                       r"the chosen and rejected sides render different prompts"),
    "no_shared_prompt": ({"chosen": [USER, BLUE], "rejected": [SYSTEM, USER, GREEN]},
                         r"implicit-prompt row: 'chosen' and 'rejected' differ in their first message, so they share no prompt"),
    "identical": ({**EXPLICIT, "rejected": [BLUE]}, r"the chosen and rejected sides are identical after rendering"),
    "implicit_text": ({"chosen": "It is blue.", "rejected": "Green."},
                      r"'chosen' and 'rejected' are strings but the row has no 'prompt'.*supported formats: explicit"),
    "mixed_types": ({"prompt": "q", "chosen": "a", "rejected": [GREEN]},
                    r"'chosen' is a str and 'rejected' a list"),
    "string_prompt": ({**IMPLICIT, "prompt": "Sky?"}, r"field 'prompt' is a str but"),
    "images": ({**EXPLICIT, "images": ["a.png"]},
               r"the row has images \(field 'images'\); images are not supported for preference data"),
    "image_part": ({**EXPLICIT, "prompt": [{"role": "user", "content": [PART]}]},
                   r"prompt\[0\] has an image part; images are not supported for preference"),
    "margin_string": ({**EXPLICIT, "margin": "0.5"},
                      r"field 'margin' must be a number, got str '0\.5'"),
    "margin_nan": ({**EXPLICIT, "margin": float("nan")}, r"field 'margin' must be a finite number, got nan"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_file_and_line(toks, tmp_path, case):
    """Every refusal is a DataError at load time naming the file and the line (line 3: a
    blank line and a good row come first)."""
    row, message = REFUSED[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(EXPLICIT) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: " + message):
        load_preference_dataset(str(path), toks["chatml"], 64, "right", num_workers=0,
                                cache_dir=str(tmp_path / "c"))


def test_worker_processes_build_the_same_entry(toks, tmp_path):
    """600 rows (3 units of 256) rendered by 2 forked workers equal the in-process build; a
    refused row in the last unit is reported with its line."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}],
             "chosen": [{"role": "assistant", "content": f"a{i}"}],
             "rejected": [{"role": "assistant", "content": f"b{i}!"}], "margin": i}
            for i in range(600)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    tok = toks["qwen3"]
    forked = load_preference_dataset(path, tok, 128, "right", cache_dir=str(tmp_path / "a"),
                                     num_workers=2)
    local = load_preference_dataset(path, tok, 128, "right", cache_dir=str(tmp_path / "b"),
                                    num_workers=0)
    assert len(forked) == 600 and forked.stats == local.stats and forked[599].margin == 599.0
    assert all(forked[i] == local[i] for i in (0, 255, 256, 511, 512, 599))
    assert np.array_equal(forked.rejected_loss_tokens, local.rejected_loss_tokens)
    rows[550]["rejected"] = rows[550]["chosen"]
    path = write_jsonl(tmp_path / "bad_many.jsonl", rows)
    with pytest.raises(DataError, match=r"bad_many\.jsonl:551: the chosen and rejected sides "
                                        r"are identical"):
        load_preference_dataset(path, tok, 128, "right", cache_dir=str(tmp_path / "a"),
                                num_workers=2)
