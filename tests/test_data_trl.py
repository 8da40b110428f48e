"""TRL's SFT dataset formats (engine/data/trl_rows.py) against TRL 1.16's own preparation of
the same rows: language modelling ``{"text"}``, prompt-completion standard (strings) and
conversational (messages). TRL's side is `SFTTrainer._prepare_dataset` itself (its EOS step,
its tokenize function, its labels from the completion mask), run without a model on the same
local tokenizers: the word-level tiny tokenizer and the character tokenizers of four chat
template families (Qwen3's renders a lone prompt differently from the prompt inside the chat:
the completion starts after the common prefix). Before engine/data/trl_rows.py every row here
stopped with "missing field 'response'" (or "row needs field 'messages'").
"""
from __future__ import annotations

import json
import re
import tempfile
from types import SimpleNamespace

import pytest

from engine.data.datasets import DataError, load_sft_dataset, render_sft_row
from tools.char_tokenizer import FAMILIES, build_char_tokenizer
from tools.tiny_models import build_tokenizer

TOOLS = json.dumps([{"type": "function", "function": {
    "name": "add", "description": "add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}])


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(out), 200)
    return {"tiny": AutoTokenizer.from_pretrained(str(out)),
            **{f: build_char_tokenizer(None, f) for f in FAMILIES}}


def text_rows(eos: str) -> list[dict]:
    return [{"text": "what is 2 + 3 ? 5"}, {"text": "a b c" + eos}, {"text": "x"}]


def standard_rows(eos: str) -> list[dict]:
    return [{"prompt": "what is 2 + 3 ?", "completion": " 5"},
            {"prompt": "copy a b", "completion": " a b" + eos},
            {"prompt": "sum of 1 and 2", "completion": "3"}]


def conversational_rows(tools: bool) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": "what is 2 + 3 ?"}],
             "completion": [{"role": "assistant", "content": "5"}]},
            {"prompt": [{"role": "system", "content": "copy"},
                        {"role": "user", "content": "a b"},
                        {"role": "assistant", "content": "a b"},
                        {"role": "user", "content": "c"}],
             "completion": [{"role": "assistant", "content": "c"}]}]
    return [{**r, "tools": TOOLS} for r in rows] if tools else rows


def trl_prepared(rows: list[dict], tok) -> list[tuple[list[int], list[int]]]:
    """(input_ids, trained) of each row as TRL's SFTTrainer prepares it: completion_only_loss
    as SFTTrainer sets it by default (prompt-completion rows: True), no truncation."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=tempfile.mkdtemp(), max_length=None, report_to=[],
                     use_cpu=True, bf16=False)
    trainer = SimpleNamespace(_tokenizer=tok, chat_template=None,
                              completion_only_loss="completion" in rows[0])
    out = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tok, args, False, None,
                                      "train")
    return [(list(r["input_ids"]), [int(x != -100) for x in r["labels"]]) for r in out]


def ours(rows: list[dict], tok) -> list[tuple[list[int], list[int]]]:
    return [render_sft_row(r, tok, f"f.jsonl:{i + 1}") for i, r in enumerate(rows)]


@pytest.mark.parametrize("family", ["tiny", *FAMILIES])
def test_text_and_standard_prompt_completion_equal_trl(toks, family):
    """{"text"}: every token trained, eos appended once; {"prompt", "completion"} strings:
    the completion (eos appended once) trained, the prompt not."""
    tok = toks[family]
    for rows in (text_rows(tok.eos_token), standard_rows(tok.eos_token)):
        expected = trl_prepared(rows, tok)
        assert ours(rows, tok) == expected, (family, rows[0])
    ids, trained = ours(standard_rows(tok.eos_token)[:1], tok)[0]
    assert 0 < sum(trained) < len(ids) and trained[-1] == 1 and ids[-1] == tok.eos_token_id
    ids, trained = ours(text_rows(tok.eos_token)[1:2], tok)[0]
    assert all(trained) and ids.count(tok.eos_token_id) == 1


@pytest.mark.parametrize("family", ["tiny", *FAMILIES])
def test_conversational_prompt_completion_equals_trl(toks, family):
    """{"prompt": [messages], "completion": [messages]} (with tools where the template takes
    them): the chat template's rendering, trained after the prompt's common prefix."""
    tok = toks[family]
    rows = conversational_rows(tools=family in ("qwen2.5", "qwen3"))
    expected = trl_prepared(rows, tok)
    got = ours(rows, tok)
    assert got == expected, family
    for ids, trained in got:
        assert 0 < sum(trained) < len(ids) and trained[-len(trained) + trained.index(1):] == \
            [1] * (len(trained) - trained.index(1))   # one trained run, to the end


def test_rows_load_as_samples_with_file_and_line_errors(toks, tmp_path):
    """Through the data pipeline (files, cache, shift): a {"text"} row trains every next
    token, a prompt-completion row only its completion's; bad rows name file and line."""
    tok = toks["tiny"]
    good = tmp_path / "good.jsonl"
    rows = [text_rows(tok.eos_token)[0], standard_rows(tok.eos_token)[0],
            conversational_rows(False)[0]]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_sft_dataset([str(good)], tok, 64, cache_dir=str(tmp_path / "cache"),
                            num_workers=0)
    for i, row in enumerate(rows):
        ids, trained = render_sft_row(row, tok, "x")
        s = data[i]
        assert s.tokens == ids[:-1] and s.labels == ids[1:] and s.loss_mask == trained[1:]
    assert all(data[0].loss_mask)
    bad = [({"prompt": "a", "completion": 3}, "field 'completion' must be a string"),
           ({"completion": "x"}, "missing field 'prompt'"),
           ({"prompt": [{"role": "user", "content": "a"}], "completion": "x"},
            "must both be strings (standard) or both lists of messages"),
           ({"prompt": "a", "response": "b", "completion": "c"}, "has both 'response'"),
           ({"text": 5}, "field 'text' must be a string"),
           ({"prompt": "a", "completion": [{"role": "user"}]}, "must both be strings")]
    for k, (row, message) in enumerate(bad):
        path = tmp_path / f"bad{k}.jsonl"
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError, match=f"{re.escape(str(path))}:2: .*{re.escape(message)}"):
            load_sft_dataset([str(path)], tok, 64, cache_dir=str(tmp_path / "cache"),
                             num_workers=0)
