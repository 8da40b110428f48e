"""Prefix sharing (train.prefix_sharing) against the unshared rows, on the same batches
(launched by tests/test_prefix_sharing.py).

    torchrun --nproc_per_node W tests/multirank/prefix_sharing_check.py MODEL_DIR SPEC...

Each SPEC is "tp,pp,cp[,flags]" (flags "+"-separated: sp, sequence parallelism; dyn=N,
train.max_tokens_per_micro_batch N; mbs=N, train.micro_batch_size N; vpp=V, virtual pipeline
stages; lora, a LoRA policy (all-linear, rank 4); unchunked, the policy's loss on megatron's
logits (train.loss_chunk_tokens null: megatron's cross-entropy modifies the gathered logits in
place); ep=N, expert parallelism (a MoE MODEL_DIR); aux, the router's load-balancing and z
losses on; ctl, the negative controls; obj=A/B, only these objectives; fallback, sft trains
on rows whose shared micro-batch falls back to unshared rows, fallback_rows). Per spec, at W
ranks (DP = W / (tp*pp*cp)), sharing off then on, the same HF weights loaded each time:
  grpo: a GRPO batch whose groups share prompts (a row a prefix of another, one duplicated):
        token log-probs, STEPS steps of the full policy loss (dual clip, k3 KL, entropy, IS);
  sft:  STEPS SFT steps on rows sharing a system prompt and agent rows each extending the last;
  dpo:  STEPS DPO steps (sigmoid, frozen reference) on pairs sharing prompts, and log-probs;
  ppo:  the PPO critic's token values of the grpo rows, GAE, STEPS critic updates.
Rank 0 prints a "RESULT {json}" line per (spec, objective): the largest relative difference of
the log-prob table and of each compared metric over the steps (relative to the metric's largest
size, "scales": DPO's rewards start at 0; "metric_abs" per metric), both prefix token ratios;
moe/* (a shared token counts once) apart ("moe_rel") with step 1's loss and grad norm. Controls
(ctl): a row sees its sibling branches; RoPE positions along the tree row. Adam eps 1e-4 (as
rl_invariance.py). PREFIX_SPLIT_MIN_KEYS=N: the split attention's threshold (1: always).
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS = 3
GROUPS, N = 3, 4
SETTINGS = dict(temperature=0.8, eps_low=0.2, eps_high=0.28, dual_c=3.0, kl_beta=0.05,
                kl_estimator="k3", entropy_coef=0.01)
SKIP = ("time/", "train/micro_batches", "batch/num_padding", "batch/dp_imbalance",
        "train/prefix_token_ratio", "lr", "compile/", "moe/")
AUX = dict(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
           moe_z_loss_coeff=1e-3)


def grpo_rollout(vocab: int):
    """GROUPS prompts of 12..20 tokens x N replies of 1..12 tokens; in group 0 reply 1 extends
    reply 0 (a prefix row) and reply 3 repeats reply 2 (a duplicate)."""
    import torch

    from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
    from engine.rl.collect.batch import RolloutBatch

    rng = random.Random(5)
    prompts, responses, rewards = [], [], []
    for g in range(GROUPS):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(12, 20))]
        replies = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))] for _ in range(N)]
        if g == 0:
            replies[1] = replies[0] + replies[1]
            replies[3] = list(replies[2])
        for reply in replies:
            prompts.append(prompt)
            responses.append(reply)
            rewards.append(float(rng.random() < 0.5))
    adv = ADVANTAGE_ESTIMATORS["grpo"](torch.tensor(rewards), N, SimpleNamespace(norm_by_std=True),
                                       torch.tensor([len(r) for r in responses])).tolist()
    return RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], adv)


def sft_rows(vocab: int):
    """Rows sharing a 14-token system prompt with their own turns, and agent rows each
    extending the previous by one turn (trained: the turn's reply)."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(9)
    system = [rng.randrange(4, vocab) for _ in range(14)]
    rows = []
    for _ in range(4):
        ids = system + [rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))]
        rows.append((ids, len(system)))
    history = list(system)
    for _ in range(4):
        start = len(history)
        history = history + [rng.randrange(4, vocab) for _ in range(rng.randint(3, 6))]
        rows.append((list(history), start))
    seqs = []
    for ids, start in rows:
        labels = ids[1:] + [0]
        mask = [0] * (start - 1) + [1] * (len(ids) - start) + [0]
        seqs.append(SequenceData(ids, labels, mask))
    return seqs


