"""The communication section of `--validate` (SFT and RL): models.estimate.comm for a recipe,
as text lines and as the `communication` object of `--validate --json`.

Units: bytes handed to collectives per GPU per optimizer step (comm_plan's definition), for
the busiest pipeline stage per kind; text in GB (1e9 bytes). The overlap settings are
resolved as on the GPUs the recipe targets (CUDA: null means on with the distributed optimizer).
"""
from __future__ import annotations

from models.estimate.comm import GB, KINDS, CommSetup, comm_plan
from engine.config.lora_settings import lora_spec
from engine.config.model_settings import recompute_settings
from engine.config.parallel_settings import overlap_settings

DEFINITION = ("bytes each GPU passes as the input of collective calls per optimizer step "
              "(all-reduce: the tensor; all-gather: the local input; reduce-scatter: the full "
              "input; all-to-all: all input chunks; point-to-point: sent tensors only), summed "
              "per kind, busiest pipeline stage; derived from the model shape and layout, not "
              "measured on GPUs")
LABELS = {"dp_grad_reduce": "DP grad reduce-scatter", "dp_param_all_gather": "DP param all-gather",
          "tp_sp": "TP/SP", "pp_p2p": "PP p2p", "pp_tied_embedding": "PP tied embedding",
          "cp_exchange": "CP exchange", "ep_all_to_all": "EP all-to-all"}


def recipe_setup(cfg, tokens_per_micro_batch: int, micro_batches: int,
                 hf: dict) -> CommSetup:
    """CommSetup of a recipe (model.dtype, optim.distributed_optimizer,
    parallel.grad_reduce_in_fp32, train.recompute*, model.lora.* on the model `hf`)."""
    granularity, _, _ = recompute_settings(cfg.train)
    return CommSetup(tokens_per_micro_batch=tokens_per_micro_batch, micro_batches=micro_batches,
                     act_bytes=2 if cfg.model.dtype == "bfloat16" else 4,
                     distributed_optimizer=cfg.optim.distributed_optimizer,
                     grad_reduce_in_fp32=cfg.parallel.grad_reduce_in_fp32,
                     full_recompute=granularity == "full", lora=lora_spec(cfg, hf))


def comm_section(cfg, hf: dict, layout, tokens_per_micro_batch: int,
                 micro_batches: int) -> tuple[list[str], dict]:
    """(text lines, JSON object) of the communication plan of `cfg` at `layout`."""
    plan = comm_plan(hf, layout, recipe_setup(cfg, tokens_per_micro_batch, micro_batches, hf))
    per_gpu = plan.per_gpu
    overlap = overlap_settings(cfg.parallel, cfg.optim.distributed_optimizer, cuda=True)
    shown = [k for k in KINDS if per_gpu[k] > 0]
    parts = ", ".join(f"{LABELS[k]} {per_gpu[k] / GB:.2f}" for k in shown) or "none"
    total = sum(per_gpu.values())
    g = plan.groups
    buckets = ("megatron's default" if overlap.bucket_mb is None
               else f"{overlap.bucket_mb:g} MiB")
    lines = [
        f"communication per GPU per optimizer step (derived, GB handed to collectives, "
        f"busiest stage): {parts}; total {total / GB:.2f} (groups: dp x cp {g['dp_x_cp']}, "
        f"expert-dp {g['expert_dp']}, tp {g['tp']}, pp {g['pp']}, cp {g['cp']}, ep {g['ep']})",
        f"overlap on GPUs: grad reduce {'on' if overlap.overlap_grad_reduce else 'off'}, "
        f"param gather {'on' if overlap.overlap_param_gather else 'off'}, buckets {buckets}, "
        f"grad reduce in {'fp32' if overlap.grad_reduce_in_fp32 else 'the model dtype'}",
    ]
    data = {"definition": DEFINITION, "unit": "bytes", "per_gpu": per_gpu,
            "per_stage": plan.stages, "total_per_gpu": total, "groups": g,
            "tokens_per_micro_batch": tokens_per_micro_batch, "micro_batches": micro_batches,
            "overlap": {"grad_reduce": overlap.overlap_grad_reduce,
                        "param_gather": overlap.overlap_param_gather,
                        "bucket_mb": overlap.bucket_mb,
                        "grad_reduce_in_fp32": overlap.grad_reduce_in_fp32},
            "measured_on_gpu": False}
    return lines, data
