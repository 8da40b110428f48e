"""Old log-probs from the training forward against the separate pass (engine.rl.policy.
old_logprobs), run inside tests/multirank/rl_invariance.py's launches (no launch of its own).

ONPOLICY_STEPS whole RL steps of the trainer (engine.rl.policy.train_step.train_on_rollout:
the log-prob stage, with a frozen KL reference of the same weights, then one optimizer step per
RL step) on the first ONPOLICY_SEQUENCES sequences (two whole groups) of the fixed synthetic
rollout batch, for loss.agg_mode=token-mean:
  - the reference launch (1 process) runs train.old_logprobs=recompute (the separate pass,
    today's path) and keeps it as the reference "onpolicy/token-mean"; then the default
    train.old_logprobs=auto (old log-probs from the training forward) at 1 process, compared;
  - the 4-rank launch runs auto at each dense layout it visits (DP4, TP2+SP x DP2, PP2 x DP2,
    CP2 x DP2 with packing), compared with the 1-process recompute reference;
  - negative control (reference launch, "CONTROL_OLD" line): recompute with stale old log-probs,
    the separate pass run on a perturbed copy of the weights (Gaussian noise of std
    STALE_NOISE on every parameter, restored after the pass): its losses differ visibly.
The compared metrics include rollout/logprob_diff and rollout/logprob_diff_max (the separate
pass's table against the training forward's own measurement) and the clip fractions (0 on
both paths: the ratio is 1 exactly or within rounding).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

ONPOLICY_STEPS = 3
ONPOLICY_SEQUENCES = 8
ONPOLICY_MODE = "token-mean"
STALE_NOISE = 2e-2
ONPOLICY_METRICS = ("policy/pg_loss", "policy/clipfrac_low", "policy/clipfrac_high",
                    "policy/kl", "policy/entropy", "rollout/logprob_diff",
                    "rollout/logprob_diff_max")


def onpolicy_config(old_logprobs: str, settings: dict, horizon: int):
    """The RLConfig of the cases: `settings` (tests/multirank/rl_invariance.py SETTINGS), one
    mini-batch and one epoch per step, no rollout correction."""
    from engine.rl.config import RLConfig

    cfg = RLConfig()
    cfg.train.old_logprobs = old_logprobs
    cfg.train.mini_batches_per_step = cfg.train.epochs_per_rollout = 1
    cfg.rollout.temperature = settings["temperature"]
    cfg.clip.eps_low, cfg.clip.eps_high = settings["eps_low"], settings["eps_high"]
    cfg.clip.dual_c = settings["dual_c"]
    cfg.kl.beta, cfg.kl.estimator = settings["kl_beta"], settings["kl_estimator"]
    cfg.entropy_coef = settings["entropy_coef"]
    cfg.loss.agg_mode, cfg.loss.norm_horizon = ONPOLICY_MODE, horizon
    return cfg


@contextmanager
def _perturbed_weights(engine, seed: int):
    """`engine`'s parameters + N(0, STALE_NOISE^2) noise inside the block, restored after."""
    import torch

    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(STALE_NOISE * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


@contextmanager
def stale_old_logprobs(policy):
    """The log-prob stage's passes over `policy` (the old log-probs) read perturbed weights."""
    import engine.rl.policy.logprob_stage as stage

    real = stage.compute_token_logprobs

    def stale(engine, seqs, temperature):
        if engine is not policy:
            return real(engine, seqs, temperature)
        with _perturbed_weights(engine, seed=11):
            return real(engine, seqs, temperature)

    stage.compute_token_logprobs = stale
    try:
        yield
    finally:
        stage.compute_token_logprobs = real


def run_onpolicy(setup, model_dir, hf_config, layout_kw, train, world, sp, batch, cfg,
                 stale: bool = False):
    """(per-step metrics, final HF tensors on rank 0 or None) of ONPOLICY_STEPS RL steps;
    `setup`: rl_invariance._setup; `batch`: a RolloutBatch, of which the first
    ONPOLICY_SEQUENCES responses are trained."""
    import torch
    import torch.distributed as dist

    from engine.config.moe_settings import MoEConfig, moe_overrides
    from engine.rl.collect.batch import RolloutBatch
    from engine.rl.policy.logprob_stage import AuxiliaryModels
    from engine.rl.policy.train_step import train_on_rollout
    from engine.rl.policy.weight_sync import sync_to_rollout
    from engine.training.train_engine import TrainEngine
    from tests.multirank.rl_invariance import LOSS_CHUNK_TOKENS, RecordingEngine

    overrides = dict(moe_overrides(SimpleNamespace(moe=MoEConfig()), hf_config),
                     sequence_parallel=sp)
    policy = setup(model_dir, hf_config, layout_kw, world, train, overrides,
                   steps=ONPOLICY_STEPS)
    reference = TrainEngine.frozen(hf_config, torch.float32, model_dir, train,
                                   loss_chunk_tokens=LOSS_CHUNK_TOKENS, **overrides)
    aux = AuxiliaryModels(reference=reference)
    n = ONPOLICY_SEQUENCES
    batch = RolloutBatch(batch.prompt_ids[:n], batch.response_ids[:n],
                         batch.rollout_logprobs[:n], batch.advantages[:n])
    results = []
    with stale_old_logprobs(policy) if stale else nullcontext():
        for step in range(ONPOLICY_STEPS):
            results.append(train_on_rollout(policy, aux, batch, cfg, step))
    engine = RecordingEngine() if dist.get_rank() == 0 else None
    sync_to_rollout(policy.chunks, hf_config, engine, bucket_mb=0.05)
    reference.release()
    policy.release()
    return results, (engine.tensors if engine else None)


def summary(results, params) -> dict:
    """What the reference keeps of a run: per-step loss, grad norm, ONPOLICY_METRICS, params."""
    return {"loss": [r["policy/loss"] for r in results],
            "grad_norm": [r["grad_norm"] for r in results],
            "metrics": {k: [r[k] for r in results] for k in ONPOLICY_METRICS},
            "params": params}


def _rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare(results, params, ref: dict) -> dict:
    """Relative differences to the reference `summary` (params: max |diff| / max |ref| per
    tensor, the largest over tensors; rank 0 only)."""
    run = summary(results, params)
    out = {"loss": run["loss"], "grad_norm": run["grad_norm"], "metrics": run["metrics"],
           "loss_rel": _rel(run["loss"], ref["loss"]),
           "grad_norm_rel": _rel(run["grad_norm"], ref["grad_norm"]),
           "metrics_rel": {k: _rel(run["metrics"][k], ref["metrics"][k])
                           for k in ONPOLICY_METRICS}}
    if params is not None:
        assert set(params) == set(ref["params"]), sorted(set(params) ^ set(ref["params"]))
        out["param_rel"] = max(float((v - ref["params"][k]).abs().max())
                               / max(float(ref["params"][k].abs().max()), 1e-12)
                               for k, v in params.items())
    return out


def onpolicy_cases(run, rank: int, spec: str, world: int, making: bool, new_ref: dict,
                   ref: dict | None) -> None:
    """The module docstring's cases at the current layout; `run(old_logprobs, stale)` runs
    one (run_onpolicy with the layout's arguments bound). Rank 0 prints "ONPOLICY {json}"
    lines (and "CONTROL_OLD" in the reference launch), the last with "seconds": the wall time
    of all the cases at this layout; the reference is kept in new_ref["onpolicy"]."""
    start = time.perf_counter()

    def emit(prefix: str, out: dict) -> None:
        if rank == 0:
            print(prefix + json.dumps(out), flush=True)

    if making:
        new_ref["onpolicy"] = summary(*run("recompute", False))
        emit("ONPOLICY ", {"reference": True, "spec": spec, "world": world,
                           **{k: v for k, v in new_ref["onpolicy"].items() if k != "params"}})
        stale, _ = run("recompute", True)
        emit("CONTROL_OLD ", {"stale": [r["policy/loss"] for r in stale],
                              "reference": new_ref["onpolicy"]["loss"]})
    results, params = run("auto", False)
    emit("ONPOLICY ", {"spec": spec, "world": world,
                       **compare(results, params, (new_ref or ref)["onpolicy"]),
                       "seconds": time.perf_counter() - start})
