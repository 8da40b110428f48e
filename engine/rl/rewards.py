"""Reward functions: the built-in math reward, loading user functions by spec, and scoring a
rollout batch with per-call timeouts.

A reward function is any callable ``fn(prompt: str, response: str, answer: str, **fields) ->
float``; ``fields`` are the extra columns of the dataset row. Scoring runs on one process; no
collective.
"""
from __future__ import annotations

import importlib
import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]

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


BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "none": no_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward function spec: a built-in name (``"math"``) or ``"package.module:fn"``.

    Raises ValueError naming ``spec`` when it has no colon and is not a built-in, when the
    module cannot be imported, when the attribute is missing, or when it is not callable.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    valid = f"a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or 'package.module:function'"
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"reward function spec {spec!r} is not {valid}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"reward function spec {spec!r}: cannot import module "
                         f"{module_name!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward function spec {spec!r}: module {module_name!r} has no "
                             f"attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward function spec {spec!r}: {attr!r} is a "
                         f"{type(target).__name__}, not callable")
    return target


def _call(fn: RewardFn, item: Mapping[str, Any]) -> float:
    """Call fn on one item; the score must be a finite number."""
    extra = {k: v for k, v in item.items() if k not in ("prompt", "response", "answer")}
    score = float(fn(prompt=item["prompt"], response=item["response"], answer=item["answer"],
                     **extra))
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score


def _check_items(items: Sequence[Mapping[str, Any]]) -> None:
    for i, item in enumerate(items):
        missing = [k for k in ("prompt", "response", "answer") if k not in item]
        if missing:
            raise ValueError(f"items[{i}] lacks required key(s) {missing}")


def score_responses(fn: RewardFn, items: Sequence[Mapping[str, Any]], timeout_s: float | None,
                    max_workers: int = 8) -> tuple[list[float], int]:
    """Score every item with ``fn(prompt=..., response=..., answer=..., **extra_fields)``.

    Returns ``(scores, num_errors)``, scores in item order. A call that raises, returns
    something that is not a finite number, or runs longer than ``timeout_s`` seconds (measured
    from the moment it starts, not from submission) scores 0.0 and counts as an error.

    ``timeout_s=None`` calls fn sequentially in the calling thread (no timeout). Otherwise calls
    run on a pool of ``max_workers`` daemon threads. Python cannot kill a thread: a call that
    timed out keeps running in the background (its result is discarded) and a fresh worker
    replaces it, so hung calls never stall the rest. The pool is built from daemon threads
    rather than ``concurrent.futures.ThreadPoolExecutor`` because that executor joins its
    workers at interpreter exit, so one reward function that never returns would keep the
    training process from exiting. The GIL still applies: threads bound the wait, they do not
    speed up pure-Python reward functions.
    """
    _check_items(items)
    scores = [0.0] * len(items)
    errors: list[str] = []
    if timeout_s is None:
        for i, item in enumerate(items):
            try:
                scores[i] = _call(fn, item)
            except Exception as exc:  # a user function may raise anything
                errors.append(f"items[{i}]: {exc!r}")
    else:
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"need timeout_s > 0 and max_workers >= 1, got {timeout_s}, "
                             f"{max_workers}")
        _score_with_timeout(fn, items, timeout_s, max_workers, scores, errors)
    if errors:
        logger.warning("reward function failed on %d of %d items; first: %s", len(errors),
                       len(items), errors[0])
    return scores, len(errors)


def _score_with_timeout(fn: RewardFn, items: Sequence[Mapping[str, Any]], timeout_s: float,
                        max_workers: int, scores: list[float], errors: list[str]) -> None:
    """Fill ``scores``/``errors`` using daemon workers and per-call deadlines (see caller)."""
    tasks: queue.SimpleQueue = queue.SimpleQueue()   # item index, or None to stop a worker
    results: queue.SimpleQueue = queue.SimpleQueue()  # (index, score or None, error or None)
    started: dict[int, float] = {}  # index -> monotonic start time, while the call runs

    def worker() -> None:
        while (index := tasks.get()) is not None:
            started[index] = time.monotonic()
            try:
                outcome = (index, _call(fn, items[index]), None)
            except Exception as exc:
                outcome = (index, None, repr(exc))
            started.pop(index, None)
            results.put(outcome)

    def spawn() -> None:
        threading.Thread(target=worker, name="reward-fn", daemon=True).start()

    for index in range(len(items)):
        tasks.put(index)
    num_workers = min(max_workers, len(items))
    for _ in range(num_workers):
        spawn()

    pending = set(range(len(items)))
    while pending:
        now = time.monotonic()
        for index, t0 in started.copy().items():
            if index in pending and now - t0 >= timeout_s:
                pending.discard(index)
                errors.append(f"items[{index}]: timed out after {timeout_s} s")
                spawn()  # the hung worker is lost; keep the pool at full strength
                num_workers += 1
        if not pending:
            break
        deadlines = [t0 + timeout_s for i, t0 in started.copy().items() if i in pending]
        wait = (min(deadlines) if deadlines else now + timeout_s) - now
        try:
            index, score, error = results.get(timeout=max(wait, 0.0))
        except queue.Empty:
            continue
        if index in pending:  # else it already timed out
            pending.discard(index)
            if error is None:
                scores[index] = score
            else:
                errors.append(f"items[{index}]: {error}")
    for _ in range(num_workers):
        tasks.put(None)  # one per worker; hung ones read theirs if their call ever returns
