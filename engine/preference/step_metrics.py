"""The metrics every preference step (DPO, KTO, reward models) logs beside its objective's own,
from TrainEngine.train_batch's reduced output."""
from __future__ import annotations


def step_metrics(out: dict, engine, counts: dict, reference_s: float | None = None) -> dict:
    """grad_norm, lr, the objective's `counts` (e.g. num_pairs), num_tokens, time/step_s (the
    reference pass included), time/reference_s (with a reference: `reference_s`),
    throughput/tokens_per_s, batch/dp_imbalance, batch/padding_fraction, train/update_skipped,
    train/skipped_steps, train/prefix_token_ratio, and moe/* (MoE models), mtp/* (model.mtp.enabled) and compile/*
    (train.compile, engine.training.compile_report) as train_batch reported them."""
    tokens, dt = out["batch/num_tokens"], out["time/step_s"]
    total = dt + (reference_s or 0.0)
    timing = {"time/step_s": total}
    if reference_s is not None:
        timing["time/reference_s"] = reference_s
    return {"grad_norm": out["grad_norm"], "lr": out["lr"], **counts,
            "num_tokens": int(tokens), **timing,
            "throughput/tokens_per_s": tokens / total if total > 0 else 0.0,
            "batch/dp_imbalance": out["batch/dp_imbalance"],
            "batch/padding_fraction": out["batch/num_padding"] / max(
                out["batch/num_padding"] + tokens, 1),
            "train/update_skipped": out["train/update_skipped"],
            "train/skipped_steps": float(engine.guard.skipped),
            "train/prefix_token_ratio": out["train/prefix_token_ratio"],
            **{k: v for k, v in out.items() if k.startswith(("moe/", "mtp/", "compile/"))}}
