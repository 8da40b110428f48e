"""PPO with a learned critic (algorithm=ppo: advantage.estimator=gae, critic.*): GAE and the
value loss against verl 0.9.1's published functions (transcribed below; verl is not a
dependency), the key checks, and real runs of `engine.rl` at one process, TP2 with Megatron
SP and PP2 that agree step by step on the policy's and the critic's numbers, with the rollout
dump's values, returns and advantages aligned with token_ids."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine.config.loading import load_config
from engine.rl.algo.gae import gae, masked_whiten, token_rewards
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import ppo_problems, rl_problems
from engine.rl.config import RLConfig
from engine.training.loss import AGG_MODES, aggregate, weights_from_counts
from tests.launch import run_torchrun
from tools.tiny_models import build_tiny_model


# ------------------------------------------------- verl 0.9.1 (core_algos.py, torch_functional)
def verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_masked_whiten(values, mask):
    mean = verl_masked_mean(values, mask)
    var = verl_masked_mean((values - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, response_mask), returns


def verl_value_loss(vpreds, returns, values, mask, clip):
    vclipped = torch.clamp(vpreds, values - clip, values + clip)
    losses1, losses2 = (vpreds - returns) ** 2, (vclipped - returns) ** 2
    return torch.max(losses1, losses2), verl_masked_mean(torch.gt(losses2, losses1).float(), mask)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_equals_verl_with_observation_tokens_skipped(gamma, lam):
    """Identical float64 tensors: ragged responses, multi-turn observation tokens (mask 0 in
    the middle), the reward on each response's last sampled token."""
    g = torch.Generator().manual_seed(0)
    B, T = 5, 9
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 6:] = 0               # shorter response
    mask[1, 3:5] = 0              # an observation inside the trajectory
    mask[2, 0:2] = 0              # prompt positions before the response
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, generator=g, dtype=torch.float64).tolist()
    level = token_rewards(rewards, mask.int().tolist(), T)
    assert level[0, 5] == rewards[0] and level[0, 6:].abs().sum() == 0
    ours, our_returns = gae(level, values, mask, gamma, lam)
    theirs, their_returns = verl_gae(level, values, mask, gamma, lam)
    assert torch.allclose(ours * mask, theirs * mask, atol=1e-12)
    assert torch.allclose(our_returns * mask, their_returns * mask, atol=1e-12)
    # negative control: not skipping the observation tokens changes response 1's advantages
    plain, _ = verl_gae(level, values, torch.ones_like(mask), gamma, lam)
    assert not torch.allclose(plain[1, :3], theirs[1, :3])
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(values, torch.zeros_like(values))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_equals_verl_in_every_aggregation_mode(mode):
    """engine.rl.policy.critic's per-token loss aggregated with the normalizer's weights equals
    verl's 0.5 * agg_loss(clipped value loss) (seq-mean-token-sum-norm: S x H)."""
    from engine.rl.policy.critic import CriticSettings, value_loss_fn

    g = torch.Generator().manual_seed(1)
    B, T, H = 4, 7, 16.0
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    vpred, values, returns = (torch.randn(B, T, generator=g, dtype=torch.float64)
                              for _ in range(3))
    counts = mask.sum(1)
    weights = weights_from_counts(counts, mask.sum(), B, mode, H)[:, None] * mask
    ours = aggregate(0.5 * verl_value_loss(vpred, returns, values, mask, 0.2)[0], weights)
    per_tok, clipfrac = verl_value_loss(vpred, returns, values, mask, 0.2)
    S = B
    verl = {"token-mean": (per_tok * mask).sum() / mask.sum(),
            "token-sum": (per_tok * mask).sum(),
            "seq-mean-token-sum": (per_tok * mask).sum(1).sum() / S,
            "seq-mean-token-mean": ((per_tok * mask).sum(1) / counts.clamp(min=1)).sum() / S,
            "seq-mean-token-sum-norm": (per_tok * mask).sum() / (S * H)}[mode]
    assert float(ours) == pytest.approx(0.5 * float(verl), rel=1e-6)  # aggregate: float32

    class Head:  # the value head's output is the prediction itself here
        def __call__(self, hidden):
            return hidden

    mb = type("MB", (), {})()
    mb.token_weights, mb.loss_mask = weights, mask
    mb.extras = {"values": values, "returns": returns}
    loss, report = value_loss_fn(CriticSettings(0.2, 1.0, 1.0), Head())(
        type("Out", (), {"hidden": vpred})(), mb)
    assert float(loss) == pytest.approx(float(ours), rel=1e-6)
    assert float(report["critic/_clipped"] / report["critic/_tokens"]) == pytest.approx(
        float(clipfrac), rel=1e-6)


