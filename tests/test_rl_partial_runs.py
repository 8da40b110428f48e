"""Partial rollouts in real runs of `python -m engine.rl` (rollout.partial=true, the hf backend,
an EOS-prone tiny qwen3 so reply lengths spread): the run trains and its dumps carry
token_versions spanning versions, two runs with the same seed give identical metrics, DP2, TP2
and PP2 training equal one process (rel 1e-5), a run stopped and resumed equals the straight
one, and carried tokens keep the log-probs of the weights that sampled them. Second tier
(tests/conftest.py SECOND_TIER): seven launches on the session's rank pool. The in-process
properties (the step offset, fixed-weight equality, retries, DAPO) are in
tests/test_rl_partial.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.bench.partial import eos_prone_model

STEPS = 4
# metrics that measure time or speed: not expected to repeat
TIMING = ("time/", "rollout/tokens_per_s", "weight_sync/gbps", "perf/", "throughput/")
COMPARED = ("policy/loss", "grad_norm", "reward/mean", "rollout/logprob_diff",
            "rollout/version_span_mean", "rollout/partial_share", "rollout/engine_fill",
            "policy/kl", "policy/entropy")


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    """{name: (metrics per step, dump records per step)} for the 1-process run, its repeat,
    DP2, TP2, PP2, the stopped and the resumed run; "versions": each version's HF folder."""
    root = tmp_path_factory.mktemp("partial_runs")
    model = eos_prone_model(str(root / "model"), eos_scale=2.5, hidden=64, layers=4)
    data = root / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                        "answer": i}) + "\n" for i in range(32)))
    out = {}
    # the first run keeps every version's weights as the trainer exports them
    # (checkpoint.save_hf's iter_NNNNNNN/hf/)
    keep = [f"checkpoint.dir={root / 'ckpt'}", "checkpoint.save_interval=1",
            "checkpoint.save_hf=true"]
    # "half" stops after step 2 (saving the carried replies in the checkpoint), "resumed"
    # continues it from the checkpoint in the same folders to step 4
    resume = [f"checkpoint.dir={root / 'ckpt_half'}"]
    for name, ranks, layout in (("one", 1, keep), ("again", 1, []), ("dp2", 2, []),
                                ("tp2", 2, ["parallel.tp=2"]), ("pp2", 2, ["parallel.pp=2"]),
                                ("half", 1, resume + ["train.exit_interval=2"]),
                                ("resumed", 1, resume)):
        log = root / ("half" if name == "resumed" else name)
        proc = pools.script(
            ranks, "-m", "engine.rl", f"model.hf_path={model}", f"data.train_files=[{data}]",
            *layout, "rollout.partial=true", "rollout.partial_max_new_tokens=4",
            "rollout.max_new_tokens=16", "rollout.n=4", "train.prompts_per_step=2",
            "train.mini_batches_per_step=1", "train.micro_batch_size=2",
            f"train.max_steps={STEPS}", "train.seq_length=64", "optim.lr=1e-3",
            "kl.beta=0.05", "reward.fn=tests.test_rl_loop:digit_reward", "data.shuffle=false",
            f"logging.dir={log}", f"logging.rollout_dir={log / 'rollouts'}",
            "logging.progress_bar=false", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
        dumps = [[json.loads(x) for x in (log / "rollouts" / f"step_{s}.jsonl").read_text()
                  .splitlines()] for s in range(1, STEPS + 1) if s <= len(metrics)]
        out[name] = (metrics, dumps)
    out["versions"] = [model] + [str(root / "ckpt" / f"iter_{v:07d}" / "hf")
                                 for v in range(1, STEPS)]
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
    (a, da), (b, db) = runs["one"], runs["again"]
    for ma, mb in zip(a, b):
        same = {k: v for k, v in ma.items() if not k.startswith(TIMING)}
        assert same == {k: v for k, v in mb.items() if not k.startswith(TIMING)}
    assert [[r["token_ids"] for r in s] for s in da] == [[r["token_ids"] for r in s] for s in db]


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_partial_run_is_layout_invariant(runs, layout):
    ref, _ = runs["one"]
    got, dumps = runs[layout]
    assert [[r["token_ids"] for r in s] for s in dumps] == \
        [[r["token_ids"] for r in s] for s in runs["one"][1]]
    for mr, mg in zip(ref, got):
        for key in COMPARED:
            a, b = mr[key], mg[key]
            assert abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-6, (layout, key, a, b)


def test_carried_tokens_keep_the_logprobs_of_their_version(runs):
    """For every trained reply whose tokens span versions, each token's recorded log-prob equals
    log_softmax of the logits under the trainer's weights of the version that sampled it (the
    run's checkpoint.save_hf folder hf/ of that step; version 0 = model.hf_path), to 1e-4;
    under the newest version's weights (negative control) the older tokens disagree."""
    from transformers import AutoModelForCausalLM

    _, dumps = runs["one"]
    spanning = [r for records in dumps for r in records
                if len({v for v in r["token_versions"] if v >= 0}) > 1]
    assert spanning
    models = {}

    def logprobs(version: int, ids: list[int]) -> torch.Tensor:
        if version not in models:
            models[version] = AutoModelForCausalLM.from_pretrained(
                runs["versions"][version], dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[version](input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1).gather(
            -1, torch.tensor(ids[1:])[:, None])[:, 0]

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
    replies and the waiting groups): steps 3 and 4 equal the straight run's."""
    half, _ = runs["half"]
    resumed, dumps = runs["resumed"]
    straight, straight_dumps = runs["again"]
    assert len(half) == 2 and len(resumed) == STEPS
    assert half[-1]["rollout/partial_carried"] + half[-1]["rollout/partial_waiting_groups"] > 0
    for mr, ms in zip(resumed[2:], straight[2:]):
        assert {k: v for k, v in mr.items() if not k.startswith(TIMING)} == \
            {k: v for k, v in ms.items() if not k.startswith(TIMING)}
    assert [[r["token_ids"] for r in s] for s in dumps[2:]] == \
        [[r["token_ids"] for r in s] for s in straight_dumps[2:]]
