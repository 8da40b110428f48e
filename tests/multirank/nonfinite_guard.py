"""Skipped non-finite steps leave no trace (launched by tests/test_nonfinite.py).

    torchrun --nproc_per_node 2 tests/multirank/nonfinite_guard.py MODEL_DIR

For each layout (DP2 with the distributed optimizer, TP2, PP2, and DP2 with the gradient-reduce
and parameter-gather overlap on: dp2_ov), in the same processes:
- reference R: train_step on batches 0 and 2;
- guarded G: train_step on batch 0; then the first parameter of every rank's first chunk is
  filled with NaN and train_step runs batch 1 (must be skipped on every rank); the parameter
  is restored and train_step runs batch 2. G must end bitwise equal to R (the skipped step
  touched no weight, Adam moment, Adam step count or LR-schedule step);
- negative control C: as G, but with megatron's plain `optimizer.step()` instead of the guard:
  its parameters are no longer finite after batch 2.
Rank 0 prints one line "RESULT {json}" per layout.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.multirank.checkpoint_state import OPTIM, TRAIN, batches  # noqa: E402

LAYOUTS = {"dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2_ov": {}}


def local_params(state) -> list:
    state.gather_params()   # overlap_param_gather: the last step's gather is still deferred
    return [p.detach().clone() for c in state.chunks for p in c.parameters()]


def run(state, data, normalizer, train, poison: bool) -> list[dict]:
    """train_step on data[0], then (poisoned when `poison`) data[1], then data[2]."""
    from engine.sft.training import train_step

    out = [train_step(state, data[0], normalizer)]
    if poison:
        state.gather_params()   # else the deferred gather would overwrite the poison
        param = next(state.chunks[0].parameters())
        saved = param.detach().clone()
        param.data.fill_(float("nan"))
        out.append(train_step(state, data[1], normalizer))
        param.data.copy_(saved)
    out.append(train_step(state, data[2], normalizer))
    return out


def plain_megatron_step(optimizer, loss):
    ok, grad_norm, _ = optimizer.step()
    return bool(ok), float("nan") if grad_norm is None else float(grad_norm)


def main() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import engine.training.train_engine as train_engine  # the step TrainEngine.train_batch calls
    from engine.training.comm_overlap import OverlapSettings
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    model_dir = sys.argv[1]
    rank, world = init_distributed()
    hf = read_config(model_dir)
    optim, train = OPTIM, TRAIN
    data = batches(hf["vocab_size"], 3)
    guarded = train_engine.guarded_optimizer_step
    for name, kw in LAYOUTS.items():
        overlap = OverlapSettings(True, True, bucket_mb=0.02) if name.endswith("_ov") else None
        setup_model_parallel(ParallelLayout(world, **kw))
        normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
        results = {}
        for variant in ("R", "G", "C"):
            train_engine.guarded_optimizer_step = plain_megatron_step if variant == "C" else guarded
            state = TrainEngine.build(hf, optim, torch.float32, 6, train,
                                      weights_dir=model_dir, overlap=overlap)
            metrics = run(state, data, normalizer, train, poison=variant != "R")
            results[variant] = (metrics, local_params(state), state)
        train_engine.guarded_optimizer_step = guarded
        ref, got, ctl = (results[v][1] for v in "RGC")
        diff = max(float((a - b).abs().max()) for a, b in zip(ref, got))
        bad = torch.tensor([0.0 if all(torch.isfinite(p).all() for p in ctl) else 1.0])
        err = torch.tensor([diff])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        g_metrics, g_state = results["G"][0], results["G"][2]
        if rank == 0:
            print("RESULT " + json.dumps({
                "layout": name,
                "skipped": [m["train/update_skipped"] for m in g_metrics],
                "skipped_steps": [m["train/skipped_steps"] for m in g_metrics],
                "poisoned_grad_norm": g_metrics[1]["grad_norm"],
                "guard_skipped": g_state.guard.skipped,
                "scheduler_steps": [results[v][2].scheduler.num_steps for v in "RG"],
                "lr": [results[v][0][-1]["lr"] for v in "RG"],
                "max_abs_diff": float(err), "control_nonfinite": bool(bad.item()),
            }), flush=True)
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
