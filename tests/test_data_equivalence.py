"""Equivalence with the renderer this cache replaced: the previous engine.data.datasets implementation
(copied verbatim below, commit 1525531: one Python loop, prefix renders per assistant turn) and
the cached, parallel one give identical ids, masks, samples, stats and hence loss on every
fixture the previous one handles: the tiny tokenizer with {% generation %} tags, the same
template without them, chatml, Qwen2.5 and Llama 3.1 (multi-turn, tools), single-turn Qwen3,
prompt/response rows, truncation."""
from __future__ import annotations

import array
import json
import random
import re
from typing import Any, Sequence

import numpy as np
import pytest

from engine.data.datasets import SFTDataset, _check_not_empty as check_not_empty, load_sft_dataset
from engine.data.datasets import render_sft_row as new_render_sft_row
from engine.data.files import DataError, as_file_list, read_rows as legacy_read_rows
from engine.data.files import where as where_of
from tests.test_data_templates import TOOLS
from tools.char_tokenizer import build_char_tokenizer
from tools.tiny_models import build_tokenizer

TRUNCATION_CHOICES = ("right", "error")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ----------------------------------------------------------------------------- the previous code

def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer (model.hf_path) has no eos token; prompt/response rows "
                        "need one to end the response")
    return int(tokenizer.eos_token_id)


def _chat_template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the tokenizer (model.hf_path) has no chat template; rows with "
                        "messages or prompts are rendered with it")
    return template if isinstance(template, str) else "\n".join(map(str, template.values()))


