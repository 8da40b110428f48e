"""Partial rollouts in real runs of `python -m engine.rl` (rollout.partial=true, the hf backend,
an EOS-prone tiny qwen3 so reply lengths spread): the run trains and its dumps carry
token_versions spanning versions, two runs with the same seed give identical metrics, DP2, TP2
and PP2 training equal one process (rel 1e-5), a run stopped and resumed equals the straight
one, and carried tokens keep the log-probs of the weights that sampled them; the negative
control of the equalities: the stopped run resumed without its carried replies differs. The
driver-session path (rollout.partial_driver=true): DP2 equals one process (rel 1e-5) at Adam
eps 1e-6 (test_partial_driver_run_is_layout_invariant says why not at 1e-8). Second tier
(tests/conftest.py SECOND_TIER): ten launches on the session's rank pool
(tests/partial_runs.py). The in-process properties (the step offset, fixed-weight equality,
retries, DAPO) are in tests/test_rl_partial.py."""
from __future__ import annotations

import pytest

from tests.partial_runs import (STEPS, TokenLogprobs, check_resume, launch, layout_differences,
                                partial_runs, prompts_file, stop_and_resume, tokens, untimed)
from tools.bench.partial import eos_prone_model


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    """{name: (metrics per step, dump records per step)} for the 1-process run, DP2, TP2, PP2,
    the stopped and the resumed run (together the 1-process run's repeat), and "dropped" (the stopped run resumed
    from a copy of its checkpoint without the carried replies: the negative control);
    "versions": each version's HF folder."""
    root = tmp_path_factory.mktemp("partial_runs")
    model = eos_prone_model(str(root / "model"), eos_scale=2.5, hidden=64, layers=4)
    return partial_runs(pools, root, model, [], again=False)


@pytest.fixture(scope="module")
def driver_runs(pools, tmp_path_factory) -> dict:
    """{"one", "dp2", "half", "resumed", "dropped": Run} of the driver-session path
    (rollout.partial_driver=true) with Adam eps 1e-6 (test_partial_driver_run_is_layout_invariant),
    the model and data of `runs`; half / resumed / dropped as in tests.partial_runs."""
    root = tmp_path_factory.mktemp("partial_driver_runs")
    model = eos_prone_model(str(root / "model"), eos_scale=2.5, hidden=64, layers=4)
    data = prompts_file(root)
    common = ("rollout.partial_driver=true", "optim.eps=1e-6")
    out = {name: launch(pools, ranks, model, data, root / name, *common)[0]
           for name, ranks in (("one", 1), ("dp2", 2))}
    out.update(stop_and_resume(pools, 1, root, model, data, common))
    return out


def test_partial_run_trains_with_replies_spanning_versions(runs):
    metrics, dumps = runs["one"]
    assert len(metrics) == STEPS
    for m in metrics:
        for key in ("rollout/partial_share", "rollout/version_span_mean",
                    "rollout/version_span_max", "rollout/engine_fill"):
            assert key in m, key
        assert m["train/groups"] == 2 and m["grad_norm"] > 0
        assert 0 < m["rollout/engine_fill"] <= 1
    assert max(m["rollout/version_span_max"] for m in metrics) >= 1
    spanning = 0
    for step, records in enumerate(dumps):
        assert len(records) == 2 * 4
        for r in records:
            tv, mask = r["token_versions"], r["loss_mask"]
            assert len(tv) == len(r["token_ids"])
            assert all(v == -1 for v, m in zip(tv, mask) if m == 0)
            sampled = [v for v, m in zip(tv, mask) if m == 1]
            assert sampled == sorted(sampled) and max(sampled) <= step  # oldest first
            spanning += len(set(sampled)) > 1
    assert spanning > 0
    # the trained replies of a step were sampled by at most the step's version: the
    # behaviour/proximal gap of the carried tokens shows in rollout/logprob_diff
    assert any(m["rollout/logprob_diff"] > 1e-3 for m in metrics[1:])


