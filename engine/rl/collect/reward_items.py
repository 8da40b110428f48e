"""What reward.fn is called with for one reply: the row's text prompt (or the rendered prompt
decoded), the decoded reply, the row's answer and its other fields (docs/extending.md)."""
from __future__ import annotations


def reward_item(row: dict, prompt_ids: list[int], response_ids: list[int], tokenizer) -> dict:
    """``{**fields, "prompt", "answer", "response"}`` of one reply: `prompt` is the row's
    prompt when it is a string, else `prompt_ids` decoded without special tokens; `response`
    is `response_ids` decoded the same way."""
    text = row["prompt"] if isinstance(row["prompt"], str) else tokenizer.decode(
        prompt_ids, skip_special_tokens=True)
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "response")}
    return {**extra, "prompt": text, "answer": row["answer"],
            "response": tokenizer.decode(response_ids, skip_special_tokens=True)}
