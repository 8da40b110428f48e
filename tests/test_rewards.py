"""Reward functions: math answer extraction and comparison, loading user functions by spec,
scoring with errors and timeouts."""
from __future__ import annotations

import threading
import time

import pytest

from engine.rl.rewards import (extract_answer, load_reward_fn, math_reward, normalize_answer,
                               score_responses)

# response, answer, expected reward
MATH_CASES = [
    (r"so the result is \boxed{42}.", "42", 1.0),
    (r"so the result is \boxed{41}.", "42", 0.0),
    (r"first \boxed{1}, then correcting: \boxed{2}", "2", 1.0),        # last boxed wins
    (r"first \boxed{1}, then correcting: \boxed{2}", "1", 0.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),                     # nested braces
    (r"\boxed{\frac{1}{2}} and 7 apples", r"\frac{1}{2}", 1.0),        # boxed beats last number
    (r"\boxed{ 3 }", "3", 1.0),                                        # spaces stripped
    (r"\boxed{3", "3", 1.0),          # unclosed boxed is skipped; last number 3 is used
    ("We have 3 apples and 5 pears, total 8.", "8", 1.0),              # last number
    ("We have 3 apples and 5 pears, total 8.", "5", 0.0),
    ("the answer is -5", "-5", 1.0),                                   # negative
    ("the answer is -5", "5", 0.0),
    ("10-3=7", "7", 1.0),            # a binary minus is not a sign
    ("x = 7-10", "10", 1.0),
    ("so y = x-3", "3", 1.0),        # minus after a variable is binary too
    ("so y = (x)-3", "3", 1.0),
    ("it costs 2.50 dollars", "2.5", 1.0),                             # trailing zeros
    ("it costs 2.5 dollars", "2.50", 1.0),
    ("it costs 2.05 dollars", "2.5", 0.0),
    ("exactly 3.0", "3", 1.0),
    ("exactly 3", "3.000", 1.0),
    ("there are 1,000 people", "1000", 1.0),                           # thousands commas
    ("there are 1,234,567 people", "1,234,567", 1.0),
    ("the pair 3,4", "4", 1.0),       # not a thousands group: two numbers
    ("answer: +7", "7", 1.0),                                          # leading +
    (r"\boxed{+7}", "7", 1.0),
    ("half is .5", "0.5", 1.0),
    ("I do not know.", "0", 0.0),                                      # no number at all
    ("", "0", 0.0),
    (r"\boxed{x+1}", "x + 1", 1.0),                                    # non-numeric, spaces
]


@pytest.mark.parametrize("response,answer,expected", MATH_CASES)
def test_math_reward(response, answer, expected):
    assert math_reward("prompt", response, answer) == expected


def test_extraction_and_normalisation_details():
    assert extract_answer(r"\boxed{a{b}c} then \boxed{d") == "a{b}c"
    assert extract_answer("no digits") is None
    assert normalize_answer("+1,000.50") == "1000.5"
    assert normalize_answer("-0.00") == "0"
    assert normalize_answer("007") == "7"
    assert normalize_answer("5.") == "5"
    assert math_reward("p", "so 12", 12, level="easy") == 1.0  # non-str answer, extra fields


MODULE_SOURCE = '''
CONST = 3

def length_reward(prompt, response, answer, **fields):
    return float(len(response)) + fields.get("bonus", 0.0)

class Scorers:
    @staticmethod
    def exact(prompt, response, answer, **fields):
        return 1.0 if response == answer else 0.0
'''


def test_load_reward_fn(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg_7").mkdir()
    (tmp_path / "my_rewards_pkg_7" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg_7" / "scoring.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))

    assert load_reward_fn("math") is math_reward
    fn = load_reward_fn("my_rewards_pkg_7.scoring:length_reward")
    assert fn(prompt="p", response="abcd", answer="x", bonus=0.5) == 4.5
    exact = load_reward_fn("my_rewards_pkg_7.scoring:Scorers.exact")
    assert exact(prompt="p", response="a", answer="a") == 1.0

    bad = {
        "no_colon_here": "is not a built-in",
        "no_such_module_xyz_1:fn": "cannot import module 'no_such_module_xyz_1'",
        "my_rewards_pkg_7.scoring:missing": "has no attribute 'missing'",
        "my_rewards_pkg_7.scoring:CONST": "not callable",
        "my_rewards_pkg_7.scoring:": "is not a built-in",
    }
    for spec, message in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            load_reward_fn(spec)
        assert repr(spec) in str(info.value)


