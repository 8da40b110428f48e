"""Multi-rank RL policy-update invariance harness (launched by tests/test_rl_loop.py).

    torchrun --nproc_per_node W tests/multirank/rl_invariance.py MODEL_DIR REF_FILE SPEC...

Each SPEC is "tp,pp,cp,mbs[,flags]" (flags "+" separated: packing; mt: the multi-turn batch
of tests/multirank/rl_multi_turn.py (loss masks with holes), references keyed "mt/MODE", and
in the reference launch a negative control with the observation tokens trained; dyn=N:
train.max_tokens_per_micro_batch N (dynamic micro-batches); moe: the Qwen3-MoE policy
of $INV_MOE_MODEL_DIR instead of MODEL_DIR, references keyed "moe/MODE"; ep=E: expert
parallelism; sp: Megatron sequence parallelism; t1: sampling temperature 1.0 with the dense
policy of $INV_T1_MODEL_DIR, references keyed "t1/MODE": no logits copy from a division, the
case where entropy used to be computed from logits megatron's cross-entropy had mutated);
muon: optim.name=muon (megatron-core's Muon, tests/multirank/muon_check.py), references keyed
"muon/MODE" after the model's prefix).
On a FIXED synthetic rollout batch (prompts, responses,
advantages, rollout/old/reference log-probs; no generation) and for every aggregation mode in
MODES, it re-initialises megatron's parallel state in the same processes (when the layout
changes; a layout's cases share its process groups), loads the same HF weights and
  1. recomputes the token log-probs forward-only (engine.rl.policy.update.compute_token_logprobs);
  2. runs STEPS optimizer steps (engine.rl.policy.update.policy_update, one per mini-batch) with the
     full GRPO/DAPO loss: asymmetric + dual clip, truncated IS, k3 KL and an entropy bonus;
  3. streams the final weights to rank 0 through the RL weight sync (engine.rl.loop.
     sync_to_rollout: TP gather + pipeline stages sent to rank 0) into a recording engine.
With W == 1 and the first spec, the results are the reference, saved to REF_FILE; otherwise
they are compared with it. Rank 0 prints one "RESULT {json}" line per (spec, mode).
The dense policy's specs also run tests/multirank/rl_old_logprobs.py's cases (old log-probs
from the training forward vs the separate pass: "ONPOLICY" lines, "CONTROL_OLD" in the
reference launch).
Negative control ("CONTROL" line, W > 1): the policy loss of the first mini-batch with the
classic DDP bug (token-mean over each DP rank's own tokens, averaged over DP ranks).

Adam eps is 1e-4 (as in sft_invariance.py): with eps 1e-8 Adam's first update is ~lr * sign(g)
and amplifies reduction-order noise of tiny gradient entries to full-size parameter changes.
"""
from __future__ import annotations

import json
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.multirank.rl_multi_turn import observations_trained, synthetic_multi_turn  # noqa: E402
from tests.multirank.rl_old_logprobs import (onpolicy_cases, onpolicy_config,  # noqa: E402
                                             run_onpolicy)
from tests.multirank.rl_variants import (VARIANTS, SharedEngine, run_variant,  # noqa: E402
                                         variants_for)

MODES = ("token-mean", "seq-mean-token-mean")
GROUPS, N = 4, 4           # 4 prompts x 4 responses
STEPS = 2                  # mini-batches = optimizer steps
# flag ov: gradient-reduce and parameter-gather overlap on (engine.training.comm_overlap, 0.02
# MiB buckets): the weight sync then reads parameters whose all-gather the last optimizer step
# deferred (engine.rl.policy.weight_sync finishes it). Set by parse_spec for the spec being run.
OVERLAP = {"on": None}
MUON = {"on": False}       # flag muon, set by parse_spec like OVERLAP
LR, ADAM_EPS, HORIZON = 1e-2, 1e-4, 24
LOSS_CHUNK_TOKENS = 16  # chunked loss head, several (ragged) chunks per micro-batch
SETTINGS = dict(temperature=0.8, eps_low=0.2, eps_high=0.28, dual_c=3.0, kl_beta=0.05,
                kl_estimator="k3", entropy_coef=0.01)
