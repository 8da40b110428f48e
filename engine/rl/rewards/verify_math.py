"""`reward.fn=math_verify`: Hugging Face math-verify 0.9 (the checker open-r1 and TRL use),
which compares answers symbolically (``\\frac{1}{2}``, ``0.5`` and ``\\dfrac12`` agree; so do
sets, intervals, matrices).

math-verify bounds its parsing and comparison with ``signal.alarm``, which works only in a
process's main thread (elsewhere it raises). It is scored in worker processes
(engine.rl.rewards.pool, the default) where each call runs in the worker's main thread; called
from any other thread (`reward.num_workers=0`'s thread scorer) it runs without math-verify's
own bound, and reward.timeout_s alone bounds the call.
"""
from __future__ import annotations

import re
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# the row's answer: LaTeX or a plain expression; bare LaTeX ("(0,1]", "\{1,2\}") parses only
# inside math delimiters, so an answer without any is read as "$answer$" (an escaped dollar,
# "\$5", is a currency sign inside the math, not a delimiter)
GOLD_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
# the response: math-verify's extraction, \boxed{} first (boxed_match_priority=0), as open-r1
PREDICTION_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
DELIMITERS = ("\\boxed", "\\(", "\\[")
# a "$" after an even number of backslashes (none included): a delimiter, not an escaped sign
DOLLAR_DELIMITER = re.compile(r"(?<!\\)(?:\\\\)*\$")
TIMEOUT_S = 5  # math-verify's own per-parse and per-comparison bound (its default)


def gold_text(answer: str) -> str:
    """The text math-verify parses as the gold answer: ``answer`` itself when it has math
    delimiters (a ``$`` that is not escaped, ``\\(``, ``\\[``) or a ``\\boxed{}``, else
    ``$answer$``: MATH's currency answers (``\\$18.90``) parse as math-verify parses
    ``$\\$18.90$``."""
    answer = str(answer).strip()
    delimited = DOLLAR_DELIMITER.search(answer) or any(d in answer for d in DELIMITERS)
    return answer if delimited else f"${answer}$"


def math_verify_reward(prompt: str, response: str, answer: str, **fields: Any) -> float:
    """1.0 if math-verify finds the response's answer equal to the row's ``answer``, else 0.0
    (also when either side has no parsable answer)::

        gold = parse(gold_text(answer), GOLD_EXTRACTION)
        pred = parse(response, PREDICTION_EXTRACTION)
        verify(gold, pred)

    math-verify's own timeouts (TIMEOUT_S per parse and comparison, main thread only) give
    "no answer" / "not equal"; reward.timeout_s bounds the whole call.
    """
    limit = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text(answer), extraction_config=GOLD_EXTRACTION,
                 parsing_timeout=limit)
    if not gold:
        return 0.0
    predicted = parse(response, extraction_config=PREDICTION_EXTRACTION,
                      parsing_timeout=limit)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=limit) else 0.0
