"""The suite's tiers (tests/conftest.py, docs/development.md "Suite time"): the whole tests/
folder runs the default tier unless TESTS_TIER says otherwise, without collecting the other
tier's files; naming files runs them whatever their tier; a bad TESTS_TIER is refused by
name; TESTS_SHARD=K/N runs the K-th of N balanced shards of the second tier (what .ci/run
runs), the shards a partition of it, malformed or misplaced values refused by name."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import json

from tests.conftest import (FILE_SECONDS, SECOND_TIER, TIERS, pytest_ignore_collect,
                            second_tier_shards, shard_of_run, tier_of_run)

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


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_second_tiers_shards_partition_it_in_balanced_parts(n):
    seconds = json.loads(FILE_SECONDS.read_text())
    shards = second_tier_shards(n, seconds)
    flat = [f for shard in shards for f in shard]
    assert len(shards) == n and sorted(flat) == sorted(SECOND_TIER) and len(set(flat)) == len(flat)
    totals = [sum(seconds.get(f, 60.0) for f in shard) for shard in shards]
    # greedy longest-first: no two shards differ by more than the longest file
    assert max(totals) - min(totals) <= max(seconds.get(f, 60.0) for f in SECOND_TIER)
    assert second_tier_shards(n, seconds) == shards          # the same on every call


def test_a_shard_run_collects_its_shards_files_only(monkeypatch):
    monkeypatch.chdir(TESTS.parent)
    whole = SimpleNamespace(args=["tests"])
    shards = second_tier_shards(3, json.loads(FILE_SECONDS.read_text()))
    monkeypatch.setenv("TESTS_TIER", "second")
    for k, shard in enumerate(shards, 1):
        monkeypatch.setenv("TESTS_SHARD", f"{k}/3")
        kept = [f for f in SECOND_TIER if pytest_ignore_collect(TESTS.parent / f, whole) is None]
        assert sorted(kept) == sorted(shard)
        assert pytest_ignore_collect(TESTS / "test_tiers.py", whole) is True   # default tier


@pytest.mark.parametrize("tier, value, message", [
    ("second", "0/3", "expected K/N with 1 <= K <= N"), ("second", "4/3", "expected K/N"),
    ("second", "two", "expected K/N"), ("second", "1/", "expected K/N"),
    ("default", "1/3", "set TESTS_TIER=second with it"),
    (None, "1/3", "set TESTS_TIER=second with it")])
def test_a_bad_shard_is_refused_naming_the_form(monkeypatch, tier, value, message):
    monkeypatch.setenv("TESTS_SHARD", value)
    with pytest.raises(pytest.UsageError, match=f"TESTS_SHARD='{value}'.*{message}"):
        shard_of_run(tier)
    monkeypatch.delenv("TESTS_SHARD")
    assert shard_of_run(tier) is None