def _check_messages(value: Any, field: str, where: str) -> list[dict]:
    """`value` as a chat: a non-empty list of {"role": str, "content": str, ...} dicts."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages, got "
                        f"{type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and "
                            f"'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {field}[{i}] is missing field {key!r}")
            if not isinstance(m[key], str):
                raise DataError(f"{where}: {field}[{i}].{key} must be a string, got "
                                f"{type(m[key]).__name__}")
    return value


def _template(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool,
              assistant_mask: bool = False) -> dict:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=assistant_mask)
    except Exception as e:  # jinja raise_exception / undefined access: a problem of this row
        raise DataError(f"{where}: chat template failed: {e}") from e


def legacy_render_messages(messages: list[dict], tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Render a chat; trained = 1 on assistant turns (content and closing eos), 0 elsewhere.

    With ``{% generation %}`` blocks in the template, the mask is transformers' assistant mask.
    Without them, assistant turn i spans from the end of the rendering of messages[:i] with the
    generation prompt to the end of messages[:i+1], cut after its last eos token; a template
    whose renderings are not prefixes of each other raises DataError (it needs generation tags).
    """
    messages = _check_messages(messages, "messages", where)
    if _GENERATION_TAG.search(_chat_template_text(tokenizer)):
        out = _template(tokenizer, messages, where, False, assistant_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    ids = list(_template(tokenizer, messages, where, False)["input_ids"])
    trained = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = list(_template(tokenizer, messages[:i], where, True)["input_ids"]) if i else []
        upto = list(_template(tokenizer, messages[: i + 1], where, False)["input_ids"])
        if upto[: len(head)] != head or ids[: len(upto)] != upto:
            raise DataError(f"{where}: the chat template does not render conversations as "
                            "prefixes of each other; add {% generation %} tags to mark "
                            "assistant turns")
        end = len(upto)
        span = upto[len(head):]
        if eos is not None and eos in span:
            end = len(head) + len(span) - span[::-1].index(eos)
        trained[len(head):end] = [1] * (end - len(head))
    return ids, trained


def legacy_render_prompt(prompt: Any, tokenizer, where: str = "prompt") -> list[int]:
    """Ids of a prompt ready for generation: a string is one user message, a list is a chat;
    rendered with the chat template and add_generation_prompt=True."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = _check_messages(prompt, "prompt", where)
    else:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of messages, got "
                        f"{type(prompt).__name__}")
    return list(_template(tokenizer, messages, where, True)["input_ids"])


def legacy_render_sft_row(row: dict, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(ids, trained) of one SFT row.

    ``{"messages": [...]}``: the chat template renders it; assistant turns are trained.
    ``{"prompt": str | messages, "response": str}``: prompt ids (generation prompt added, not
    trained) + response ids + eos (trained; eos not repeated if the response already ends in it).
    Raises DataError naming `where` and the missing or invalid field.
    """
    if "messages" in row:
        return legacy_render_messages(row["messages"], tokenizer, where)
    if "prompt" not in row and "response" not in row:
        raise DataError(f"{where}: row needs field 'messages', or fields 'prompt' and "
                        f"'response'; found fields {sorted(row)}")
    for key in ("prompt", "response"):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
    response = row["response"]
    if not isinstance(response, str):
        raise DataError(f"{where}: field 'response' must be a string, got "
                        f"{type(response).__name__}")
    prompt_ids = legacy_render_prompt(row["prompt"], tokenizer, where)
    response_ids = list(tokenizer.encode(response, add_special_tokens=False))
    eos = _eos_id(tokenizer)
    if not response_ids or response_ids[-1] != eos:
        response_ids.append(eos)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def legacy_load_sft_dataset(files: str | Sequence[str], tokenizer, seq_length: int,
                     truncation: str = "right") -> SFTDataset:
    """Read and render every row of `files` once into an SFTDataset.

    A rendered row may have at most seq_length + 1 ids (a Sample of at most seq_length tokens).
    Longer rows: truncation="right" keeps the first seq_length + 1 ids (stats["truncated"]);
    truncation="error" raises DataError with file:line and both lengths. Rows that end up with
    no trained token are kept and counted in stats["empty_loss"]. Raises DataError (naming the
    files and what to change) when no sample is left, or no sample has a trained token.
    Messages name the config keys train.seq_length and data.truncation.
    """
    if truncation not in TRUNCATION_CHOICES:
        raise ValueError(f"truncation={truncation!r} is not one of {', '.join(TRUNCATION_CHOICES)}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    paths = as_file_list(files)
    max_ids = int(seq_length) + 1
    ids_buf, trained_buf, offsets = array.array("q"), array.array("b"), [0]
    stats = {"rows": 0, "truncated": 0, "dropped_empty": 0, "empty_loss": 0}
    longest = 0
    for path, line, row in legacy_read_rows(paths):
        loc = where_of(path, line)
        stats["rows"] += 1
        ids, trained = legacy_render_sft_row(row, tokenizer, loc)
        longest = max(longest, len(ids))
        if len(ids) > max_ids:
            if truncation == "error":
                raise DataError(f"{loc}: rendered row has {len(ids)} tokens, more than "
                                f"train.seq_length + 1 = {max_ids} (data.truncation=error); "
                                f"raise train.seq_length, shorten the row, or set "
                                f"data.truncation=right to cut long rows")
            ids, trained = ids[:max_ids], trained[:max_ids]
            stats["truncated"] += 1
        if len(ids) < 2:
            stats["dropped_empty"] += 1
            continue
        if not any(trained[1:]):
            stats["empty_loss"] += 1
        ids_buf.extend(ids)
        trained_buf.extend(trained)
        offsets.append(len(ids_buf))
    check_not_empty(paths, stats, int(seq_length), longest)
    return SFTDataset(np.frombuffer(ids_buf, dtype=np.int64).copy(),
                      np.frombuffer(trained_buf, dtype=np.int8).copy(),
                      np.asarray(offsets, dtype=np.int64), stats,
                      seq_length=int(seq_length), truncation=truncation)




# ----------------------------------------------------------------------------- fixtures

WORDS = ["what", "is", "the", "sum", "of", "and", "copy", "repeat", "a", "b", "c", "1", "2",
         "3", "+", "?", "\\boxed{7}"]


def random_chat(rng: random.Random, turns: int, system: bool, tools: bool = False) -> list:
    text = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    chat = [{"role": "system", "content": text()}] if system else []
    for _ in range(turns):
        chat.append({"role": "user", "content": text()})
        if tools and rng.random() < 0.5:
            chat.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {
                    "a": rng.randint(0, 9), "b": rng.randint(0, 9)}}}]})
            chat.append({"role": "tool", "content": text()})
        chat.append({"role": "assistant", "content": text()})
    return chat


