"""reward.fn=math_verify against Hugging Face math-verify called directly, on docs/rewards.md's
table of tricky answers (which also records where the hand-written `math` differs), scored the
way the engine scores: in the worker pool, where math-verify's signal.alarm timeouts work."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from math_verify import parse, verify

from engine.rl.rewards import load_reward_fn
from engine.rl.rewards.pool import RewardPool
from engine.rl.rewards.verify_math import (GOLD_EXTRACTION, PREDICTION_EXTRACTION, gold_text,
                                           math_verify_reward)

DOC = Path(__file__).resolve().parents[1] / "docs" / "rewards.md"
ROW = re.compile(r"^\| (\d+) \| `(.*)` \| `(.*)` \| ([01]) \| ([01]) \|( differs)? \|$")


def table() -> list[tuple[str, str, float, float, bool]]:
    """(answer, response, math_verify, math, marked differs) of every row of the doc's table."""
    rows = [ROW.match(line) for line in DOC.read_text().splitlines()]
    return [(m[2], m[3], float(m[4]), float(m[5]), bool(m[6])) for m in rows if m]


def direct(answer: str, response: str) -> float:
    """math-verify as its README calls it (main thread: its own timeouts on)."""
    gold = parse(gold_text(answer), extraction_config=GOLD_EXTRACTION)
    pred = parse(response, extraction_config=PREDICTION_EXTRACTION)
    return 1.0 if verify(gold, pred) else 0.0


def test_the_table_is_big_and_covers_both_directions():
    rows = table()
    assert len(rows) >= 100
    assert all(differs == (mv != m) for _, _, mv, m, differs in rows)
    assert sum(mv > m for _, _, mv, m, _ in rows) >= 50    # `math` misses what math-verify gets
    assert sum(mv < m for _, _, mv, m, _ in rows) >= 1     # ... and the reverse (first \boxed)


def test_engine_math_verify_in_the_pool_equals_math_verify_called_directly():
    """Every row: the pool's score == math-verify called directly == the doc's column; the
    `math` column is the built-in's score. Negative control: a doc value flipped is caught."""
    rows = table()
    items = [{"prompt": "", "response": r, "answer": a} for a, r, *_ in rows]
    pool = RewardPool(load_reward_fn("math_verify"), num_workers=2, timeout_s=30.0)
    try:
        report = pool.score(items)
    finally:
        pool.close()
    assert report.errors == 0 and report.timeouts == 0
    expected_direct = [direct(a, r) for a, r, *_ in rows]
    assert report.scores == expected_direct
    assert report.scores == [mv for _, _, mv, _, _ in rows]
    builtin = load_reward_fn("math")
    assert [builtin(**item) for item in items] == [m for _, _, _, m, _ in rows]
    flipped = list(expected_direct)
    flipped[0] = 1.0 - flipped[0]
    assert flipped != report.scores


def test_math_verify_needs_a_main_thread_for_its_timeouts_and_the_reward_handles_threads():
    """math-verify's own timeouts raise in a thread (why it runs in worker processes); the
    engine's reward called from a thread runs without them and still scores."""
    out = {}

    def run():
        with pytest.raises(ValueError, match="threaded"):
            parse("$1/2$", parsing_timeout=5, raise_on_error=True)
        out["score"] = math_verify_reward("", r"\boxed{\dfrac12}", "0.5")

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert out == {"score": 1.0}


def test_escaped_dollar_golds_are_currency_not_delimiters():
    """MATH's currency rows (`\\$5`, `\\$18.90`): the escaped dollar is a sign inside the math,
    as math-verify reads `$\\$18.90$`; a gold with real `$...$` delimiters is kept as given.
    (Before: the gold was passed bare, parsed to nothing, and every reply scored 0.)"""
    cases = {r"\$5": ([r"\boxed{5}", r"\boxed{\$5}", r"so it costs $\$5$."], [r"\boxed{6}",
                                                                             r"\boxed{\$50}"]),
             r"\$18.90": ([r"\boxed{18.90}", r"\boxed{\$18.90}", r"\boxed{18.9}"],
                          [r"\boxed{18.91}", r"\boxed{\$5}"]),
             r"$\frac{1}{2}$": ([r"\boxed{\frac12}", r"\boxed{0.5}"], [r"\boxed{\$5}"])}
    for gold, (right, wrong) in cases.items():
        assert [math_verify_reward("", r, gold) for r in right] == [1.0] * len(right), gold
        assert [math_verify_reward("", r, gold) for r in wrong] == [0.0] * len(wrong), gold
    assert gold_text(r"\$5") == r"$\$5$" and gold_text(r"$\$5$") == r"$\$5$"
    assert gold_text(r"\\$5$") == r"\\$5$"      # an escaped backslash, then a real delimiter
