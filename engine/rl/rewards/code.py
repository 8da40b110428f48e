"""`reward.fn=code`: the response's last fenced Python block runs against the row's tests, each
test one program run in the sandbox (engine.rl.rewards.sandbox; docs/rewards.md).

Test formats (the row's fields), as the public code-RL sets write them:

- stdin/stdout: ``tests: [{"input": str, "output": str}, ...]`` (APPS/TACO/LiveCodeBench
  "standard input"); passed when the output equals the expected one after whitespace
  normalisation (every line's trailing spaces dropped, trailing empty lines dropped);
- call-based: ``fn_name`` with ``inputs`` (a list of argument lists) and ``outputs`` (the
  results), top level or inside ``tests`` as a dict (APPS's input_output); passed when the
  function's result equals the expected one (or the expected one is the result wrapped in a
  one-element list, as APPS writes it). A ``class Solution`` method of that name is found too;
- assert script: ``test_code`` (a string), run after the solution in one program; passed when
  it exits with status 0.

``tests`` may also be the JSON text of either form. Score: the fraction of tests passed, or
with ``score="all"`` (reward.code_score=all) 1.0 only when all pass. No fenced block: 0.0.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any

from engine.rl.rewards.sandbox import Limits, run_program

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
SCORE_MODES = ("fraction", "all")
SANDBOX_MODES = ("strict", "relaxed")
# the call-based harness: reads [args] as JSON on stdin, prints the result as JSON
CALL_HARNESS = """import json, sys
sys.path.insert(0, ".")
sys.setrecursionlimit(100000)
import solution
name = {name!r}
fn = getattr(solution, name, None)
if fn is None:
    fn = getattr(solution.Solution(), name)
args = json.loads(sys.stdin.read())
print(json.dumps(fn(*args)))
"""


def last_code_block(response: str) -> str | None:
    """The content of the response's last fenced code block (```python, ```py or bare ```)."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else None


def normalize_output(text: str) -> str:
    """Whitespace normalisation of a program's output: trailing spaces of every line and
    trailing empty lines dropped, line endings unified."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _tests(fields: dict[str, Any]) -> tuple[str, list]:
    """(kind, cases) of the row: "stdin" [(input, output)], "call" [(args, expected)] with
    the function name first, or "assert" [script]. ValueError when the row has none."""
    tests = fields.get("tests")
    if isinstance(tests, str):
        tests = json.loads(tests)
    spec = tests if isinstance(tests, dict) else fields
    if spec.get("fn_name"):
        inputs, outputs = spec["inputs"], spec["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        return "call", [spec["fn_name"], *zip(inputs, outputs)]
    if isinstance(tests, dict) and "inputs" in tests:
        return "stdin", list(zip(tests["inputs"], tests["outputs"]))
    if isinstance(tests, list) and tests:
        return "stdin", [(t["input"], t["output"]) for t in tests]
    if fields.get("test_code"):
        return "assert", [fields["test_code"]]
    raise ValueError("the row has no tests: give `tests` [{input, output}], `fn_name` with "
                     "`inputs` and `outputs`, or `test_code`")


def _call_passed(stdout: bytes, expected: Any) -> bool:
    try:
        got = json.loads(stdout.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    return got == expected or (isinstance(expected, list) and len(expected) == 1
                               and got == expected[0])


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
        code = last_code_block(response)
        if code is None:
            return 0.0
        kind, cases = _tests(fields)
        deadline = time.monotonic() + self.budget_s
        passed, total = 0, len(cases) - (kind == "call")
        for case in (cases[1:] if kind == "call" else cases):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            passed += self._run_one(kind, code, case, cases[0], left)
        if self.score == "all":
            return 1.0 if passed == total else 0.0
        return passed / total

    def _run_one(self, kind: str, code: str, case, fn_name, left: float) -> bool:
        if kind == "stdin":
            given, expected = case
            result = run_program({"solution.py": code}, ["python", "solution.py"],
                                 str(given).encode(), left, self.limits)
            return result.returncode == 0 and normalize_output(
                result.stdout.decode(errors="replace")) == normalize_output(str(expected))
        if kind == "call":
            args, expected = case
            result = run_program({"solution.py": code,
                                  "harness.py": CALL_HARNESS.format(name=fn_name)},
                                 ["python", "harness.py"], json.dumps(args).encode(), left,
                                 self.limits)
            return result.returncode == 0 and _call_passed(result.stdout, expected)
        result = run_program({"solution.py": code + "\n\n" + case}, ["python", "solution.py"],
                             b"", left, self.limits)
        return result.returncode == 0


code_reward = CodeReward()