def random_rows(seed: int, n: int, max_turns: int, tools: bool) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if rng.random() < 0.2:
            rows.append({"prompt": " ".join(rng.choice(WORDS) for _ in range(5)),
                         "response": " ".join(rng.choice(WORDS) for _ in range(3))})
        else:
            rows.append({"messages": random_chat(rng, rng.randint(1, max_turns),
                                                 rng.random() < 0.5, tools)})
    return rows


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(d), 200)
    tagged = AutoTokenizer.from_pretrained(str(d))
    plain = AutoTokenizer.from_pretrained(str(d))
    plain.chat_template = (plain.chat_template.replace("{% generation %}", "")
                           .replace("{% endgeneration %}", ""))
    out = {"tiny-tagged": (tagged, 3, False), "tiny-plain": (plain, 3, False)}
    for family, tools in (("chatml", False), ("qwen2.5", True), ("llama3.1", False)):
        out[family] = (build_char_tokenizer(None, family), 3, tools)
    out["qwen3-single-turn"] = (build_char_tokenizer(None, "qwen3"), 1, False)
    return out


CASES = ["tiny-tagged", "tiny-plain", "chatml", "qwen2.5", "llama3.1", "qwen3-single-turn"]


@pytest.mark.parametrize("name", CASES)
def test_rows_render_identically(tokenizers, name):
    tok, turns, tools = tokenizers[name]
    rows = random_rows(7, 60, turns, tools)
    for k, row in enumerate(rows):
        if tools and "messages" in row:
            row = {**row, "tools": TOOLS}
            if name == "qwen2.5":  # the previous code passed no tools; compare without them
                row.pop("tools")
        expected = legacy_render_sft_row(row, tok, f"x:{k}")
        assert new_render_sft_row(row, tok, f"x:{k}") == expected, (name, k)
        assert sum(expected[1]) > 0


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("size, workers", [("long", 0), ("short", 0), ("short", 2)])
def test_datasets_identical(tokenizers, name, size, workers, tmp_path, monkeypatch):
    """`short`: train.seq_length is the median rendered row length, so about half the rows are
    truncated; `workers`: 0 renders in this process, 2 in worker processes (tasks of 7 rows)."""
    monkeypatch.setattr("engine.data.cache.ROWS_PER_UNIT", 7)
    tok, turns, tools = tokenizers[name]
    path = tmp_path / "rows.jsonl"
    rows = random_rows(11, 40, turns, tools=False)
    lengths = sorted(len(legacy_render_sft_row(r, tok, "x")[0]) for r in rows)
    seq_length = 4096 if size == "long" else lengths[len(lengths) // 2]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = legacy_load_sft_dataset([str(path)], tok, seq_length)
    new = load_sft_dataset([str(path)], tok, seq_length, cache_dir=str(tmp_path / "c"),
                           num_workers=workers)
    assert new.stats == old.stats and len(new) == len(old)
    assert new.lengths.tolist() == old.lengths.tolist()
    assert new.loss_tokens.tolist() == old.loss_tokens.tolist()
    for i in range(len(old)):
        assert new[i] == old[i], (name, i)
    if size == "short":
        assert old.stats["truncated"] > 0
    # the loss: a fixed random logit table scored on both (token-mean cross-entropy)
    logits = np.random.default_rng(0).standard_normal((len(tok) + 8, len(tok)))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = lambda ds: (sum(-logp[t, l] * m for i in range(len(ds)) for t, l, m in
                           zip(ds[i].tokens, ds[i].labels, ds[i].loss_mask))
                       / sum(sum(ds[i].loss_mask) for i in range(len(ds))))
    assert loss(new) == loss(old)


def test_truncation_error_names_the_same_row(tokenizers, tmp_path, monkeypatch):
    monkeypatch.setattr("engine.data.cache.ROWS_PER_UNIT", 4)
    tok = tokenizers["tiny-plain"][0]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in random_rows(3, 30, 3, False)))
    with pytest.raises(DataError) as old:
        legacy_load_sft_dataset([str(path)], tok, 30, truncation="error")
    with pytest.raises(DataError) as new:
        load_sft_dataset([str(path)], tok, 30, truncation="error", cache_dir=str(tmp_path / "c"),
                         num_workers=2)
    assert str(new.value) == str(old.value)
