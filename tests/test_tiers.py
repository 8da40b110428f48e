"""The suite's tiers (tests/conftest.py, docs/development.md "Suite time"): the whole tests/
folder runs the default tier unless TESTS_TIER says otherwise, without collecting the other
tier's files; naming files runs them whatever their tier; a bad TESTS_TIER is refused by
name."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import SECOND_TIER, TIERS, pytest_ignore_collect, tier_of_run

TESTS = Path(__file__).parent


def test_the_second_tier_names_existing_files():
    """A renamed or deleted file would silently move back into the default tier."""
    missing = [f for f in SECOND_TIER if not (TESTS.parent / f).is_file()]
    assert not missing, missing


@pytest.mark.parametrize("env, args, expected", [
    (None, ["tests"], "default"), ("", [str(TESTS)], "default"), ("second", ["tests/"], "second"),
    ("all", ["tests"], "all"), ("second", ["tests/test_bench.py"], None),
    (None, ["tests/test_tiers.py::test_the_second_tier_names_existing_files"], None),
])
def test_the_tier_of_a_run(monkeypatch, env, args, expected):
    monkeypatch.chdir(TESTS.parent)
    if env is None:
        monkeypatch.delenv("TESTS_TIER", raising=False)
    else:
        monkeypatch.setenv("TESTS_TIER", env)
    assert tier_of_run(SimpleNamespace(args=args)) == expected


def test_a_bad_tier_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.chdir(TESTS.parent)
    monkeypatch.setenv("TESTS_TIER", "fast")
    with pytest.raises(pytest.UsageError, match="TESTS_TIER='fast': valid tiers are "
                                                + ", ".join(TIERS)):
        tier_of_run(SimpleNamespace(args=["tests"]))


def test_a_tier_run_does_not_collect_the_other_tiers_files(monkeypatch):
    monkeypatch.chdir(TESTS.parent)
    whole, named = SimpleNamespace(args=["tests"]), SimpleNamespace(args=[SECOND_TIER[0]])
    second, default = TESTS.parent / SECOND_TIER[0], TESTS / "test_tiers.py"
    helper = TESTS / "pool.py"
    monkeypatch.setenv("TESTS_TIER", "second")
    assert [pytest_ignore_collect(p, whole) for p in (second, default, helper)] == \
        [None, True, None]
    assert pytest_ignore_collect(second, named) is None
    monkeypatch.delenv("TESTS_TIER")
    assert [pytest_ignore_collect(p, whole) for p in (second, default, helper)] == \
        [True, None, None]
    assert pytest_ignore_collect(second, named) is None   # a named file runs whatever its tier
    monkeypatch.setenv("TESTS_TIER", "all")
    assert [pytest_ignore_collect(p, whole) for p in (second, default)] == [None, None]
