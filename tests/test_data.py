"""Data pipeline: tiny tokenizer, row rendering (exact ids and masks), shift, truncation, file
errors with file:line, Parquet, the layout-independent global-batch order, RL prompt rows.

Token ids of the tiny tokenizer (tools/tiny_models.BASE_WORDS): <pad>=0 <unk>=1 <|im_start|>=2
<|im_end|>=3 "\\n"=4 user=5 assistant=6 system=7, digit d = 8 + d, letters a..z = 18..43,
"+"=44 "?"=49, "\\boxed{"=57 "}"=58 what=59 is=60 sum=63 of=64 and=65 copy=67 repeat=68.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.data.datasets import (DataError, Sample, global_batch_indices, load_prompt_rows,
                         load_sft_dataset, read_rows, render_messages, render_prompt,
                         render_sft_row)
from tools.tiny_models import BASE_WORDS, build_tokenizer

S, E, NL, USER, ASSISTANT, SYSTEM = 2, 3, 4, 5, 6, 7


def d(n: int) -> int:
    return 8 + n


def letter(c: str) -> int:
    return 18 + ord(c) - ord("a")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(out), 200)
    return str(out)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)  # as the engine loads it


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


SINGLE = [{"role": "user", "content": "what is 2 + 3 ?"},
          {"role": "assistant", "content": "\\boxed{5}"}]
SINGLE_IDS = [S, USER, NL, 59, 60, d(2), 44, d(3), 49, E, NL, S, ASSISTANT, NL, 57, d(5), 58, E, NL]
SINGLE_MASK = [0] * 14 + [1, 1, 1, 1, 0]

MULTI = [{"role": "system", "content": "copy"}, {"role": "user", "content": "a b"},
         {"role": "assistant", "content": "a b"}, {"role": "user", "content": "repeat c"},
         {"role": "assistant", "content": "c c"}]
MULTI_IDS = ([S, SYSTEM, NL, 67, E, NL] + [S, USER, NL, letter("a"), letter("b"), E, NL]
             + [S, ASSISTANT, NL, letter("a"), letter("b"), E, NL]
             + [S, USER, NL, 68, letter("c"), E, NL]
             + [S, ASSISTANT, NL, letter("c"), letter("c"), E, NL])
MULTI_MASK = [0] * 16 + [1, 1, 1] + [0] * 11 + [1, 1, 1, 0]

PR_ROW = {"prompt": "sum of 1 and 2", "response": "3"}
PR_IDS = [S, USER, NL, 63, 64, d(1), 65, d(2), E, NL, S, ASSISTANT, NL, d(3), E]
PR_MASK = [0] * 13 + [1, 1]


def test_tiny_tokenizer_special_tokens_and_decode(tok):
    assert len(tok) == 200 and tok.eos_token_id == E and tok.pad_token_id == 0
    assert tok.encode("<|im_start|>user\nwhat is 12?<|im_end|>", add_special_tokens=False) == \
        [S, USER, NL, 59, 60, d(1), d(2), 49, E]
    assert tok.encode("\\boxed{42} zebra", add_special_tokens=False) == [57, d(4), d(2), 58, 1]
    assert tok.decode([S, USER, NL, 59, 60, d(1), d(7), 44, d(2), E], skip_special_tokens=True) \
        == "user\nwhat is 17 + 2"
    assert tok.decode([S, ASSISTANT, NL, 57, d(4), d(2), 58, E, NL], skip_special_tokens=True) \
        == "assistant\n\\boxed{42}\n"
    assert tok.convert_ids_to_tokens([len(BASE_WORDS), 199]) == ["w0", f"w{199 - len(BASE_WORDS)}"]
    with pytest.raises(ValueError, match="smaller than"):
        build_tokenizer("/nonexistent-never-written", 10)


def test_chat_template_assistant_mask(tok):
    out = tok.apply_chat_template(MULTI, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert out["input_ids"] == MULTI_IDS and out["assistant_masks"] == MULTI_MASK


def test_render_messages_rows(tok):
    assert render_sft_row({"messages": SINGLE}, tok, "x:1") == (SINGLE_IDS, SINGLE_MASK)
    assert render_sft_row({"messages": MULTI}, tok, "x:1") == (MULTI_IDS, MULTI_MASK)


def test_render_without_generation_tags_uses_prefixes(tok_dir):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tok_dir)
    plain.chat_template = (plain.chat_template.replace("{% generation %}", "")
                           .replace("{% endgeneration %}", ""))
    assert render_messages(MULTI, plain, "x:1") == (MULTI_IDS, MULTI_MASK)
    plain.chat_template = ("{{ messages|length }}{% for m in messages %}<|im_start|>"
                           "{{ m['content'] }}<|im_end|>{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>{% endif %}")
    with pytest.raises(DataError, match=r"x:7: .*generation"):
        render_messages(MULTI, plain, "x:7")


def test_render_prompt_response_rows(tok):
    assert render_sft_row(PR_ROW, tok, "x:1") == (PR_IDS, PR_MASK)
    # a response that already ends in eos gets no second eos
    assert render_sft_row({**PR_ROW, "response": "3<|im_end|>"}, tok, "x:1") == (PR_IDS, PR_MASK)
    chat = [{"role": "system", "content": "copy"}, {"role": "user", "content": "a"}]
    ids, mask = render_sft_row({"prompt": chat, "response": "a"}, tok, "x:1")
    assert ids == [S, SYSTEM, NL, 67, E, NL, S, USER, NL, letter("a"), E, NL, S, ASSISTANT, NL,
                   letter("a"), E]
    assert mask == [0] * 15 + [1, 1]
    assert render_prompt("sum of 1 and 2", tok) == PR_IDS[:13]
    assert render_prompt(chat, tok) == ids[:15]


@pytest.mark.parametrize("row, pattern", [
    ({"prompt": "a"}, r"f\.jsonl:4: missing field 'response'"),
    ({"response": "a"}, r"f\.jsonl:4: missing field 'prompt'"),
    ({"prompt": "a", "response": 3}, r"f\.jsonl:4: field 'response' must be a string"),
    ({"prompt": 5, "response": "a"}, r"f\.jsonl:4: field 'prompt' must be a string or a list"),
    ({"messages": [{"role": "user"}]}, r"f\.jsonl:4: messages\[0\] is missing field 'content'"),
    ({"messages": "hi"}, r"f\.jsonl:4: field 'messages' must be a non-empty list"),
    ({"txt": "hi"}, r"f\.jsonl:4: row needs field 'messages'.*'text'.*\['txt'\]"),
])
def test_render_errors_name_field_and_place(tok, row, pattern):
    with pytest.raises(DataError, match=pattern):
        render_sft_row(row, tok, "f.jsonl:4")


def test_dataset_shift_and_counts(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": SINGLE}, "", PR_ROW])
    ds = load_sft_dataset([path], tok, seq_length=64)
    assert len(ds) == 2
    assert ds.stats == {"rows": 2, "truncated": 0, "dropped_empty": 0, "empty_loss": 0}
    s = ds[1]
    assert isinstance(s, Sample)
    assert s.tokens == PR_IDS[:-1] and s.labels == PR_IDS[1:]
    assert s.loss_mask == [0] * 12 + [1, 1] and s.num_loss_tokens == 2
    assert s.labels[12:] == [d(3), E]  # the trained labels are the response and its eos
    assert ds[0].loss_mask == SINGLE_MASK[1:] and ds[-2].tokens == SINGLE_IDS[:-1]
    assert ds.lengths.tolist() == [18, 14] and ds.loss_tokens.tolist() == [4, 2]
    with pytest.raises(IndexError):
        ds[2]


def test_truncation_right_and_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": SINGLE}, PR_ROW])
    ds = load_sft_dataset(path, tok, seq_length=14, truncation="right")
    # row 1: 19 ids -> 15 kept, trained ids 14 only; row 2: 15 ids fit exactly
    assert ds.stats == {"rows": 2, "truncated": 1, "dropped_empty": 0, "empty_loss": 0}
    assert ds[0].tokens == SINGLE_IDS[:14] and ds[0].labels == SINGLE_IDS[1:15]
    assert ds[0].loss_mask == [0] * 13 + [1] and ds[1].tokens == PR_IDS[:-1]
    assert "truncated: 1 (longer than train.seq_length=14 tokens, cut on the right)" in \
        ds.describe()
    # seq_length=10 cuts every trained token: nothing to train on is an error, not a no-op run
    with pytest.raises(DataError, match=r"none of the 2 samples has an assistant/response token"
                       r".*2 rows were cut to train.seq_length=10 tokens \(the longest needs "
                       r"18\)"):
        load_sft_dataset(path, tok, seq_length=10)
    with pytest.raises(DataError, match=r"long\.jsonl:1: rendered row has 19 tokens, more "
                       r"than train\.seq_length \+ 1 = 15"):
        load_sft_dataset(path, tok, seq_length=14, truncation="error")
    with pytest.raises(ValueError, match="right, error"):
        load_sft_dataset(path, tok, seq_length=14, truncation="left")


def test_file_errors(tok, tmp_path):
    bad = write_jsonl(tmp_path / "file.jsonl", [PR_ROW, PR_ROW, '{"prompt": "a",'])
    with pytest.raises(DataError, match=r"file\.jsonl:3: invalid JSON"):
        load_sft_dataset([bad], tok, seq_length=64)
    arr = write_jsonl(tmp_path / "arr.jsonl", [PR_ROW, "[1, 2]"])
    with pytest.raises(DataError, match=r"arr\.jsonl:2: expected a JSON object, got list"):
        list(read_rows([arr]))
    with pytest.raises(DataError, match=r"\.jsonl, \.parquet"):
        list(read_rows([str(tmp_path / "data.csv")]))
    with pytest.raises(DataError, match="not found"):
        list(read_rows([str(tmp_path / "missing.jsonl")]))
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"no training samples in .*empty\.jsonl"):
        load_sft_dataset([empty], tok, seq_length=64)
    rows = list(read_rows(write_jsonl(tmp_path / "gap.jsonl", [PR_ROW, "", {"messages": MULTI}])))
    assert [(line, row) for _, line, row in rows] == [(1, PR_ROW), (3, {"messages": MULTI})]


def test_parquet(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": SINGLE}, {"messages": MULTI}]), path)
    rows = list(read_rows([path]))
    assert [(f, n) for f, n, _ in rows] == [(path, 1), (path, 2)]
    assert rows[1][2] == {"messages": MULTI}
    ds = load_sft_dataset([path], tok, seq_length=64)
    assert ds[1].tokens == MULTI_IDS[:-1] and ds[1].loss_mask == MULTI_MASK[1:]
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([PR_ROW, {"prompt": "a", "response": None}]), bad)
    with pytest.raises(DataError, match=r"bad\.parquet:2: field 'response' must be a string"):
        load_sft_dataset([bad], tok, seq_length=64)


def stream(n: int, seed: int, epochs: int, shuffle: bool = True) -> list[int]:
    """Reference epoch stream, built independently of global_batch_indices' slicing."""
    out: list[int] = []
    for e in range(epochs):
        out += list(np.random.default_rng([seed, e]).permutation(n) if shuffle else range(n))
    return [int(x) for x in out]


