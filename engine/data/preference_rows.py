"""Preference rows (TRL's preference formats) read into a prompt and two sides.

Formats (each row is read on its own, so one file may mix them):
- explicit prompt, conversational: ``{"prompt": [messages], "chosen": [messages], "rejected":
  [messages]}``; the prompt may hold a system message and earlier turns (assistant turns
  included: they are context, never trained); each side holds the assistant message(s) (tool
  messages and later turns allowed; only its assistant messages are trained);
- implicit prompt: ``{"chosen": [conversation], "rejected": [conversation]}``: the prompt is
  the shared message prefix, split as trl.data_utils.extract_prompt (TRL 1.16) splits it: the
  first index where the two lists differ; when one list is a prefix of the other (or both are
  equal) TRL's loop ends on the last shared index, so that message starts both sides;
- standard text: ``{"prompt": str, "chosen": str, "rejected": str}``: one user message and
  one assistant message per side (rendered with the chat template, not as raw text).
Optional fields: ``tools`` (as SFT rows have it), ``margin`` (a finite number, TRL's
RewardTrainer column). Null fields count as absent (Parquet fills a mixed file's missing
columns with nulls). Every refusal is a DataError starting with ``file:line``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.data.files import DataError
from engine.data.rows import check_messages, check_tools

FORMATS = ("explicit prompt {'prompt': [messages], 'chosen': [messages], 'rejected': "
           "[messages]}, implicit prompt {'chosen': [messages], 'rejected': [messages]}, or "
           "standard text {'prompt': str, 'chosen': str, 'rejected': str}")
SIDES = ("chosen", "rejected")
FORM_NAMES = ("explicit", "implicit", "text")   # PreferenceRow.form, the dataset's stats keys


@dataclass
class PreferenceRow:
    """One preference row, checked: the shared prompt, each side's messages, tools, margin,
    and which format it came in (FORM_NAMES)."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    tools: list[dict] | None
    margin: float | None
    form: str


def extract_prompt(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen rest, rejected rest): trl.data_utils.extract_prompt on message lists,
    its loop reproduced (idx stays on the last index when no message differs)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _margin(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{where}: field 'margin' must be a number, got "
                        f"{type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {value!r}")
    return float(value)


def _has_image_part(messages: Any) -> int | None:
    """Index of the first message whose content holds an image part, else None."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image"
                                             for p in content):
            return i
    return None


def _refuse_images(row: dict, where: str) -> None:
    why = "images are not supported for preference data (DPO and reward models train on text)"
    for key in ("images", "image"):
        if row.get(key) not in (None, []):
            raise DataError(f"{where}: the row has images (field {key!r}); {why}")
    for key in ("prompt", *SIDES):
        i = _has_image_part(row.get(key))
        if i is not None:
            raise DataError(f"{where}: {key}[{i}] has an image part; {why}")


def _check_side(messages: list[dict], field: str, where: str, implicit: bool) -> None:
    """A side needs an assistant message, and no assistant message of it may be empty."""
    after = " after the shared prompt" if implicit else ""
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise DataError(f"{where}: field {field!r} has no assistant message{after} (roles: "
                        f"{roles}); each side needs the assistant reply to train on")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
            raise DataError(f"{where}: field {field!r}{after}: assistant message {i} is an "
                            f"empty reply (content {m['content']!r}); a preference pair needs "
                            "a reply on each side")


def _conversational(row: dict, where: str) -> tuple[list, list, list, str]:
    prompt = row.get("prompt")
    chosen = check_messages(row["chosen"], "chosen", where)
    rejected = check_messages(row["rejected"], "rejected", where)
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not prompt:
            raise DataError(f"{where}: implicit-prompt row: 'chosen' and 'rejected' differ in "
                            "their first message, so they share no prompt; give the prompt "
                            "as field 'prompt' or make both conversations start with it")
        return prompt, chosen, rejected, "implicit"
    if not isinstance(prompt, list):
        raise DataError(f"{where}: field 'prompt' is a {type(prompt).__name__} but 'chosen' "
                        f"and 'rejected' are messages; supported formats: {FORMATS}")
    return check_messages(prompt, "prompt", where), chosen, rejected, "explicit"


def _text(row: dict, where: str) -> tuple[list, list, list, str]:
    prompt = row.get("prompt")
    if prompt is None:
        raise DataError(f"{where}: 'chosen' and 'rejected' are strings but the row has no "
                        f"'prompt': an implicit prompt needs conversations (lists of messages); "
                        f"supported formats: {FORMATS}")
    if not isinstance(prompt, str):
        raise DataError(f"{where}: 'chosen' and 'rejected' are strings but field 'prompt' is "
                        f"a {type(prompt).__name__}; supported formats: {FORMATS}")
    return ([{"role": "user", "content": prompt}],
            [{"role": "assistant", "content": row["chosen"]}],
            [{"role": "assistant", "content": row["rejected"]}], "text")


def read_preference_row(row: dict, where: str) -> PreferenceRow:
    """`row` checked and split into prompt and sides (module docstring); DataError naming
    `where` (``file:line``) and the field for anything refused."""
    missing = [k for k in SIDES if row.get(k) is None]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r} (found fields {sorted(row)}); "
                        f"supported formats: {FORMATS}")
    _refuse_images(row, where)
    margin = _margin(row.get("margin"), where)
    tools = check_tools(row.get("tools"), where)
    kinds = {type(row[k]) for k in SIDES}
    if kinds == {str}:
        prompt, chosen, rejected, form = _text(row, where)
    elif kinds == {list}:
        prompt, chosen, rejected, form = _conversational(row, where)
    else:
        raise DataError(f"{where}: 'chosen' is a {type(row['chosen']).__name__} and "
                        f"'rejected' a {type(row['rejected']).__name__}; both must be strings "
                        f"or both lists of messages; supported formats: {FORMATS}")
    for field, side in zip(SIDES, (chosen, rejected)):
        _check_side(side, field, where, form == "implicit")
    return PreferenceRow(prompt, chosen, rejected, tools, margin, form)
