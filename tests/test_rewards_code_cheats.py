"""The known cheats of `reward.fn=code` (issue 101's review): each is a wrong solution that
scored 1.0 when an assert test's verdict was the exit status of the solution followed by the
test code in one program. Each must score 0 on both paths of an assert script (the calls of a
plain `assert f(x) == y` script compared in the scorer; any other script run by the harness),
and the right solution 1, with or without bubblewrap (the verdicts never depend on it). Add a
new cheat here when one is found."""
from __future__ import annotations

import pytest

from engine.rl.rewards.code import CodeReward
from engine.rl.rewards.code_tests import AssertCalls, AssertScript, parse_tests

WRONG = "def sq(x):\n    return x + 1\n"
RIGHT = "def sq(x):\n    return x * x\n"
PATHS = {   # test_code -> the kind of test it is
    "calls compared by the scorer": ("assert sq(3) == 9\nassert sq(-2) == 4", AssertCalls),
    "script run by the harness": ("x = sq(3)\nassert x == 9\n"
                                  "assert [sq(v) for v in (-2, 0)] == [4, 0]", AssertScript),
}
CHEATS = {
    "sys.exit(0)": WRONG + "import sys\nsys.exit(0)\n",
    "os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "atexit handler calling os._exit(0)": (WRONG + "import atexit, os\n"
                                           "atexit.register(lambda: os._exit(0))\n"),
    "sys.excepthook exiting 0": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "result whose __eq__ is always True": ("class Anything:\n    def __eq__(self, other):\n"
                                           "        return True\n"
                                           "def sq(x):\n    return Anything()\n"),
    "int subclass whose __eq__ is always True": ("class Int(int):\n    __hash__ = int.__hash__\n"
                                                 "    def __eq__(self, other):\n"
                                                 "        return True\n"
                                                 "def sq(x):\n    return Int(0)\n"),
    "SystemExit(0) raised by the function": "def sq(x):\n    raise SystemExit(0)\n",
}


def reply(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cheat", list(CHEATS))
def test_cheat_scores_zero(cheat, path):
    test_code, kind = PATHS[path]
    assert [type(t) for t in parse_tests({"test_code": test_code})] == [kind]
    assert CodeReward()("", reply(CHEATS[cheat]), "", test_code=test_code) == 0.0


@pytest.mark.parametrize("path", list(PATHS))
def test_control_right_solution_scores_one(path):
    assert CodeReward()("", reply(RIGHT), "", test_code=PATHS[path][0]) == 1.0


def test_cheat_a_builtin_of_the_test_code_redefined():
    """A solution defining `abs` answered the test code's own `abs(...)` when both ran as one
    program; the harness binds no builtin's name to the solution."""
    test_code = "assert abs(sq(3) - 9) < 1e-9"
    cheat = "def sq(x):\n    return 0\ndef abs(x):\n    return 0\n"
    assert CodeReward()("", reply(cheat), "", test_code=test_code) == 0.0
    assert CodeReward()("", reply(RIGHT), "", test_code=test_code) == 1.0