def test_global_batch_indices_unshuffled():
    assert [global_batch_indices(5, 3, k, 0, False) for k in range(4)] == \
        [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


def test_global_batch_indices_shuffled():
    n, gbs, seed = 6, 4, 1234
    steps = [global_batch_indices(n, gbs, k, seed, True) for k in range(6)]  # 4 epochs
    flat = [i for s in steps for i in s]
    assert flat == stream(n, seed, 4)
    epochs = [flat[e * n:(e + 1) * n] for e in range(4)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(n))
    assert global_batch_indices(n, gbs, 1, seed + 1, True) != steps[1]
    # batch larger than the dataset: positions 7..13 of the stream, epochs 2, 3 and 4
    assert global_batch_indices(3, 7, 1, 5, True) == stream(3, 5, 5)[7:14]


def test_global_batch_indices_depend_only_on_arguments():
    first = global_batch_indices(10, 4, 7, 3, True)
    np.random.seed(99)
    np.random.rand(5)
    later = [global_batch_indices(10, 4, k, 3, True) for k in (9, 0, 7)]
    assert later[2] == first  # resuming at step 7 gives step 7 without replaying 0..6
    with pytest.raises(ValueError):
        global_batch_indices(0, 4, 0, 0, True)
    with pytest.raises(ValueError):
        global_batch_indices(10, 4, -1, 0, True)


def test_prompt_rows(tok, tmp_path):
    good = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "sum of 1 and 2", "answer": "3", "id": 7},
        {"prompt": [{"role": "user", "content": "a"}], "answer": 42}])
    rows = load_prompt_rows([good])
    assert rows == [{"prompt": "sum of 1 and 2", "answer": "3", "id": 7},
                    {"prompt": [{"role": "user", "content": "a"}], "answer": "42"}]
    assert render_prompt(rows[0]["prompt"], tok) == PR_IDS[:13]
    bad = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"q\.jsonl:2: missing field 'answer'"):
        load_prompt_rows([bad])
    bad = write_jsonl(tmp_path / "r.jsonl", [{"answer": "1"}])
    with pytest.raises(DataError, match=r"r\.jsonl:1: missing field 'prompt'"):
        load_prompt_rows([bad])
    bad = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: prompt\[0\] is missing field 'content'"):
        load_prompt_rows([bad])
