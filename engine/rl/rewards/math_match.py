"""`reward.fn=math`: the hand-written last-``\\boxed{}``-or-last-number exact match (and
`reward.fn=none`). docs/rewards.md's table shows where it differs from `math_verify`."""
from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\boxed\s*\{")
# A number not glued to a preceding digit/dot; the sign only counts when it is not a binary
# minus (preceded by a word character or ')'). Thousands separators must be groups of 3.
_NUMBER = re.compile(
    r"(?<![\d.])(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_CANONICAL_NUMBER = re.compile(r"([-+]?)(\d*)(?:\.(\d*))?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, or None if there is none.

    Nested braces are kept (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``). An unclosed
    ``\\boxed{`` (a truncated response) is skipped.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for pos in range(match.end(), len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end():pos]
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (ints, decimals, signs, "1,000"), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(text: str) -> str:
    """Canonical form for exact comparison.

    All whitespace is removed. A plain decimal number (optional sign, thousands commas allowed)
    is rewritten canonically: no leading "+", commas removed, no leading zeros, no trailing
    fractional zeros or bare ".", "-0" -> "0" (so "+1,000.50" -> "1000.5", ".5" -> "0.5",
    "3.0" -> "3"). Anything else only loses its whitespace and a leading "+".
    """
    text = "".join(text.split())
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    match = _CANONICAL_NUMBER.fullmatch(text)
    if match is None or not (match.group(2) or match.group(3)):
        return text[1:] if text.startswith("+") else text
    whole = match.group(2).lstrip("0") or "0"
    frac = (match.group(3) or "").rstrip("0")
    number = f"{whole}.{frac}" if frac else whole
    return f"-{number}" if match.group(1) == "-" and number != "0" else number


def extract_answer(response: str) -> str | None:
    """The response's final answer: the last balanced ``\\boxed{}`` content, else the last
    number, else None."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def math_reward(prompt: str, response: str, answer: str, **fields: Any) -> float:
    """1.0 if the response's final answer (see :func:`extract_answer`) equals ``answer`` after
    :func:`normalize_answer` on both, else 0.0 (also when no answer can be extracted)."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if normalize_answer(predicted) == normalize_answer(str(answer)) else 0.0


def no_reward(prompt: str, response: str, answer: str, **fields: Any) -> float:
    """0.0 for every response (`reward.fn=none`: pure on-policy distillation)."""
    return 0.0
