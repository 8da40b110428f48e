"""The CPU demos' greedy evaluation (`python -m tools.demo evaluate`, recipes/*_demo.sh): each HF
model answers the prompts of a data file greedily in transformers (tool turns through the
calculator when given its schema), scored by the built-in math reward."""
from __future__ import annotations

import json


def _greedy_turn(model, tok, messages: list[dict], tools, max_new_tokens: int) -> str:
    import torch

    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def answer(model, tok, prompt: str, max_new_tokens: int, tools: list[dict] | None,
           max_turns: int) -> tuple[str, str]:
    """(final answer text, the whole exchange as text) of greedy decoding. With `tools` (the
    calculator's schema, tools.demo.calculator_tools()), tool calls in the hermes format run
    the calculator and its result is the next turn's observation, for at most `max_turns`
    assistant turns (as env.max_turns=3 in the demo)."""
    from engine.rl.env.example_tools import calculate
    from engine.data.tool_calls import parse_tool_calls

    messages = [{"role": "user", "content": prompt}]
    transcript = []
    for _ in range(max_turns if tools else 1):
        text = _greedy_turn(model, tok, messages, tools, max_new_tokens)
        transcript.append(text)
        parsed = parse_tool_calls(text, "hermes") if tools else None
        if parsed is None or parsed.is_answer or parsed.errors:
            return text, " | ".join(transcript)
        calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed.calls]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in parsed.calls:
            try:
                result = calculate(**call.arguments) if call.name == "calculate" else (
                    f"unknown tool {call.name!r}")
            except Exception as e:  # noqa: BLE001 - the tool's error is the observation
                result = f"error: {e}"
            transcript.append(f"<tool: {result}>")
            messages.append({"role": "tool", "content": str(result)})
    return "", " | ".join(transcript)


def evaluate(models: list[tuple[str, str]], data: str, limit: int, max_new_tokens: int,
             tools: list[dict] | None, show: int, max_turns: int) -> dict[str, float]:
    """{name: accuracy} of each (name, HF dir) on the first `limit` rows of `data`, printed
    with `show` example answers per model; `tools`: the calculator's schema for tool turns
    (None: one plain turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.rl.rewards import math_reward

    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(data)][:limit]
    accuracy = {}
    for name, path in models:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        right = 0
        for i, row in enumerate(rows):
            final, transcript = answer(model, tok, row["prompt"], max_new_tokens, tools,
                                       max_turns)
            ok = math_reward(row["prompt"], final, str(row["answer"])) == 1.0
            right += ok
            if i < show:
                print(f"  [{name}] {row['prompt']!r} -> {transcript!r} "
                      f"({'right' if ok else 'wrong'}, answer {row['answer']})")
        accuracy[name] = right / len(rows)
    for name, acc in accuracy.items():
        print(f"greedy accuracy of {name}: {acc:.3f} on {len(rows)} prompts")
    return accuracy