def fallback_rows(vocab: int):
    """SFT rows the plan puts in one micro-batch of 40 tree tokens that runs unshared (flag
    `fallback`, with dyn=40): two 12-token rows sharing 4 tokens (a tree of 20) and a 20-token
    row sharing nothing. Together they save 4 of 44 tokens (under prefix_tree.MIN_SAVING), so
    the plan re-packs them within the budget (prefix_tree.unshared_within_budget)."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(11)
    prefix = [5 + rng.randrange(vocab - 5) for _ in range(4)]
    rows = [prefix + [rng.randrange(4, vocab) for _ in range(8)] for _ in range(2)]
    rows.append([4] + [rng.randrange(4, vocab) for _ in range(19)])
    return [SequenceData(ids, ids[1:] + [0], [0, 0] + [1] * (len(ids) - 3) + [0])
            for ids in rows]


def _engine(model_dir, hf_config, layout_kw, world, train, sp):
    from tests.multirank.rl_invariance import _is_current, optim_settings
    import torch

    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    layout = ParallelLayout(world, sequence_parallel=sp, **layout_kw)
    if not _is_current(layout):
        setup_model_parallel(layout)
    lora = {}
    if getattr(train, "lora", False):   # all-linear adapters, rank 4 (B = 0: trained from 0)
        from models.lora.adapters import LoraSpec
        from models.lora.sites import resolve_targets
        lora = dict(lora=LoraSpec(4, 8.0, resolve_targets("all-linear"), seed=3))
    chunk = None if getattr(train, "unchunked", False) else 16   # None: megatron's logits
    aux = AUX if getattr(train, "aux", False) else {}
    return TrainEngine.build(hf_config, optim_settings(), torch.float32, STEPS, train,
                             weights_dir=model_dir, loss_chunk_tokens=chunk,
                             sequence_parallel=sp, **lora, **aux)


def grpo_run(model_dir, hf_config, layout_kw, world, train, sp):
    from tests.multirank.rl_invariance import _sequences
    from engine.rl.policy.update import PolicyLossSettings, policy_update

    state = _engine(model_dir, hf_config, layout_kw, world, train, sp)
    batch = grpo_rollout(hf_config["vocab_size"])
    seqs, table, _, _ = _sequences(state, batch, SETTINGS["temperature"])
    settings = PolicyLossSettings(vocab_size=state.vocab_size, **SETTINGS)
    loss_cfg = SimpleNamespace(agg_mode="token-mean", count_empty_sequences=True)
    steps = [policy_update(state, seqs, loss_cfg, settings, 40) for _ in range(STEPS)]
    state.release()
    return table, steps


def sft_run(model_dir, hf_config, layout_kw, world, train, sp):
    from megatron.core import parallel_state as ps
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.sft.training import SFT_REPORT_KEYS, sft_loss_fn
    from engine.training.loss import GlobalLossNormalizer

    state = _engine(model_dir, hf_config, layout_kw, world, train, sp)
    seqs = (fallback_rows if getattr(train, "fallback", False) else sft_rows)(
        hf_config["vocab_size"])
    table = compute_token_logprobs(state, seqs, 1.0)
    steps = []
    for _ in range(STEPS):
        norm = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
        steps.append(state.train_batch(seqs, norm, sft_loss_fn(state.vocab_size),
                                       SFT_REPORT_KEYS))
    state.release()
    return table, steps


def dpo_run(model_dir, hf_config, layout_kw, world, train, sp):
    """STEPS DPO steps (sigmoid loss, frozen reference: engine.dpo.training.dpo_step) on pairs
    sharing their prompts; the table: the policy's token log-probs of the first batch's rows."""
    import torch

    from engine.dpo.training import dpo_step
    from engine.preference.reference import Reference
    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.training.micro_batches import SequenceData
    from engine.training.train_engine import TrainEngine
    from tests.multirank.dpo_check import METRICS, pair_batches, run_cfg

    policy = _engine(model_dir, hf_config, layout_kw, world, train, sp)
    frozen = TrainEngine.frozen(hf_config, torch.float32, model_dir, train, 0,
                                loss_chunk_tokens=16, sequence_parallel=sp)
    reference = Reference(policy, frozen, False, True, None)
    batches = (pair_batches(hf_config["vocab_size"], 0)
               + pair_batches(hf_config["vocab_size"], 1))[:STEPS]
    rows = [SequenceData(s.tokens, s.labels, s.loss_mask) for p in batches[0]
            for s in (p.chosen, p.rejected)]
    table = compute_token_logprobs(policy, rows, 1.0)
    steps = []
    for pairs in batches:
        m = dpo_step(policy, reference, pairs, run_cfg({}))
        steps.append({k: m[k] for k in METRICS + ("train/prefix_token_ratio",)})
    policy.release()
    frozen.release()
    return table, steps


def ppo_run(model_dir, hf_config, layout_kw, world, train, sp):
    """The PPO critic (a value head on the policy model, seeded): its token values of the GRPO
    rollout rows, GAE, then STEPS critic updates (engine.rl.policy.critic)."""
    import torch

    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.critic import (CriticSettings, attach_gae, compute_token_values,
                                         critic_update)
    from engine.training.train_engine import TrainEngine
    from models.layers.heads.value import attach_value_heads
    from tests.multirank.rl_invariance import _is_current, optim_settings
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    layout = ParallelLayout(world, sequence_parallel=sp, **layout_kw)
    if not _is_current(layout):
        setup_model_parallel(layout)
    row = torch.randn(1, hf_config["hidden_size"],
                      generator=torch.Generator().manual_seed(4)) * 0.2
    critic = TrainEngine.build(hf_config, optim_settings(), torch.float32, STEPS, train,
                               weights_dir=model_dir, loss_chunk_tokens=16,
                               sequence_parallel=sp,
                               prepare=lambda raw: attach_value_heads(raw, row=row))
    batch = grpo_rollout(hf_config["vocab_size"])
    seqs = build_sequences(batch)
    seen: dict = {}
    train_batch = critic.train_batch

    def recording(*args, **kwargs):   # critic_update keeps only critic/*: record the rest
        out = train_batch(*args, **kwargs)
        seen.update(out)
        return out
    critic.train_batch = recording
    table = compute_token_values(critic, seqs)
    sampled = [s.loss_mask for s in seqs]
    settings = CriticSettings(value_clip=0.2, gamma=1.0, lam=0.95)
    attach_gae(seqs, table, sampled, [float(a > 0) for a in batch.advantages], settings)
    loss_cfg = SimpleNamespace(agg_mode="token-mean", count_empty_sequences=True)
    steps = []
    for _ in range(STEPS):
        m = critic_update(critic, seqs, loss_cfg, settings, 40)
        steps.append({**m, "loss": m["critic/value_loss"], "grad_norm": m["critic/grad_norm"],
                      "train/prefix_token_ratio": seen["train/prefix_token_ratio"]})
    critic.release()
    return table, steps


def compare(off, on) -> dict:
    """Largest relative differences of the log-prob tables and of each compared metric."""
    (t0, s0), (t1, s1) = off, on
    scales = {k: max(abs(a[k]) for a in s0) for k in s0[0]}   # a metric's size over the run
    out = {"logprob_rel": float((t1 - t0).abs().max() / t0.abs().max()), "metric_rel": 0.0,
           "moe_rel": {}, "scales": scales, "metric_abs": {}}   # abs: each metric's largest
    for a, b in zip(s0, s1):
        for k, v in a.items():
            out["metric_abs"][k] = max(out["metric_abs"].get(k, 0.0), abs(b[k] - v))
            d = abs(b[k] - v) / max(scales[k], 1e-6)
            if k.startswith("moe/"):
                out["moe_rel"][k] = max(out["moe_rel"].get(k, 0.0), d)
            if d > out["metric_rel"] and not any(k.startswith(p) for p in SKIP):
                out["metric_rel"], out["worst_metric"] = d, k
    out["losses"] = [a.get("loss", a.get("policy/pg_loss")) for a in s0]
    out["grad_norms"] = [a["grad_norm"] for a in s0]
    l0, l1 = (a.get("loss", a.get("policy/pg_loss")) for a in (s0[0], s1[0]))
    out["first_loss_rel"] = abs(l1 - l0) / max(abs(l0), 1e-12)
    out["first_grad_norm_rel"] = abs(s1[0]["grad_norm"] - s0[0]["grad_norm"]) / s0[0]["grad_norm"]
    out["ratio_off"] = s0[0]["train/prefix_token_ratio"]
    out["ratio_on"] = s1[0]["train/prefix_token_ratio"]
    out["micro_batches_on"] = s1[0].get("train/micro_batches")
    return out


def parse_spec(spec: str):
    parts = spec.split(",")
    tp, pp, cp = (int(x) for x in parts[:3])
    flags = parts[3].split("+") if len(parts) > 3 and parts[3] else []
    opts = dict(f.split("=") for f in flags if "=" in f)
    train = dict(micro_batch_size=int(opts.get("mbs", 1)),
                 max_tokens_per_micro_batch=int(opts["dyn"]) if "dyn" in opts else None,
                 balance_dp=True, packing=True, lora="lora" in flags,
                 unchunked="unchunked" in flags, aux="aux" in flags,
                 fallback="fallback" in flags)
    names = opts.get("obj", "/".join(n for n, _ in OBJECTIVES)).split("/")
    layout = dict(tp=tp, pp=pp, cp=cp, **({"vpp": int(opts["vpp"])} if "vpp" in opts else {}),
                  **({"ep": int(opts["ep"])} if "ep" in opts else {}))
    return (layout, train, "sp" in flags, "ctl" in flags,
            [(n, r) for n, r in OBJECTIVES if n in names])


def broken(kind: str):
    """A context manager that breaks prefix sharing the way a negative control needs."""
    import contextlib
    import dataclasses

    import engine.training.tree_batch as tb
    import models.layers.attention.core as core
    from engine.training.prefix_tree import RunSpan

    @contextlib.contextmanager
    def patch():
        if kind == "sibling_visible":   # every earlier node of the row, siblings too
            original = core.tree_attention

            def leaky(q, k, v, params, scale):
                runs = tuple(RunSpan(r.start, r.end, ((0, r.end),)) for r in params.runs)
                return original(q, k, v, dataclasses.replace(params, runs=runs), scale)
            core.tree_attention = leaky
            try:
                yield
            finally:
                core.tree_attention = original
        else:   # positions along the tree row instead of each token's depth
            original = tb.tree_params

            def along_tree(bounds, subtree_end, runs, positions, longest):
                import torch
                return original(bounds, subtree_end, runs,
                                torch.arange(positions.numel()), max(longest, bounds[-1]))
            tb.tree_params = along_tree
            try:
                yield
            finally:
                tb.tree_params = original
    return patch()


OBJECTIVES = (("grpo", grpo_run), ("sft", sft_run), ("dpo", dpo_run), ("ppo", ppo_run))


def run_specs(model_dir, hf_config, world, specs, control_kinds, broken_fn) -> None:
    """Each SPEC's objectives sharing off and on (RESULT lines); with ctl, after grpo, each of
    `control_kinds` run shared inside `broken_fn(kind)` (CONTROL lines)."""
    import torch.distributed as dist

    for spec in specs:
        layout_kw, train_kw, sp, controls, objectives = parse_spec(spec)
        for name, run in objectives:
            off, on = (run(model_dir, hf_config, layout_kw, world,
                           SimpleNamespace(**train_kw, prefix_sharing=sharing), sp)
                       for sharing in (False, True))
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"spec": spec, "objective": name,
                                              **compare(off, on)}), flush=True)
            if not (controls and name == "grpo"):
                continue
            for kind in control_kinds:
                with broken_fn(kind):
                    bad = run(model_dir, hf_config, layout_kw, world,
                              SimpleNamespace(**train_kw, prefix_sharing=True), sp)
                if dist.get_rank() == 0:
                    print("CONTROL " + json.dumps({"spec": spec, "kind": kind,
                                                   **compare(off, bad)}), flush=True)


def main() -> None:
    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    _, world = init_distributed()
    if os.environ.get("PREFIX_SPLIT_MIN_KEYS"):   # the split tree attention (module docstring)
        import parallel.tree_attention_split as split
        split.SPLIT_MIN_KEYS = int(os.environ["PREFIX_SPLIT_MIN_KEYS"])
    run_specs(sys.argv[1], read_config(sys.argv[1]), world, sys.argv[2:],
              ("sibling_visible", "tree_positions"), broken)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
