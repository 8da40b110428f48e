"""Unpaired preference rows (KTO; TRL's unpaired preference format) read and rendered.

Formats (each row is read on its own, so one file may mix them):
- conversational: ``{"prompt": [messages], "completion": [messages], "label": true}``; the
  prompt may hold a system message and earlier turns (context, never trained), the
  completion the assistant message(s) (tool messages and later turns allowed; only its
  assistant messages are trained);
- standard text: ``{"prompt": str, "completion": str, "label": false}``: one user message and
  one assistant message (rendered with the chat template, as DPO's text rows are).
``label`` is a JSON boolean: true for a desirable completion, false for an undesirable one.
Optional: ``tools`` (as SFT rows have it). Null fields count as absent.

Rendering is DPO's for one side (engine.data.preference_render.render_side): the completion's
trained tokens are its assistant tokens at or after the prompt boundary, and the example's
prompt is its tokens before the first of them. Refused (DataError, ``file:line``): a missing
or null prompt, completion or label; a label that is not a boolean (1, "true", ... included);
an empty completion (an empty string, an empty list, an assistant reply with no content and
no tool call); a completion without an assistant message; paired rows (chosen / rejected:
split them into two unpaired rows); images; a prompt longer than seq_length; and with
truncation="error" an example longer than seq_length + 1 ids (truncation="right" cuts it on
the right, the prompt kept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.data.files import DataError
from engine.data.preference_render import RenderedSide, render_side
from engine.data.render import render_prompt
from engine.data.rows import check_messages, check_tools

FORMATS = ("conversational {'prompt': [messages], 'completion': [messages], 'label': bool} "
           "or standard text {'prompt': str, 'completion': str, 'label': bool}")
UNPAIRED_FORMS = ("conversational", "text")   # RenderedExample.form, the dataset's stats keys


@dataclass
class RenderedExample:
    """One unpaired row rendered: ids (prompt + completion), trained (1 on the completion's
    trained tokens), truncated, the prompt length in tokens, the label and the row's format."""

    side: RenderedSide
    prompt_length: int
    label: bool
    form: str


def _label(row: dict, where: str) -> bool:
    if row.get("label") is None:
        raise DataError(f"{where}: missing field 'label' (found fields {sorted(row)}): an "
                        "unpaired row needs label true (desirable) or false (undesirable); "
                        f"supported formats: {FORMATS}")
    value = row["label"]
    if not isinstance(value, bool):
        raise DataError(f"{where}: field 'label' must be a boolean (true: desirable, false: "
                        f"undesirable), got {type(value).__name__} {value!r}")
    return value


def _refuse_other_shapes(row: dict, where: str) -> None:
    if row.get("chosen") is not None or row.get("rejected") is not None:
        raise DataError(f"{where}: a paired row (fields 'chosen'/'rejected'); KTO reads "
                        "unpaired rows: write each side as its own row with 'completion' and "
                        f"'label' (true for chosen, false for rejected); supported formats: "
                        f"{FORMATS}")
    for key in ("images", "image"):
        if row.get(key) not in (None, []):
            raise DataError(f"{where}: the row has images (field {key!r}); images are not "
                            "supported for unpaired preference data (KTO trains on text)")
    for key in ("prompt", "completion"):
        if row.get(key) is None:
            raise DataError(f"{where}: missing field {key!r} (found fields {sorted(row)}); "
                            f"supported formats: {FORMATS}")


def _messages(row: dict, where: str) -> tuple[list[dict], list[dict], str]:
    """(prompt messages, completion messages, form)."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError(f"{where}: field 'completion' is empty ({completion!r}); an "
                            "unpaired row needs a reply to judge")
        return ([{"role": "user", "content": prompt}],
                [{"role": "assistant", "content": completion}], "text")
    if isinstance(prompt, list) and isinstance(completion, list):
        if not completion:
            raise DataError(f"{where}: field 'completion' is an empty list; an unpaired row "
                            "needs a reply to judge")
        return (check_messages(prompt, "prompt", where),
                check_messages(completion, "completion", where), "conversational")
    raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__} and 'completion' a "
                    f"{type(completion).__name__}; both must be strings or both lists of "
                    f"messages; supported formats: {FORMATS}")


def _check_completion(messages: list[dict], where: str) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(f"{where}: field 'completion' has no assistant message (roles: "
                        f"{roles}); the completion is the assistant reply to train on")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
            raise DataError(f"{where}: field 'completion': assistant message {i} is an empty "
                            f"reply (content {m['content']!r}); an unpaired row needs a reply "
                            "to judge")


def render_unpaired_row(row: Any, tokenizer, where: str) -> RenderedExample:
    """`row` checked and rendered (module docstring), not yet cut to a length limit
    (fit_example does that). DataError naming `where` for every refusal."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    _refuse_other_shapes(row, where)
    label = _label(row, where)
    tools = check_tools(row.get("tools"), where)
    prompt, completion, form = _messages(row, where)
    _check_completion(completion, where)
    prompt_ids = render_prompt(prompt, tokenizer, where, tools)
    side, prompt_length = render_side(prompt, tools, completion, prompt_ids, tokenizer,
                                      "completion", where)
    return RenderedExample(side, prompt_length, label, form)


def fit_example(example: RenderedExample, seq_length: int, truncation: str,
                where: str) -> RenderedExample:
    """`example` with at most seq_length + 1 ids (a Sample of at most seq_length tokens): a
    prompt of more than seq_length tokens is refused; a longer example is cut on the right
    (truncation="right", at least one completion token remains) or refused ("error").
    Messages name train.seq_length and data.truncation."""
    if example.prompt_length > seq_length:
        raise DataError(f"{where}: the prompt renders to {example.prompt_length} tokens, more "
                        f"than train.seq_length={seq_length}, so no completion token would fit; "
                        "raise train.seq_length or shorten the prompt")
    side, max_ids = example.side, seq_length + 1
    if len(side.ids) <= max_ids:
        return example
    if truncation == "error":
        raise DataError(f"{where}: the example renders to {len(side.ids)} tokens, more than "
                        f"train.seq_length + 1 = {max_ids} (data.truncation=error); raise "
                        "train.seq_length, shorten the row, or set data.truncation=right")
    example.side = RenderedSide(side.ids[:max_ids], side.trained[:max_ids], True)
    return example