BASE_CORRECTION = dict(rollout_is="token", rollout_is_threshold=2.0)  # truncated IS
# Loss / estimator / correction variants on the dense specs (results keyed "var/NAME"):
# tests/multirank/rl_variants.py (one shared model build per layout, one step each).
CORR_KEYS = ("rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/ppl_ratio",
             "rollout_corr/is_weight_mean", "rollout_corr/masked_token_fraction",
             "rollout_corr/rejected_sequence_fraction")
METRIC_KEYS = ("policy/pg_loss", "policy/clipfrac_low", "policy/clipfrac_high", "policy/kl",
               "policy/entropy")


def synthetic_rollout(vocab: int, seed: int = 0, estimator: str = "grpo"):
    """A fixed group-major RolloutBatch: prompts of 3..10 tokens, responses of 1..20 tokens,
    advantages (`estimator`) of random 0/1 rewards (the last group all equal)."""
    import torch

    from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
    from engine.rl.collect.batch import RolloutBatch

    rng = random.Random(seed)
    prompts, responses, rewards = [], [], []
    for g in range(GROUPS):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))]
        for _ in range(N):
            prompts.append(prompt)
            responses.append([rng.randrange(4, vocab) for _ in range(rng.randint(1, 20))])
            rewards.append(1.0 if g == GROUPS - 1 else float(rng.random() < 0.5))
    adv = ADVANTAGE_ESTIMATORS[estimator](torch.tensor(rewards), N,
                                          SimpleNamespace(norm_by_std=True),
                                          torch.tensor([len(r) for r in responses])).tolist()
    logprobs = [[0.0] * len(r) for r in responses]  # replaced by perturbed recomputed values
    return RolloutBatch(prompts, responses, logprobs, adv)


