"""The suite's tiers (tests/conftest.py, tests/tiers.py, docs/development.md "Suite time"):
the whole tests/ folder runs the default tier unless TESTS_TIER says otherwise, without
collecting the other tier's files; naming files runs them whatever their tier; a bad TESTS_TIER
is refused by name; TESTS_SHARD=K/N runs the K-th of N balanced shards of the second tier (to
split it over machines), the shards a partition of it, malformed or misplaced values refused by
name; CI's share of the second tier (`python -m tests.tiers ci-plan`): the files that fit in
what is left of its budget at this host's speed, tried from a place that moves with the
commit."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import json

import pytest

from tests.conftest import pytest_ignore_collect, tier_of_run
from tests.tiers import (FILE_SECONDS, SECOND_TIER, TIERS, ci_plan, default_tier_files,
                         estimated_wall, fit_in_budget, second_tier_shards, shard_of_run)

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


def test_estimated_wall_is_the_longest_file_or_the_sum_over_two_workers():
    seconds = {"a": 100.0, "b": 60.0, "c": 40.0}
    assert estimated_wall(["a", "b", "c"], seconds) == 100.0       # (100 + 60 + 40) / 2
    assert estimated_wall(["a", "b", "c", "d"], seconds) == 130.0  # "d" unmeasured: 60 s
    assert estimated_wall(["a"], seconds) == 100.0                 # one file runs whole
    assert estimated_wall([], seconds) == 0.0


@pytest.mark.parametrize("left_s, speed, start, run, deferred", [
    (100, 1.0, 0, ["a", "b", "c"], ["d"]),    # with d: (100 + 60 + 40 + 20) / 2 = 110 > 100
    (100, 2.0, 0, ["c", "d"], ["a", "b"]),    # a slower host: the long files do not fit
    (100, 1.0, 2, ["c", "d", "a"], ["b"]),    # the start moves with the commit
    (100, 1.0, 6, ["c", "d", "a"], ["b"]),    # ... wrapping around the list
    (0, 1.0, 1, [], ["b", "c", "d", "a"]),    # nothing left: nothing runs
])
def test_fit_in_budget_keeps_each_file_that_still_fits(left_s, speed, start, run, deferred):
    seconds = {"a": 100.0, "b": 60.0, "c": 40.0, "d": 20.0}
    assert fit_in_budget(["a", "b", "c", "d"], seconds, left_s, speed, start) == (run, deferred)


def test_every_second_tier_file_runs_in_ci_as_the_start_moves():
    """Over as many commits as the second tier has files, every file is tried first once, so
    each runs whenever its own time fits; the default and second tiers together are every
    test file."""
    seconds = json.loads(FILE_SECONDS.read_text())
    files = sorted(SECOND_TIER, key=lambda f: -seconds.get(f, 60.0))
    left = max(seconds.get(f, 60.0) for f in files)
    ran = {f for start in range(len(files))
           for f in fit_in_budget(files, seconds, left, 1.0, start)[0]}
    assert ran == set(SECOND_TIER)
    tests = {p.relative_to(TESTS.parent).as_posix() for p in TESTS.glob("test_*.py")}
    assert set(default_tier_files()) | set(SECOND_TIER) == tests
    assert not set(default_tier_files()) & set(SECOND_TIER)


def test_ci_plan_prints_the_files_that_fit_and_says_what_it_deferred(capsys):
    expected = estimated_wall(default_tier_files(), json.loads(FILE_SECONDS.read_text()))
    assert ci_plan(["--left-s", "400", "--default-wall-s", str(2 * expected),
                    "--start", "3"]) == 0
    out, err = capsys.readouterr()
    run = out.split()
    assert run and set(run) <= set(SECOND_TIER), out
    assert "(2.00x)" in err and f"{len(run)} of {len(SECOND_TIER)} files" in err
    assert "deferred to later commits" in err
    assert ci_plan(["--left-s", "-50", "--default-wall-s", "900", "--start", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "" and f"0 of {len(SECOND_TIER)} files" in err