def _cfg(argv):
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def test_ppo_preset_and_keys_are_checked_by_name():
    cfg = _cfg(["algorithm=ppo"])
    assert cfg.advantage.estimator == "gae" and ppo_problems(cfg) == []
    assert not [p for p in rl_problems(cfg) if "advantage.estimator" in p]
    bad = _cfg(["algorithm=ppo", "advantage.lam=1.5", "critic.lr=0", "critic.value_clip=-1",
                "critic.hf_path=/x", "rollout.placement=disaggregated"])
    problems = " | ".join(ppo_problems(bad))
    for key in ("advantage.lam=1.5", "critic.lr=0", "critic.value_clip=-1", "critic.hf_path=/x",
                "rollout.placement=disaggregated is not built"):
        assert key in problems, (key, problems)
    assert ppo_problems(_cfg(["advantage.lam=1.5"])) == []  # only with the critic


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("ppo") / "qwen3"), "qwen3", hidden=64,
                            layers=4, heads=8, kv_heads=2, seed=0, initializer_range=0.2)


def _run(pools, nproc, model_dir, prompts, out, *extra):
    """One `engine.rl` run on the session's `nproc`-rank pool (as torchrun would run it)."""
    proc = pools.script(
        nproc, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{prompts}]",
        "algorithm=ppo", "advantage.gamma=0.99", "advantage.lam=0.95", "critic.lr=2e-3",
        "reward.fn=tests.test_rl_loop:digit_reward", "kl.beta=0", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.mini_batches_per_step=2",
        "train.micro_batch_size=1", "train.max_steps=2", "train.seq_length=48", "optim.lr=1e-3",
        f"data.cache_dir={out}/cache", "data.num_workers=0", f"logging.dir={out}/run",
        f"logging.rollout_dir={out}/dump", "logging.progress_bar=false", *extra, timeout=400)
    assert proc.returncode == 0
    with open(f"{out}/run/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    return prompts


KEYS = ("policy/loss", "grad_norm", "critic/value_loss", "critic/grad_norm",
        "critic/vpred_mean", "critic/values_clipfrac", "policy/clipfrac_low")


def test_ppo_is_layout_invariant(pools, model_dir, tmp_path):
    """TP2 + Megatron SP, PP2, DP2, and CP2 with packing and token-budget micro-batches give
    the one-process numbers at both steps (the rollout of step 2 uses the synced weights)."""
    prompts = _prompts(tmp_path)
    one = _run(pools, 1, model_dir, prompts, tmp_path / "one")
    assert len(one) == 2 and one[0]["critic/grad_norm"] > 0 and one[0]["critic/value_loss"] > 0
    assert one[1]["critic/vpred_mean"] != one[0]["critic/vpred_mean"]  # the critic learns
    for nproc, extra, name in ((2, ("parallel.tp=2", "parallel.sequence_parallel=true"), "tp2"),
                               (2, ("parallel.pp=2",), "pp2"), (2, (), "dp2"),
                               (2, ("parallel.cp=2", "train.packing=true",
                                    "train.max_tokens_per_micro_batch=64"), "cp2_packed")):
        other = _run(pools, nproc, model_dir, prompts, tmp_path / name, *extra)
        for a, b in zip(one, other):
            for key in KEYS:  # policy/loss: a sum of O(1) terms (whitened advantages) that
                # nearly cancels, so its rounding is judged against 1, not against the sum
                absolute = 2e-6 if key == "policy/loss" else 1e-7
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=absolute), \
                    (name, key, a[key], b[key])
    records = [json.loads(line) for line in open(tmp_path / "one" / "dump" / "step_2.jsonl")]
    for r in records:
        for field in ("values", "returns", "advantages"):
            assert len(r[field]) == len(r["token_ids"])
            assert all(v == 0.0 for v, m in zip(r[field], r["loss_mask"]) if not m)
    sampled = [a for r in records for a, m in zip(r["advantages"], r["loss_mask"]) if m]
    mean = sum(sampled) / len(sampled)
    var = sum((a - mean) ** 2 for a in sampled) / (len(sampled) - 1)
    assert abs(mean) < 1e-6 and abs(var - 1.0) < 1e-3  # whitened over the batch
    # negative control: whitening each DP rank's half on its own (the classic bug) gives other
    # advantages, so the DP2 comparison above would catch it
    halves = [sampled[:len(sampled) // 2], sampled[len(sampled) // 2:]]
    local = [torch.tensor(h) for h in halves]
    per_rank = torch.cat([(t - t.mean()) / t.std() for t in local])
    assert (per_rank - torch.tensor(sampled)).abs().max() > 1e-2


def _critic_exports_to_hf_and_back(pools, model_dir, prompts, critic_ckpt, tmp_path):
    """tools/convert.py mcore-to-hf of a critic checkpoint writes a ForTokenClassification
    folder (score.weight, no lm_head) that transformers loads; a run started from it with
    critic.hf_path computes the same values as transformers does (the dump's values at step 1,
    before any critic update), within fp32 rounding."""
    from transformers import AutoModelForTokenClassification

    out = tmp_path / "critic_hf"
    proc = pools.script(1, "tools/convert.py", "mcore-to-hf", "--ckpt", str(critic_ckpt),
                        "--out", str(out), timeout=300)
    assert proc.returncode == 0
    hf = AutoModelForTokenClassification.from_pretrained(str(out), dtype=torch.float32)
    assert hf.config.num_labels == 1 and float(hf.score.weight.abs().sum()) > 0
    again = tmp_path / "from_hf"
    _run(pools, 1, model_dir, prompts, again, f"critic.hf_path={out}")
    records = [json.loads(line) for line in open(again / "dump" / "step_1.jsonl")]
    for r in records:
        ids = r["token_ids"]
        with torch.no_grad():
            values = hf(torch.tensor([ids])).logits[0, :, 0]
        for j in range(1, len(ids)):
            if r["loss_mask"][j]:
                assert abs(r["values"][j] - float(values[j - 1])) < 1e-4, (j, r["values"][j])


def test_ppo_resumes_policy_and_critic_at_another_layout(pools, model_dir, tmp_path):
    """Checkpoint after step 1 (policy under checkpoint.dir, critic under checkpoint.dir/
    critic), stop, resume at TP2 for step 2: step 2 equals the straight one-process run (the
    critic's weights, Adam state and schedule came back: its value loss and grad norm match)."""
    prompts = _prompts(tmp_path)
    straight = _run(pools, 1, model_dir, prompts, tmp_path / "straight")
    ck = tmp_path / "ck"
    first = _run(pools, 1, model_dir, prompts, tmp_path / "resumed", f"checkpoint.dir={ck}",
                 "checkpoint.save_interval=1", "train.exit_interval=1")
    assert len(first) == 1 and (ck / "iter_0000001").is_dir()
    assert (ck / "critic" / "iter_0000001").is_dir()
    both = _run(pools, 2, model_dir, prompts, tmp_path / "resumed", f"checkpoint.dir={ck}",
                "checkpoint.save_interval=1", "parallel.tp=2")
    assert len(both) == 2
    for key in KEYS:
        absolute = 2e-6 if key == "policy/loss" else 1e-7
        assert math.isclose(straight[1][key], both[1][key], rel_tol=1e-5, abs_tol=absolute), \
            (key, straight[1][key], both[1][key])
    _critic_exports_to_hf_and_back(pools, model_dir, prompts, ck / "critic" / "iter_0000002", tmp_path)
    # negative control: without the critic's checkpoint (a fresh zero head) step 2 differs
    import shutil
    shutil.rmtree(ck / "critic" / "iter_0000002")
    shutil.rmtree(ck / "iter_0000002")
    (ck / "critic" / "iter_0000001").rename(tmp_path / "moved")
    proc = run_torchrun(1, "-m", "engine.rl", f"model.hf_path={model_dir}",
                        f"data.train_files=[{prompts}]", "algorithm=ppo",
                        "reward.fn=tests.test_rl_loop:digit_reward", "kl.beta=0",
                        "rollout.n=2", "rollout.max_new_tokens=6", "train.prompts_per_step=2",
                        "train.mini_batches_per_step=2", "train.micro_batch_size=1",
                        "train.max_steps=2", "train.seq_length=48", f"checkpoint.dir={ck}",
                        "optim.lr=1e-3", "critic.lr=2e-3",   # the checkpoint's schedule
                        f"logging.dir={tmp_path / 'missing'}", "logging.progress_bar=false",
                        timeout=300)
    assert proc.returncode != 0 and "critic/iter_0000001 is missing" in proc.stdout + proc.stderr