def perturbed(table, seed: int, scale: float):
    """table + seeded Gaussian noise: a layout-independent stand-in for another policy."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return table + scale * torch.randn(table.shape, generator=gen)


class RecordingEngine:
    """Receives the weight sync like a rollout engine and keeps copies of the tensors."""

    def __init__(self):
        self.tensors = {}

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.tensors[name] = tensor.detach().cpu().clone()


def optim_settings():
    from tests.multirank.muon_check import muon_optim

    optim = SimpleNamespace(lr=LR, min_lr=0.0, warmup_steps=0, weight_decay=0.01,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=ADAM_EPS, schedule="constant",
                            distributed_optimizer=True)
    return muon_optim(optim) if MUON["on"] else optim


def _is_current(layout) -> bool:
    """Whether megatron's parallel state is already `layout`'s: the cases of one layout (both
    MODES, the variants' shared engine, a control) then build their engines on its process
    groups instead of destroying and creating them again (about 0.3 s a time on 4 ranks on 2
    cores). Read from megatron itself, so a case the rank pool tore down starts afresh."""
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size()) == (
        layout.tp, layout.pp, layout.cp, layout.ep, layout.vpp)


def _setup(model_dir, hf_config, layout_kw, world, train, overrides=None, steps=STEPS):
    """A TrainEngine of `model_dir` under the layout; `overrides`: TransformerConfig fields
    (default: the engine's own moe.* mapping with default keys, empty for dense models)."""
    import torch

    from engine.config.moe_settings import MoEConfig, moe_overrides
    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    layout = ParallelLayout(world, **layout_kw)
    if not _is_current(layout):
        setup_model_parallel(layout)
    optim = optim_settings()
    if overrides is None:
        overrides = moe_overrides(SimpleNamespace(moe=MoEConfig()), hf_config)
    return TrainEngine.build(hf_config, optim, torch.float32, steps, train,
                             weights_dir=model_dir, overlap=OVERLAP["on"],
                             loss_chunk_tokens=LOSS_CHUNK_TOKENS, **overrides)


def _sequences(state, batch, temperature, correction=None, table=None):
    """Sequences with recomputed log-probs (returned too), fixed synthetic extras and the
    rollout correction (`correction`: RolloutCorrectionConfig keys; default BASE_CORRECTION)
    on the whole batch (bypass mode: old := rollout log-probs); also its metrics. `table`: the
    log-probs of these sequences under the current weights if already computed."""
    from engine.rl.algo.rollout_correction import RolloutCorrectionConfig, apply_to_batch
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs

    seqs = build_sequences(batch)
    if table is None:
        table = compute_token_logprobs(state, seqs, temperature)
    attach_extra(seqs, "ref_logprobs", perturbed(table, 2, 0.3))
    attach_extra(seqs, "rollout_logprobs", perturbed(table, 3, 0.3))
    corr = RolloutCorrectionConfig(**(correction or BASE_CORRECTION))
    if corr.bypass_mode:
        attach_extra(seqs, "old_logprobs", perturbed(table, 3, 0.3))
        return seqs, table, corr, {}
    attach_extra(seqs, "old_logprobs", perturbed(table, 1, 0.3))
    return seqs, table, corr, apply_to_batch(seqs, corr)


def run_layout(model_dir, hf_config, layout_kw, train, mode, batch, world, sp, temperature):
    import torch.distributed as dist

    from engine.config.moe_settings import MoEConfig, moe_overrides
    from engine.rl.policy.update import PolicyLossSettings, policy_update, split_mini_batches
    from engine.rl.policy.weight_sync import sync_to_rollout

    overrides = moe_overrides(SimpleNamespace(moe=MoEConfig()), hf_config)
    state = _setup(model_dir, hf_config, layout_kw, world, train,
                   dict(overrides, sequence_parallel=sp))
    seqs, table, _, batch_metrics = _sequences(state, batch, temperature)
    settings = PolicyLossSettings(vocab_size=state.vocab_size,
                                  **dict(SETTINGS, temperature=temperature))
    loss_cfg = SimpleNamespace(agg_mode=mode, count_empty_sequences=True)
    results = []
    for part in split_mini_batches(len(seqs), STEPS, seed=7, step=0, epoch=0):
        results.append({**batch_metrics, **policy_update(
            state, [seqs[i] for i in part], loss_cfg, settings, HORIZON)})
    engine = RecordingEngine() if dist.get_rank() == 0 else None
    sync_to_rollout(state.chunks, hf_config, engine, bucket_mb=0.05)
    state.release()   # freed with this layout's process groups when the next one starts
    return results, table, (engine.tensors if engine else None)


def negative_control(model_dir, hf_config, batch, world):
    """Loss of the first mini-batch at DP=world with per-rank token-mean averaged over DP."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.rl.policy.update import PolicyLossSettings, policy_loss_fn, split_mini_batches
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import run_micro_batches

    train = SimpleNamespace(micro_batch_size=1, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    state = _setup(model_dir, hf_config, dict(), world, train)
    seqs = _sequences(state, batch, SETTINGS["temperature"])[0]
    part = split_mini_batches(len(seqs), STEPS, seed=7, step=0, epoch=0)[0]
    local = GlobalLossNormalizer("token-mean", group=None)  # the bug: local counts
    rank_batch = build_rank_batch([seqs[i] for i in part], local, train)
    settings = PolicyLossSettings(vocab_size=state.vocab_size, **SETTINGS)
    with torch.no_grad():
        reports = run_micro_batches(state.chunks, rank_batch.micro_batches,
                                    policy_loss_fn(settings), forward_only=True)
    value = torch.tensor([sum(float(r["policy/loss"]) for r in reports)], dtype=torch.float64)
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return float(value) / ps.get_data_parallel_world_size()


def per_shard_control(model_dir, hf_config, spec, world):
    """GSPO's losses at the CP spec with the classic bug: sequence ratios from each CP shard's
    own tokens (engine.rl.algo.seq_reduce.cp_group replaced by None)."""
    from engine.rl.algo import seq_reduce
    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprobs import compute_token_logprobs

    layout_kw, train = parse_spec(spec)
    shared = SharedEngine(model_dir, hf_config, layout_kw, world, train, sp=False)
    batch = synthetic_rollout(hf_config["vocab_size"], estimator=VARIANTS["gspo"][1])
    table = compute_token_logprobs(shared.state, build_sequences(batch), SETTINGS["temperature"])
    real = seq_reduce.cp_group
    seq_reduce.cp_group = lambda: None
    try:
        results, _ = run_variant(shared, table, "gspo", batch, SETTINGS["temperature"])
    finally:
        seq_reduce.cp_group = real
    return [r["policy/loss"] for r in results]


def spec_flags(spec: str) -> list[str]:
    parts = spec.split(",")
    return parts[4].split("+") if len(parts) > 4 and parts[4] else []


def parse_spec(spec: str):
    tp, pp, cp, mbs = (int(x) for x in spec.split(",")[:4])
    flags = spec_flags(spec)
    from engine.training.comm_overlap import OverlapSettings
    OVERLAP["on"] = OverlapSettings(True, True, bucket_mb=0.02) if "ov" in flags else None
    MUON["on"] = "muon" in flags
    ep = next((int(f.split("=")[1]) for f in flags if f.startswith("ep=")), 1)
    dyn = next((int(f.split("=")[1]) for f in flags if f.startswith("dyn=")), None)
    train = SimpleNamespace(micro_batch_size=mbs, max_tokens_per_micro_batch=dyn,
                            balance_dp=True, packing="packing" in flags)
    return dict(tp=tp, pp=pp, cp=cp, ep=ep), train


# spec flag -> (environment variable of its model dir, reference-key prefix)
OTHER_MODELS = {"moe": ("INV_MOE_MODEL_DIR", "moe/"), "t1": ("INV_T1_MODEL_DIR", "t1/")}


def spec_model(spec: str, dense: tuple) -> tuple:
    """(model dir, HF config, reference-key prefix): the dense MODEL_DIR, or with a flag of
    OTHER_MODELS the model of its environment variable; flag mt (multi-turn batch,
    tests/multirank/rl_multi_turn.py) prefixes the key with "mt/"."""
    from models.hf.io import read_config

    mt = "mt/" if "mt" in spec_flags(spec) else ""
    muon = "muon/" if "muon" in spec_flags(spec) else ""
    flag = next((f for f in spec_flags(spec) if f in OTHER_MODELS), None)
    if flag is None:
        return (*dense, mt + muon)
    variable, key = OTHER_MODELS[flag]
    return os.environ[variable], read_config(os.environ[variable]), mt + key + muon


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare(results, table, params, ref):
    losses = [r["policy/loss"] for r in results]
    norms = [r["grad_norm"] for r in results]
    out = {"loss": losses, "grad_norm": norms,
           "loss_rel": _rel(losses, ref["loss"]), "grad_norm_rel": _rel(norms, ref["grad_norm"]),
           "metrics_rel": max(_rel([r[k] for r in results], ref["metrics"][k])
                              for k in ref["metrics"]),
           "logprob_max_diff": float((table - ref["table"]).abs().max())}
    if params is not None:
        assert set(params) == set(ref["params"]), sorted(set(params) ^ set(ref["params"]))
        out["param_rel"] = max(float((v - ref["params"][k]).abs().max())
                               / max(float(ref["params"][k].abs().max()), 1e-12)
                               for k, v in params.items())
        out["n_params"] = len(params)
    return out



def _reporter(rank, world, spec, making, new_ref, ref):
    """report(name, mode, variant, results, table, params): store the reference `name` (when
    `making`) or compare with it; rank 0 prints the RESULT line."""
    def report(name, mode, variant, results, table, params):
        if making:
            keys = METRIC_KEYS + tuple(k for k in CORR_KEYS if k in results[0])
            new_ref[name] = {"loss": [r["policy/loss"] for r in results],
                             "grad_norm": [r["grad_norm"] for r in results],
                             "metrics": {k: [r[k] for r in results] for k in keys},
                             "table": table, "params": params}
            out = {"reference": True, "loss": new_ref[name]["loss"],
                   "grad_norm": new_ref[name]["grad_norm"], "metrics": new_ref[name]["metrics"]}
        else:
            out = compare(results, table, params, (new_ref or ref)[name])
        if rank == 0:
            out.update(spec=spec, mode=mode, world=world, variant=variant)
            print("RESULT " + json.dumps(out), flush=True)
    return report


def run_variants(model_dir, hf_config, layout_kw, train, world, sp, temperature, table, report):
    """The variants of tests/multirank/rl_variants.py at this layout on one shared model build;
    `table`: the log-prob table of the loaded weights (from the last mode's run)."""
    shared = SharedEngine(model_dir, hf_config, layout_kw, world, train, sp)
    for variant in variants_for(layout_kw):
        batch = synthetic_rollout(hf_config["vocab_size"], estimator=VARIANTS[variant][1])
        results, params = run_variant(shared, table, variant, batch, temperature)
        report(f"var/{variant}", VARIANTS[variant][2], variant, results, table, params)


def main():
    import torch

    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    model_dir, ref_file, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, world = init_distributed()
    hf_config = read_config(model_dir)
    dense = (model_dir, hf_config)
    making_ref = world == 1 and not os.path.exists(ref_file)
    ref = None if making_ref else torch.load(ref_file)
    new_ref = {}
    for i, spec in enumerate(specs):
        layout_kw, train = parse_spec(spec)
        spec_dir, spec_config, key = spec_model(spec, dense)
        first_of_model = all(spec_model(s, dense)[2] != key for s in specs[:i])
        flags = spec_flags(spec)
        temperature = 1.0 if "t1" in flags else SETTINGS["temperature"]
        report = _reporter(rank, world, spec, making_ref and first_of_model, new_ref, ref)
        for mode in MODES:
            batch = (synthetic_multi_turn(spec_config["vocab_size"], GROUPS, N)
                     if "mt" in flags else synthetic_rollout(spec_config["vocab_size"]))
            results, table, params = run_layout(
                spec_dir, spec_config, layout_kw, train, mode, batch, world, sp="sp" in flags,
                temperature=temperature)
            report(key + mode, mode, None, results, table, params)
        if key == "":  # the dense policy also runs the loss / estimator / correction variants
            run_variants(spec_dir, spec_config, layout_kw, train, world, "sp" in flags,
                         temperature, table, report)
            # and old log-probs from the training forward vs the separate pass
            onpolicy_cases(lambda old_logprobs, stale: run_onpolicy(
                _setup, spec_dir, spec_config, layout_kw, train, world, "sp" in flags,
                synthetic_rollout(spec_config["vocab_size"]),
                onpolicy_config(old_logprobs, SETTINGS, HORIZON), stale),
                rank, spec, world, making_ref and first_of_model, new_ref, ref)
    cp_spec = next((s for s in specs if parse_spec(s)[0]["cp"] > 1
                    and "mt" not in spec_flags(s)), None)
    if world > 1 and cp_spec is not None:
        control = per_shard_control(model_dir, hf_config, cp_spec, world)
        if rank == 0:
            print("CONTROL_CP " + json.dumps({"spec": cp_spec, "per_shard": control,
                                              "reference": ref["var/gspo"]["loss"]}),
                  flush=True)
    mt_spec = next((s for s in specs if "mt" in spec_flags(s)), None)
    if making_ref and mt_spec is not None:  # negative control: observation tokens trained
        layout_kw, train = parse_spec(mt_spec)
        results = run_layout(model_dir, hf_config, layout_kw, train, MODES[0],
                             observations_trained(synthetic_multi_turn(
                                 hf_config["vocab_size"], GROUPS, N)), world, sp=False,
                             temperature=SETTINGS["temperature"])[0]
        print("CONTROL_MT " + json.dumps({"observations_trained": [
            r["policy/loss"] for r in results], "reference": new_ref["mt/" + MODES[0]]["loss"]}),
            flush=True)
    if making_ref:
        torch.save(new_ref, ref_file)
    if world > 1 and "token-mean" in ref:  # (a launch of mt specs only has no dense ref)
        control = negative_control(model_dir, hf_config,
                                   synthetic_rollout(hf_config["vocab_size"]), world)
        if rank == 0:
            print("CONTROL " + json.dumps({"world": world, "mean_of_means": control,
                                           "reference": ref["token-mean"]["loss"][0]}),
                  flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