def test_partial_run_repeats_exactly(runs):
    """Two runs with the same seed: the same metrics (timing aside) and dumps; the repeat is
    the stopped run (steps 1 and 2) and its resumption (steps 3 and 4), launched anyway; the
    run that lost its carried replies at step 2 (negative control) differs from step 3 on."""
    (a, da), (half, dh), (resumed, dr) = runs["one"], runs["half"], runs["resumed"]
    assert len(half) == 2 and len(resumed) == len(a)
    assert [untimed(m) for m in half] == [untimed(m) for m in a[:2]]
    assert [untimed(m) for m in resumed[2:]] == [untimed(m) for m in a[2:]]
    assert tokens(dh) + tokens(dr[2:]) == tokens(da)
    dropped, dropped_dumps = runs["dropped"]
    assert [untimed(m) for m in dropped[2:]] != [untimed(m) for m in a[2:]]
    assert tokens(dropped_dumps[2:]) != tokens(da[2:])


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_partial_run_is_layout_invariant(runs, layout):
    """The layout's run equals the 1-process one: token ids, and the COMPARED metrics to rel
    1e-5; the run that lost its carried replies at step 2 (negative control) does not."""
    assert layout_differences(runs["one"], runs[layout]) == []
    control = layout_differences(runs["one"], runs["dropped"])
    assert "token_ids" in control and {step for step, *_ in control[1:]} >= {3}, control


def test_partial_driver_run_is_layout_invariant(driver_runs, runs):
    """The driver-session path: DP2 equals one process (token ids; the COMPARED metrics to rel
    1e-5) while carried replies train; the run that lost its carried replies (`runs`'
    negative control) does not equal its straight run.

    Why Adam eps 1e-6, not the default 1e-8: at 1e-8 any change of summation order changes step
    2 by ~50x the tolerance, one process against itself included (train.micro_batch_size 1 or
    4 instead of 2: policy/kl 94x and 53x the tolerance; DP2 48x, PP2 49x; TP2's token ids
    part at step 4). The chain, measured: in step 1's gradient one entry (layer 0 q_proj) is
    ~eps (clipped 2.0e-9 in one process, -3.7e-10 in DP2); Adam's first update lr g / (|g| +
    eps), gain up to lr / eps = 1e5, moves it 2.0e-4 apart (the entries with |g| > 99 eps,
    99.65 %, move +-lr to 1 % in both); version 1's log-probs then differ by up to 4.8e-4
    (that one entry swapped in: 8.6e-6); and step 2 trains a stale reply whose first token (EOS, sampled at version 0)
    lost 8.0 nats in step 1, whose k3 KL exp(8) - 9 = 3006 is 99.6 % of the step's KL (33.2 per
    token) and multiplies its log-prob's difference by ~3000. At eps 1e-6 (gain 1e3) DP2 stays
    within 0.2x the tolerance (TP2 4.7x, PP2 1.1x: not checked here)."""
    one, dp2 = driver_runs["one"], driver_runs["dp2"]
    assert len(one[0]) == STEPS and max(m["rollout/partial_share"] for m in one[0]) > 0
    assert layout_differences(one, dp2) == []
    control = layout_differences(runs["one"], runs["dropped"])
    assert "token_ids" in control and {step for step, *_ in control[1:]} >= {3}, control


def test_carried_tokens_keep_the_logprobs_of_their_version(runs):
    """For every trained reply whose tokens span versions, each token's recorded log-prob equals
    log_softmax of the logits under the trainer's weights of the version that sampled it (the
    run's checkpoint.save_hf folder hf/ of that step; version 0 = model.hf_path), to 1e-4;
    under the newest version's weights (negative control) the older tokens disagree."""
    _, dumps = runs["one"]
    spanning = [r for records in dumps for r in records
                if len({v for v in r["token_versions"] if v >= 0}) > 1]
    assert spanning
    logprobs = TokenLogprobs(runs["versions"])
    for r in spanning:
        ids, tv, lp = r["token_ids"], r["token_versions"], r["rollout_logprobs"]
        sampled = [t for t in range(1, len(ids)) if tv[t] >= 0]
        for v in {tv[t] for t in sampled}:
            mine = logprobs(v, ids)
            for t in (t for t in sampled if tv[t] == v):
                assert abs(float(mine[t - 1]) - lp[t]) < 1e-4, (v, t)
        newest = logprobs(max(tv), ids)
        older = [t for t in sampled if tv[t] < max(tv)]
        assert max(abs(float(newest[t - 1]) - lp[t]) for t in older) > 1e-3


def test_resumed_partial_run_continues_the_carried_replies(runs):
    """Stopped after step 2 and resumed from its checkpoint (whose extra holds the carried
    replies and the waiting groups): steps 3 and 4 equal the straight run's; resumed from the
    checkpoint without them (negative control) they differ."""
    check_resume(runs, "one")


def test_resumed_driver_run_continues_the_carried_replies(driver_runs):
    """The driver-session path stopped after step 2 and resumed from its checkpoint: steps 3
    and 4 equal the straight driver run's (metrics, token ids); resumed without the carried
    replies (negative control) they differ."""
    check_resume(driver_runs, "one")
