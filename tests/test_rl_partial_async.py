"""Partial rollouts on a disaggregated run (rollout.partial=true, rollout.placement=disaggregated,
one training rank and one rollout rank; engine.rl.disaggregated.rollout_ranks): the collector
lives on the rollout leader, samples each batch at the version its engine holds, and its carried
replies travel with every batch to the trainer's checkpoint. Real `python -m engine.rl` runs of
tests/partial_runs.py's setting (the hf backend, an EOS-prone tiny qwen3, lr 1e-3, 4 steps):
- rollout.max_staleness=0 equals the colocated run: token ids and the compared metrics to rel
  1e-5 (negative control: the s=1 run differs);
- s=1: batch k is sampled at version k - 1 (the dumps' token_versions, carried tokens older),
  its replies span versions and it trains;
- s=1 stopped after step 2 and resumed equals the straight s=1 run (the batch generated ahead
  and the carried replies come back from the checkpoint); resumed from a copy of the checkpoint
  without the carried replies (negative control) it differs.
Second tier (tests/conftest.py SECOND_TIER): six launches on the session's rank pool."""
from __future__ import annotations

import pytest

from tests.partial_runs import (STEPS, check_resume, launch, layout_differences, prompts_file,
                                stop_and_resume, untimed)
from tools.bench.partial import eos_prone_model

SPLIT = ("rollout.placement=disaggregated", "rollout.num_ranks=1", "rollout.peer_timeout_s=120")
WAITS = ("rollout/idle_s", "sync/seconds")   # a disaggregated run's own timings


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    """{name: (metrics per step, dump records per step)}: "colocated" (1 process), "s0" and
    "s1" (disaggregated, 2 processes), "half" (s1 stopped after step 2), "resumed" (half
    continued), "dropped" (half continued from a copy of its checkpoint without the carried
    replies and the waiting groups)."""
    root = tmp_path_factory.mktemp("partial_async")
    model = eos_prone_model(str(root / "model"), eos_scale=2.5, hidden=64, layers=4)
    data = prompts_file(root)
    out = {}
    out["colocated"], _ = launch(pools, 1, model, data, root / "colocated")
    for name, s in (("s0", 0), ("s1", 1)):
        out[name], _ = launch(pools, 2, model, data, root / name, *SPLIT,
                              f"rollout.max_staleness={s}", own_world=True)
    out.update(stop_and_resume(pools, 2, root, model, data, (*SPLIT, "rollout.max_staleness=1"),
                               own_world=True))
    return out


def test_disaggregated_s0_equals_colocated(runs):
    """With max_staleness 0 the rollout rank samples batch k at version k, as colocated: the same
    token ids and metrics (rel 1e-5); the s=1 run (negative control) differs in both."""
    metrics, _ = runs["s0"]
    assert len(metrics) == STEPS and [m["rollout/staleness"] for m in metrics] == [0.0] * STEPS
    assert layout_differences(runs["colocated"], runs["s0"]) == []
    control = layout_differences(runs["colocated"], runs["s1"])
    assert "token_ids" in control and len(control) > 1, control


def test_s1_samples_each_batch_one_version_behind(runs):
    """Batch k (step k + 1) is sampled at version max(0, k - 1): every sampled token's version is
    at most that, the newest is exactly that from batch 1 on, and carried replies span
    versions (partial_share > 0 at some step); every step trains."""
    metrics, dumps = runs["s1"]
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/policy_version"] for m in metrics] == [0.0, 0.0, 1.0, 2.0]
    spanning = 0
    for k, records in enumerate(dumps):
        assert len(records) == 2 * 4
        sampled = [[v for v, m in zip(r["token_versions"], r["loss_mask"]) if m == 1]
                   for r in records]
        newest = max(max(s) for s in sampled)
        assert newest == max(0, k - 1), (k, newest)
        spanning += sum(len(set(s)) > 1 for s in sampled)
    assert spanning > 0
    assert max(m["rollout/partial_share"] for m in metrics) > 0
    assert all(m["train/groups"] == 2 and m["grad_norm"] > 0 for m in metrics)


def test_resumed_s1_run_continues_the_carried_replies(runs):
    """Stopped after step 2 and resumed: steps 3 and 4 equal the straight s=1 run's (metrics
    and token ids); resumed without the carried replies (negative control) they differ."""
    check_resume(runs, "s1", WAITS)
    dropped, _ = runs["dropped"]
    assert [untimed(m, WAITS) for m in dropped[2:]] != \
        [untimed(m, WAITS) for m in runs["s1"][0][2:]]
