"""The run header: one line, printed by rank 0 before the model is built, naming what this run
executes once every null / auto key is resolved for the host (engine.run.launch prints it as
"[sft] runs: ...", "[rl] runs: ...").

`run_header(cfg, host)` is pure: `cfg` an SFT-shaped or RL config, `host` what the host has
(`Host`: CUDA, flash-capable device, Transformer Engine). It names
- the optimizer: `adamw` or `muon` (megatron-core's Muon for the 2-D hidden weights, AdamW for
  the rest), the AdamW fused or not (optim.fused resolved: null = on with CUDA parameters;
  engine.training.fused_adamw), and the distributed optimizer when on;
- the layers: compiled or eager (train.compile resolved: null = compiled with CUDA;
  engine.config.compile_settings), and whether the last layer's MLP runs only where a loss
  reads (train.skip_unread_positions; models.layers.unread_positions);
- the attention: Transformer Engine's, torch SDPA over padded rows (train.packing=false), or
  for packed rows torch's flash varlen kernel (CUDA, flash-capable, bf16: one call per row;
  models.layers.attention.varlen; learned sinks, MLA and other head dims keep the loop at run
  time) or SDPA per packed segment;
- RL only, the rollout: the backend, and for hf the static KV cache and the compiled decode
  (rollout.hf.* resolved, engine.generation.hf.settings), for vllm CUDA graphs or eager
  (rollout.vllm.enforce_eager resolved: null = eager on a CPU host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config.compile_settings import compile_on
from engine.generation.hf.settings import resolve as resolve_hf


@dataclass(frozen=True)
class Host:
    cuda: bool          # parameters and engines on CUDA
    flash: bool         # the CUDA device runs torch's flash varlen kernel (sm80+, flash built)
    te: bool            # Transformer Engine installed (its layers are used)


def optimizer_part(optim: Any, cuda: bool) -> str:
    """'optimizer adamw, fused (optim.fused=null), distributed' and the like."""
    fused = cuda if optim.fused is None else bool(optim.fused)
    setting = "null" if optim.fused is None else str(bool(optim.fused)).lower()
    adam = f"{'fused' if fused else 'unfused'} (optim.fused={setting})"
    name = ("muon (Muon on the 2-D hidden weights), its AdamW " if optim.name == "muon"
            else "adamw, ")
    dist = (("layer-wise " if optim.name == "muon" else "") + "distributed optimizer"
            if optim.distributed_optimizer else "optimizer state on every DP rank")
    return f"optimizer {name}{adam}, {dist}"


def layers_part(train: Any, cuda: bool) -> str:
    state = "compiled" if compile_on(train, cuda) else "eager"
    value = "null" if train.compile is None else train.compile
    skip = bool(getattr(train, "skip_unread_positions", True))
    where = "only where a loss reads" if skip else "at every position"
    return (f"layers {state} (train.compile={value}), the last layer's MLP {where} "
            f"(train.skip_unread_positions={str(skip).lower()})")


def attention_part(cfg: Any, host: Host) -> str:
    if host.te:
        return "attention Transformer Engine"
    if not cfg.train.packing:
        return "attention torch SDPA over padded rows (train.packing=false)"
    if host.cuda and host.flash and cfg.model.dtype == "bfloat16":
        return "attention flash varlen, one call per packed row (train.packing=true)"
    why = ("no CUDA" if not host.cuda else "no flash-capable device" if not host.flash
           else f"model.dtype={cfg.model.dtype}")
    return f"attention torch SDPA per packed segment (train.packing=true; {why})"


def rollout_part(rollout: Any, cuda: bool) -> str:
    if rollout.backend == "hf":
        static, compiled = resolve_hf(rollout.hf.static_cache, rollout.hf.compile,
                                      "cuda" if cuda else "cpu")
        return (f"rollout hf ({'static' if static else 'dynamic'} KV cache, "
                f"{'compiled' if compiled else 'eager'} decode)")
    if rollout.backend == "vllm":
        eager = (not cuda) if rollout.vllm.enforce_eager is None else rollout.vllm.enforce_eager
        return f"rollout vllm ({'eager' if eager else 'CUDA graphs'})"
    return f"rollout {rollout.backend}"


def run_header(cfg: Any, host: Host) -> str:
    """The header's text after "[tag] runs: " (module docstring)."""
    parts = [optimizer_part(cfg.optim, host.cuda), layers_part(cfg.train, host.cuda),
             attention_part(cfg, host)]
    if getattr(cfg, "rollout", None) is not None:
        parts.append(rollout_part(cfg.rollout, host.cuda))
    return "; ".join(parts)
