"""`reward.fn=code`: the reply's solution (engine.rl.rewards.fences.last_code_block) against the
row's tests (engine.rl.rewards.code_tests), each test one run in the sandbox
(engine.rl.rewards.sandbox; docs/rewards.md#code).

No verdict is the solution's exit status alone; the solution's process only computes:

- StdinTest: the scorer compares the program's stdout (whitespace-normalised) with the
  expected output; the program must also exit 0;
- CallTest and AssertCalls: the calls run in the solution's process, which writes each result
  as plain data (engine.rl.rewards.plain_data); the scorer decodes and compares them. A result
  that is not plain data, a call that raises, and a process that ends (whatever its status)
  before writing every result fail the test;
- AssertScript: the test code runs in a harness process in a sandbox of its own, calling the
  solution's functions over a pipe (engine.rl.rewards.code_runner); the verdict is the
  harness's.

Score: the fraction of tests passed, or with ``score="all"`` (reward.code_score=all) 1.0 only
when all pass. No fenced block: 0.0. A run past the time left is a failed test, never a failed
call: the item's budget is reward.timeout_s x ``margin``.
"""
from __future__ import annotations

import json
import time
from typing import Any

from engine.rl.rewards import plain_data
from engine.rl.rewards.code_tests import (AssertCalls, AssertScript, CallTest, CodeTest,
                                          StdinTest, parse_tests)
from engine.rl.rewards.fences import last_code_block
from engine.rl.rewards.sandbox import Limits, run_harness, run_program

__all__ = ["CodeReward", "code_reward", "last_code_block", "normalize_output", "SCORE_MODES",
           "SANDBOX_MODES"]

SCORE_MODES = ("fraction", "all")
SANDBOX_MODES = ("strict", "relaxed")


def normalize_output(text: str) -> str:
    """Whitespace normalisation of a program's output: trailing spaces of every line and
    trailing empty lines dropped, line endings unified."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def call_results(stdout: bytes, count: int) -> list[tuple[bool, Any]] | None:
    """The first ``count`` answer lines of a ``calls`` run as (returned, value): (True, the
    decoded result) or (False, the error); None when fewer lines came or one is malformed."""
    lines = stdout.decode(errors="replace").split("\n")
    if len(lines) <= count:   # the last answer's line must end with a newline
        return None
    out = []
    for line in lines[:count]:
        try:
            answer = json.loads(line)
            out.append((True, plain_data.decode(answer["ok"])) if "ok" in answer
                       else (False, answer))
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
    return out


def _json_equal(got: Any, expected: Any) -> bool:
    """got == expected as JSON values (tuples are lists, dict keys strings), as the public
    call-based sets compare."""
    try:
        got = json.loads(json.dumps(got))
    except (TypeError, ValueError, RecursionError):
        return False
    return got == expected or (isinstance(expected, list) and len(expected) == 1
                               and got == expected[0])


def _call_passed(ok: bool, value: Any, comparison: str, expected: Any) -> bool:
    if not ok:
        return False
    if comparison == "eq":
        return value == expected
    return bool(value) if comparison == "true" else not value


class CodeReward:
    """The code reward as a picklable callable (it crosses into the scoring workers).

    Args:
        score: "fraction" (tests passed / tests) or "all" (1.0 only when every test passes).
        timeout_s: the whole item's budget (reward.timeout_s): each run gets what is left,
            its CPU rlimit included; kept under the pool's bound by `margin` so the reward
            ends its own programs first.
        limits: the sandbox's bounds per run.
    """

    def __init__(self, score: str = "fraction", timeout_s: float | None = 30.0,
                 limits: Limits = Limits(), margin: float = 0.85) -> None:
        if score not in SCORE_MODES:
            raise ValueError(f"reward.code_score={score!r} is not one of {SCORE_MODES}")
        self.score, self.limits = score, limits
        self.budget_s = (timeout_s if timeout_s is not None else 30.0) * margin

    def __call__(self, prompt: str, response: str, answer: Any = None, **fields: Any) -> float:
        tests = parse_tests(fields)
        code = last_code_block(response)
        if code is None:
            return 0.0
        deadline = time.monotonic() + self.budget_s
        passed = 0
        for test in tests:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            passed += self.passes(test, code, left)
        if self.score == "all":
            return 1.0 if passed == len(tests) else 0.0
        return passed / len(tests)

    def passes(self, test: CodeTest, code: str, left: float) -> bool:
        """Whether ``code`` passes ``test`` within ``left`` seconds (module docstring)."""
        files = {"solution.py": code}
        if isinstance(test, StdinTest):
            result = run_program(files, "main", test.input.encode(), left, self.limits)
            return result.returncode == 0 and normalize_output(
                result.stdout.decode(errors="replace")) == normalize_output(test.output)
        if isinstance(test, AssertScript):
            result = run_harness(code, test.code, left, self.limits)
            return result.returncode == 0 and result.stdout == b"pass\n"
        if isinstance(test, CallTest):
            calls = [(test.fn_name, list(test.args), {})]
        elif isinstance(test, AssertCalls):
            calls = [(c.fn_name, list(c.args), c.kwargs) for c in test.calls]
        else:
            raise TypeError(f"not a code test: {test!r}")
        try:
            request = json.dumps([[name, plain_data.encode(args), plain_data.encode(kwargs)]
                                  for name, args, kwargs in calls])
        except plain_data.NotPlainData:
            return False   # a literal argument that is not plain data (a complex number)
        result = run_program(files, "calls", request.encode(), left, self.limits)
        answers = call_results(result.stdout, len(calls))
        if answers is None:
            return False
        if isinstance(test, CallTest):
            ok, value = answers[0]
            return ok and _json_equal(value, test.expected)
        return all(_call_passed(ok, value, c.comparison, c.expected)
                   for (ok, value), c in zip(answers, test.calls))


code_reward = CodeReward()