def _items(responses: list[str]) -> list[dict]:
    return [{"prompt": "p", "response": r, "answer": "1", "weight": 2.0} for r in responses]


def test_score_responses_errors_and_extra_fields():
    def fn(prompt, response, answer, weight):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "nan":
            return float("nan")
        return weight * (response == answer)

    items = _items(["1", "raise", "0", "nan", "1"])
    for timeout in (None, 5.0):
        scores, errors = score_responses(fn, items, timeout_s=timeout)
        assert scores == [2.0, 0.0, 0.0, 0.0, 2.0]
        assert errors == 2
    with pytest.raises(ValueError, match="answer"):
        score_responses(fn, [{"prompt": "p", "response": "1"}], timeout_s=None)


def _score_bounded(*args, limit_s: float = 10.0, **kwargs):
    """score_responses in a helper thread, failing (not hanging) if it never returns."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(score_responses(*args, **kwargs)),
                              daemon=True)
    thread.start()
    thread.join(limit_s)
    assert out, f"score_responses did not return within {limit_s} s"
    return out[0]


def test_score_responses_timeout_does_not_block():
    release = threading.Event()

    def fn(prompt, response, answer, **fields):
        if response == "hang":
            release.wait(30.0)  # a hung call; released at the end of the test
        if response == "raise":
            raise ValueError("bad")
        return 1.0

    try:
        items = _items(["1", "hang", "raise", "1"])
        start = time.monotonic()
        scores, errors = _score_bounded(fn, items, timeout_s=0.2)
        elapsed = time.monotonic() - start
        assert scores == [1.0, 0.0, 0.0, 1.0]
        assert errors == 2
        assert 0.2 <= elapsed < 3.0

        # one worker, three hung calls: each is replaced, so the good ones still get scored
        items = _items(["hang", "1", "hang", "1", "hang", "1"])
        start = time.monotonic()
        scores, errors = _score_bounded(fn, items, timeout_s=0.2, max_workers=1)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        assert errors == 3
        assert 0.6 <= elapsed < 4.0  # the hung calls run one after another
    finally:
        release.set()


def test_an_unknown_reward_fn_is_refused_before_any_heavy_import(tmp_path):
    """`reward.fn=nosuch` through the real command line: exit 2, the message names reward.fn and
    the built-ins, and it comes from the fast check on the composed command line
    (engine.config.choices, before the imports the full validation and the process groups need:
    torch is not imported). Before, it was refused only by the full validation, after them. A
    spec with a colon passes the fast check (the full validation imports it); the fast check's
    names are the registry's."""
    import subprocess
    import sys

    from engine.config.choices import NAMED, NAMED_SOURCES, named_problems
    from engine.rl.rewards.registry import BUILTIN_REWARDS

    assert NAMED["reward.fn"] == tuple(sorted(BUILTIN_REWARDS))
    assert NAMED_SOURCES["reward.fn"][0] == "engine.rl.rewards.registry:BUILTIN_REWARDS"
    message = ("reward.fn='nosuch' is not valid; choose one of code, math, math_verify, none "
               "or give your own as package.module:function")
    code = ("import sys\n"
            "from engine.rl.__main__ import main\n"
            "rc = main(['reward.fn=nosuch', 'model.hf_path=/nonexistent'])\n"
            "print('torch imported:', 'torch' in sys.modules)\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "torch imported: False" in done.stdout
    cli = subprocess.run(["megatron-sft-engine", "rl", "reward.fn=nosuch",
                          "model.hf_path=/nonexistent"], capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 2 and message in cli.stderr and "Traceback" not in cli.stderr

    def cfg(fn):
        return type("Cfg", (), {"reward": type("Reward", (), {"fn": fn})})()

    assert named_problems(cfg("math_verify")) == named_problems(cfg("pkg.mod:fn")) == []
    assert [p.split(";")[0] for p in named_problems(cfg("pkg.mod"))] == [
        "reward.fn='pkg.mod' is not valid"]
