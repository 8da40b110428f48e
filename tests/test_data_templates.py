"""Chat templates as model families ship them (structure reproduced here, nothing downloaded):
Qwen3 (drops earlier turns' reasoning, so prefix renderings are not prefixes), Qwen2.5 (default
system prompt, tool calls), Llama 3.1 (date header, <|eot_id|>), plain chatml. The trained tokens
are checked as text: every assistant turn of the final rendering - content, reasoning where
rendered, tool calls, end-of-turn token - and nothing of the headers.

The templates and `build_char_tokenizer` (a character-level fast tokenizer that knows a family's
special tokens) live in tools/char_tokenizer.py.
"""
from __future__ import annotations

import json

import pytest

from engine.data.datasets import DataError, load_sft_dataset, render_messages, render_sft_row
from tools.char_tokenizer import FAMILIES, build_char_tokenizer


@pytest.fixture(scope="module")
def toks():
    return {f: build_char_tokenizer(None, f) for f in FAMILIES}


def trained_runs(tok, ids, mask) -> list[str]:
    """The trained text: each maximal run of trained ids, decoded token by token."""
    runs, cur = [], None
    for i, m in zip(ids, mask):
        if m:
            cur = (cur or "") + tok.convert_ids_to_tokens(i)
        elif cur is not None:
            runs.append(cur)
            cur = None
    return runs + ([cur] if cur is not None else [])


TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"},
                                               "b": {"type": "number"}}}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
TOOL_CHAT = [{"role": "user", "content": "What is 1+2?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": "3"},
             {"role": "assistant", "content": "It is 3."}]
TWO_TURNS = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
             {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4", "reasoning_content": "add them"}]


def test_chatml_two_turns(toks):
    tok = toks["chatml"]
    ids, mask = render_messages(TWO_TURNS, tok, "x:1")
    assert trained_runs(tok, ids, mask) == ["Hello!<|im_end|>", "4<|im_end|>"]
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_qwen25_default_system_prompt_and_tool_calls(toks):
    tok = toks["qwen2.5"]
    ids, mask = render_messages(TWO_TURNS[1:], tok, "x:1")
    assert "You are Qwen, created by Alibaba Cloud." in tok.decode(ids)
    assert trained_runs(tok, ids, mask) == ["Hello!<|im_end|>", "4<|im_end|>"]
    ids, mask = render_sft_row({"messages": TOOL_CHAT, "tools": TOOLS}, tok, "x:1")
    text = tok.decode(ids)
    assert "# Tools" in text and "<tool_response>\n3\n</tool_response>" in text
    assert trained_runs(tok, ids, mask) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "It is 3.<|im_end|>"]


def test_qwen3_drops_earlier_reasoning_and_trains_the_final_rendering(toks):
    tok = toks["qwen3"]
    ids, mask = render_messages(TWO_TURNS, tok, "x:1")
    text = tok.decode(ids)
    assert "greet back" not in text  # the earlier turn's reasoning is not rendered ...
    assert trained_runs(tok, ids, mask) == [
        "Hello!<|im_end|>", "<think>\nadd them\n</think>\n\n4<|im_end|>"]  # ... nor trained
    # the prefix method cannot handle it: rendering messages[:3] keeps turn 1's reasoning
    prefix = tok.apply_chat_template(TWO_TURNS[:3], tokenize=False)
    assert "greet back" in prefix and not text.startswith(prefix)
    # reasoning inline in content (<think>...</think>) is split out by the template
    inline = [{"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYo"}]
    ids, mask = render_messages(inline, tok, "x:1")
    assert trained_runs(tok, ids, mask) == ["<think>\nhmm\n</think>\n\nYo<|im_end|>"]


def test_qwen3_multi_step_tool_turns_keep_their_reasoning(toks):
    tok = toks["qwen3"]
    chat = [{**m, "reasoning_content": "call the tool"} if m.get("tool_calls") else m
            for m in TOOL_CHAT]
    ids, mask = render_sft_row({"messages": chat, "tools": TOOLS}, tok, "x:1")
    assert trained_runs(tok, ids, mask) == [
        '<think>\ncall the tool\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
        '{"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 3.<|im_end|>"]


def test_llama31_date_header_and_eot(toks):
    tok = toks["llama3.1"]
    ids, mask = render_messages(TWO_TURNS, tok, "x:1")
    text = tok.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024")
    assert trained_runs(tok, ids, mask) == ["Hello!<|eot_id|>", "4<|eot_id|>"]
    chat = [{"role": "system", "content": "sys"}] + TOOL_CHAT
    ids, mask = render_sft_row({"messages": chat, "tools": TOOLS}, tok, "x:1")
    assert trained_runs(tok, ids, mask) == [
        '{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>', "It is 3.<|eot_id|>"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharegpt_equals_messages(toks, family):
    tok = toks[family]
    share = {"system": "Be brief.", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS]
    assert render_sft_row(share, tok, "x:1") == render_sft_row({"messages": plain}, tok, "x:1")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dataset_of_each_family(toks, family, tmp_path):
    """The cached dataset's samples are the rendering shifted by one, for every family."""
    tok = toks[family]
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": TWO_TURNS}, {"prompt": "Hi", "response": "Yo"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_sft_dataset([str(path)], tok, 4096, cache_dir=str(tmp_path / "cache"))
    for i, row in enumerate(rows):
        ids, mask = render_sft_row(row, tok, "x")
        assert ds[i].tokens == ids[:-1] and ds[i].labels == ids[1:]
        assert ds[i].loss_mask == mask[1:]


def test_bad_tool_call_arguments_named(toks):
    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                               "arguments": "{oops"}}]}]
    with pytest.raises(DataError, match=r"f\.jsonl:2: messages\[1\]\.tool_calls\[0\]\.function"
                                        r"\.arguments is not valid JSON"):
        render_sft_row({"messages": chat}, toks["qwen3"], "f.jsonl:2")
    with pytest.raises(DataError, match=r"f\.jsonl:2: conversations\[0\]\.from='robot' is not"):
        render_sft_row({"conversations": [{"from": "robot", "value": "x"}]}, toks["qwen3"],
                       "f.jsonl:2")
