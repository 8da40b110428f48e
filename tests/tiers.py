"""The suite's tiers and CI's share of the second one (docs/development.md, "Suite time").

Light on purpose (json and pytest only): tests/conftest.py takes its tables from here, and
.ci/run asks `python -m tests.tiers ci-plan` which second-tier files fit in what is left of its
30 minutes, without importing the pool, torch or the engine.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Measured seconds per test file (tests/file_seconds.json, from a whole run on the 2-core
# host): the order in which the README's two workers (pytest-xdist, --dist loadfile
# --no-loadscope-reorder: a file's tests stay on one worker, with its module fixtures) take
# the files, longest first, so that no long file starts last and leaves the other worker idle.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


@functools.lru_cache(maxsize=1)
def file_seconds() -> dict[str, float]:
    """FILE_SECONDS read once per process ({} when the file is missing)."""
    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}


# The suite's two tiers (docs/development.md, "Suite time"): a run given the whole tests/
# folder runs the default tier, every file but these (the README's command, inside the 20-minute
# budget); TESTS_TIER=second runs only these, TESTS_TIER=all both (.ci/run runs the default tier,
# then the second). A file or test named on the command line always runs.
SECOND_TIER = ("tests/test_vllm_speculative.py", "tests/test_preemption.py",
               "tests/test_bench.py", "tests/test_data_cache.py", "tests/test_lora_layouts.py",
               "tests/test_rl_lora.py", "tests/test_rl_checkpoint.py",
               "tests/test_train_compile.py", "tests/test_compile_stability.py",
               "tests/test_bench_peer.py",
               "tests/test_rl_async.py", "tests/test_rl_engines.py",
               "tests/test_rl_partial_runs.py", "tests/test_rl_partial_vllm.py",
               "tests/test_rl_partial_async.py",
               "tests/test_serve_steps.py",
               "tests/test_agent_steps_vllm.py",
               "tests/test_hf_stepper_compiled.py",
               "tests/test_save_hf.py",
               "tests/test_vlm.py", "tests/test_mtp.py", "tests/test_qwen3_5.py",
               "tests/test_reward_model_convert.py",
               "tests/test_vllm_failures.py", "tests/test_serve_sampling.py",
               "tests/test_rewards_overlap.py", "tests/test_prefix_sharing.py",
               "tests/test_rewards_ranks.py", "tests/test_prefix_sharing_compile.py",
               # moved on 2026-11-29: the default tier took 1348-1477 s on 2-core AMD EPYC
               # hosts without AMX (1.9x the Intel host's times), over its 1200 s budget
               "tests/test_vllm.py", "tests/test_vllm_lora_grpo.py", "tests/test_vllm_rl.py",
               "tests/test_checkpointing.py", "tests/test_rl_partial.py",
               "tests/test_moe_sft_cli.py", "tests/test_rl_agent.py", "tests/test_trackers.py",
               "tests/test_tinker_cookbook.py", "tests/test_tinker_vs_sft.py",
               "tests/test_tinker_megatron.py", "tests/test_tinker_vllm.py",
               # moved on 2026-11-30: the default tier took 1161 s of its 1200 s here
               "tests/test_prefix_sharing_mla.py", "tests/test_gpt_oss.py",
               # moved on 2026-11-30 (later): 1146 s of 1200 s here again; ~470 summed s out,
               # none of them a layout-invariance matrix (the families' logits, conversion
               # and SFT invariance also run in CI's megatron-core 0.19 subset)
               "tests/test_rl_validation.py", "tests/test_comm_plan.py",
               "tests/test_rl_reward_model.py", "tests/test_deepseek_v3.py",
               "tests/test_rm_cli.py", "tests/test_glm4_moe.py", "tests/test_cli_help.py",
               "tests/test_prefix_sharing_replay.py", "tests/test_prefix_sharing_sinks.py",
               "tests/test_rl_recipes.py", "tests/test_moe_convert.py",
               "tests/test_rl_sync_quantization.py", "tests/test_qwen3_5_conditional.py")
TIERS = ("default", "second", "all")
# The second tier in shards (TESTS_SHARD=K/N with TESTS_TIER=second: the K-th of N, 1-based),
# to split it over several machines (CI instead runs what fits in its budget: ci_plan below).
# A file missing from FILE_SECONDS counts as UNMEASURED_S seconds.
UNMEASURED_S = 60.0


def second_tier_shards(n: int, seconds: dict[str, float]) -> list[list[str]]:
    """SECOND_TIER split into `n` shards of about equal measured seconds: the files longest
    first (`seconds`, as in FILE_SECONDS; SECOND_TIER's order on ties), each to the shard with
    the fewest seconds so far (the lowest index on a tie). Deterministic for given inputs."""
    order = sorted(SECOND_TIER, key=lambda f: -seconds.get(f, UNMEASURED_S))
    shards: list[list[str]] = [[] for _ in range(n)]
    totals = [0.0] * n
    for name in order:
        k = min(range(n), key=lambda i: (totals[i], i))
        shards[k].append(name)
        totals[k] += seconds.get(name, UNMEASURED_S)
    return shards


def shard_of_run(tier: str | None) -> tuple[int, int] | None:
    """(K, N) from TESTS_SHARD="K/N" (1 <= K <= N), or None when it is unset; refused by name
    when malformed or given without TESTS_TIER=second."""
    raw = os.environ.get("TESTS_SHARD")
    if not raw:
        return None
    if tier != "second":
        raise pytest.UsageError(f"TESTS_SHARD={raw!r}: shards split the second tier only; "
                                "set TESTS_TIER=second with it")
    k, _, n = raw.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"TESTS_SHARD={raw!r}: expected K/N with 1 <= K <= N "
                                "(e.g. 2/3)")
    return int(k), int(n)


# ---- CI's share of the second tier ---------------------------------------------------------
# .ci/run runs the default tier (the README's command) and the megatron-core 0.19 subset on every
# commit, then as many second-tier files as fit in what is left of its budget. Hosts of the same
# week differ by up to ~2x (docs/development.md), so the fit is scaled by how fast this host ran
# the default tier against FILE_SECONDS, and the files are tried from a place in the list that
# moves with the commit: every file runs in CI every few commits, the slowest hosts included.
WORKERS = 2          # the README's command and .ci/run: two pytest-xdist workers, files whole


def default_tier_files(root: Path = REPO_ROOT) -> list[str]:
    """Every tests/test_*.py of `root` not in SECOND_TIER, as repository-relative paths."""
    names = (p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py"))
    return sorted(n for n in names if n not in SECOND_TIER)


def estimated_wall(files: list[str], seconds: dict[str, float]) -> float:
    """Seconds `files` take on WORKERS workers by `seconds` (FILE_SECONDS' host): a file runs
    whole on one worker, so never less than the longest file, else the sum over WORKERS."""
    each = [seconds.get(f, UNMEASURED_S) for f in files]
    return max(max(each, default=0.0), sum(each) / WORKERS)


def fit_in_budget(files: list[str], seconds: dict[str, float], left_s: float, speed: float,
                  start: int) -> tuple[list[str], list[str]]:
    """(run, deferred): `files` tried in order from index `start` (wrapping), each kept when
    the kept files' estimated_wall times `speed` (this host's seconds per FILE_SECONDS second)
    stays within `left_s`; the rest deferred, in the order tried."""
    order = files[start % len(files):] + files[:start % len(files)] if files else []
    run: list[str] = []
    deferred: list[str] = []
    for name in order:
        (run if estimated_wall(run + [name], seconds) * speed <= left_s else deferred).append(name)
    return run, deferred


def ci_plan(argv: list[str] | None = None) -> int:
    """`python -m tests.tiers ci-plan --left-s L --default-wall-s W --start S`: the second-tier
    files (longest first) that fit in L seconds on a host that ran the default tier in W
    seconds, tried from position S; printed space-separated on stdout (nothing when none fit),
    with what was deferred and why on stderr."""
    parser = argparse.ArgumentParser(prog="python -m tests.tiers ci-plan")
    parser.add_argument("--left-s", type=float, required=True,
                        help="seconds left for the second tier")
    parser.add_argument("--default-wall-s", type=float, required=True,
                        help="the default tier's wall seconds on this host")
    parser.add_argument("--start", type=int, required=True,
                        help="where in the list to start (e.g. from the commit's hash)")
    args = parser.parse_args(argv)
    seconds = file_seconds()
    expected = estimated_wall(default_tier_files(), seconds)
    speed = max(args.default_wall_s / expected, 0.1)
    files = sorted(SECOND_TIER, key=lambda f: (-seconds.get(f, UNMEASURED_S), f))
    run, deferred = fit_in_budget(files, seconds, args.left_s, speed, args.start)
    print(f"second tier: this host ran the default tier in {args.default_wall_s:.0f} s against "
          f"{expected:.0f} s by tests/file_seconds.json ({speed:.2f}x); "
          f"{max(args.left_s, 0):.0f} s left: {len(run)} of {len(files)} files, about "
          f"{estimated_wall(run, seconds) * speed:.0f} s", file=sys.stderr)
    if deferred:
        print("second tier, deferred to later commits: " + ", ".join(
            f"{Path(f).name} (~{seconds.get(f, UNMEASURED_S) * speed:.0f} s)" for f in deferred),
            file=sys.stderr)
    print(" ".join(run))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["ci-plan"]:
        sys.exit("usage: python -m tests.tiers ci-plan --left-s L --default-wall-s W --start S")
    sys.exit(ci_plan(sys.argv[2:]))
