"""The built-in tool environment (env.fn=tools): tool-call parsing per model family, JSON schemas
from signatures and docstrings, observations rendered as the template's suffix for the Qwen2.5,
Qwen3 (with reasoning) and Llama 3.1 templates as shipped (tests/test_data_templates.py),
tool worker processes (timeout, crash, output cap), and ToolEnv's steps."""
from __future__ import annotations

import json
import os
import time

import pytest

from engine.data.observation import observation_ids, observation_text
from engine.data.tool_calls import detect_format, parse_tool_calls
from engine.rl.env.example_tools import calculate
from engine.rl.env.tool_pool import ToolPool
from engine.rl.env.tool_schema import load_tools, tool_schema
from engine.rl.env.tools_env import ToolEnv
from tools.char_tokenizer import FAMILIES, build_char_tokenizer


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b (int): the second
            number
    Returns:
        the sum
    """
    return a + b


def shout(text: str) -> str:
    """Print to stdout (must not break the protocol) and return a long string."""
    print("noise on stdout")
    return text * 1000


def boom() -> str:
    """Raise."""
    raise RuntimeError("tool exploded")


def nap(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "awake"


def die() -> str:
    """Kill the worker process."""
    os._exit(3)


SPECS = [f"tests.test_rl_tools:{n}" for n in ("add", "shout", "boom", "nap", "die")]


# ----------------------------------------------------------------------------- parsing

def test_hermes_calls_reasoning_and_malformed():
    text = ('<think>maybe <tool_call>{"name": "x"}</tool_call></think>\n\nLet me add.\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2}),
                                                             ("add", {"a": 5})]
    assert len(parsed.errors) == 1 and "malformed tool call" in parsed.errors[0]
    unclosed = parse_tool_calls('<tool_call>{"name": "add"', "hermes")
    assert not unclosed.calls and "without </tool_call>" in unclosed.errors[0]
    assert parse_tool_calls("<think>x</think>The answer is 3.", "hermes").is_answer


def test_llama3_json_calls():
    parsed = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}',
                              "llama3_json")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1})]
    assert parse_tool_calls(' {"name": "add", "arguments": {"b": 2}} ',
                            "llama3_json").calls[0].arguments == {"b": 2}
    bad = parse_tool_calls('{"name": "add", "parameters": [1]}', "llama3_json")
    assert not bad.calls and "must be a JSON object" in bad.errors[0]
    assert "malformed" in parse_tool_calls("{not json", "llama3_json").errors[0]
    assert parse_tool_calls("It is 3.", "llama3_json").is_answer


def test_format_detected_from_each_template():
    assert detect_format(FAMILIES["qwen2.5"][0]) == "hermes"
    assert detect_format(FAMILIES["qwen3"][0]) == "hermes"
    assert detect_format(FAMILIES["llama3.1"][0]) == "llama3_json"
    assert detect_format(FAMILIES["chatml"][0]) is None


def test_schema_from_signature_and_docstring():
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "integer", "description": "the second number"}},
            "required": ["a"]}}}
    with pytest.raises(ValueError, match="tool 'f' takes \\*args"):
        tool_schema(lambda *args: 0, "f")
    with pytest.raises(ValueError, match="env.tools entry 'nomodule:f' cannot be loaded"):
        load_tools(["nomodule:f"])
    with pytest.raises(ValueError, match="two tools named 'add'"):
        load_tools(["tests.test_rl_tools:add", "tests.test_rl_tools:add"])


# ----------------------------------------------------------------------------- suffixes

TOOLS = [tool_schema(add)]
ASK = [{"role": "user", "content": "What is 1+2?"}]
RESULT = [{"role": "tool", "name": "add", "content": "3"}]


def _text(tok, ids):
    return "".join(tok.convert_ids_to_tokens(ids))


def _trajectory(tok, turn1: str, turn2: str, obs: list[dict], eot: str):
    """prompt ids + turn 1 "sampled" + observation suffix + turn 2 "sampled" (ids)."""
    prompt = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    t1 = tok.encode(turn1 + eot, add_special_tokens=False)
    messages = ASK + [{"role": "assistant", "content": turn1}]
    o = observation_ids(tok, messages, obs, TOOLS)
    t2 = tok.encode(turn2 + eot, add_special_tokens=False)
    return list(prompt) + t1 + o + t2, len(prompt) + len(t1), o


@pytest.mark.parametrize("family,turn1,eot,tail", [
    ("qwen2.5", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "<|im_end|>", "\n"),
    ("qwen3", '<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
     '{"a": 1, "b": 2}}\n</tool_call>', "<|im_end|>", "\n"),
    ("llama3.1", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "<|eot_id|>", ""),
])
def test_observation_suffix_matches_the_full_rendering(family, turn1, eot, tail):
    """With a tool result, each template renders the whole conversation exactly as the
    trajectory of sampled turns and observation suffixes (Qwen3 keeps the reasoning of a
    multi-step tool turn), so the suffix is what the model sees in SFT data too."""
    tok = build_char_tokenizer(None, family)
    # Qwen3 samples an (empty) reasoning block in every turn
    turn2 = ("<think>\n\n</think>\n\n" if family == "qwen3" else "") + "It is 3."
    ids, start, obs = _trajectory(tok, turn1, turn2, RESULT, eot)
    full = tok.apply_chat_template(ASK + [{"role": "assistant", "content": turn1}] + RESULT
                                   + [{"role": "assistant", "content": turn2}],
                                   tools=TOOLS, tokenize=False)
    assert _text(tok, ids) + tail == full
    suffix = observation_text(tok, ASK + [{"role": "assistant", "content": turn1}], RESULT,
                              TOOLS)
    assert _text(tok, obs) == suffix
    assert {"qwen2.5": suffix.startswith("\n<|im_start|>user\n<tool_response>\n3\n"),
            "qwen3": suffix.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"),
            "llama3.1": suffix.startswith("<|start_header_id|>ipython<|end_header_id|>")
            }[family]


def test_qwen3_rewrites_earlier_reasoning_but_not_the_trajectory():
    """A user observation makes Qwen3 drop the first turn's reasoning from the full rendering;
    the trajectory keeps the ids already sampled, and the suffix is the plain user turn."""
    tok = build_char_tokenizer(None, "qwen3")
    turn1 = "<think>\nsecret plan\n</think>\n\n3"
    follow = [{"role": "user", "content": "Sure?"}]
    ids, start, obs = _trajectory(tok, turn1, "Yes.", follow, "<|im_end|>")
    text = _text(tok, ids)
    assert "secret plan" in text and _text(tok, obs) == (
        "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    full = tok.apply_chat_template(ASK + [{"role": "assistant", "content": turn1}] + follow
                                   + [{"role": "assistant", "content": "Yes."}],
                                   tools=TOOLS, tokenize=False)
    assert "secret plan" not in full and text + "\n" != full
    prompt_and_turn = _text(tok, ids[:start])
    assert text.startswith(prompt_and_turn) and prompt_and_turn.endswith("3<|im_end|>")


# ----------------------------------------------------------------------------- workers

def test_tool_pool_runs_caps_times_out_and_survives_crashes():
    pool = ToolPool(SPECS, size=2, timeout_s=2.0, max_chars=50)
    try:
        assert pool.call("add", {"a": 2, "b": 3}) == (True, "5")
        ok, out = pool.call("shout", {"text": "ab"})
        assert ok and out.startswith("ab" * 25) and "1950 more characters cut" in out
        assert pool.call("boom", {}) == (False, "RuntimeError: tool exploded")
        assert pool.call("add", {"c": 1})[1].startswith("TypeError")
        assert pool.call("nope", {})[1].startswith("LookupError: no tool named 'nope'")
        t0 = time.monotonic()
        ok, out = pool.call("nap", {"seconds": 30})
        assert not ok and "timed out after 2 s" in out and time.monotonic() - t0 < 10
        assert pool.call("die", {}) == (False, "the tool 'die' crashed its worker process")
        assert pool.call("add", {"a": 1}) == (True, "1")    # a fresh worker took over
        pids = {w.proc.pid for w in pool._all}
        assert os.getpid() not in pids and len(pids) >= 3
    finally:
        pool.close()


def test_tool_env_steps_and_final_answer():
    pool = ToolPool(SPECS, size=1, timeout_s=5.0, max_chars=100)
    seen = {}

    def reward(prompt, response, answer, **fields):
        seen.update(prompt=prompt, response=response, answer=answer, **fields)
        return 1.0 if "3" in response else 0.0

    try:
        env = ToolEnv({"prompt": ASK, "answer": "3", "level": 2}, pool=pool, fmt="hermes",
                      reward_fn=reward)
        step = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                        '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
                        '<tool_call>oops</tool_call>')
        assert step["done"] is False and step["reward"] == 0.0
        assert [m["content"] for m in step["observations"]][1:] == [
            "3", "error: RuntimeError: tool exploded"]
        assert step["observations"][0]["content"].startswith("error: malformed tool call")
        assert step["metrics"] == {"tool_calls": 3.0, "tool_errors": 2.0}
        final = env.step("The answer is 3.")
        assert final["done"] and final["reward"] == 1.0
        assert seen == {"prompt": "What is 1+2?", "response": "The answer is 3.",
                        "answer": "3", "level": 2}
    finally:
        pool.close()


def test_calculator_example_tool():
    assert calculate("12 * (3 + 4)") == "84" and calculate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 1000", "x + 1"):
        with pytest.raises(ValueError):
            calculate(bad)
    assert json.loads(json.dumps(tool_schema(calculate)))["function"]["name"] == "calculate"
