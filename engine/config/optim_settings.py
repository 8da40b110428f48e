"""The optimizer's name and Muon's keys (`optim.name`, `optim.muon.*`, `optim.qk_clip*`;
docs/optimizers.md). Implemented by engine.training.muon (megatron-core's own Muon).

- `optim.name`: `adamw` (default) | `muon`. `muon`: megatron-core's TensorParallelMuon for the
  2-D hidden weights, AdamW (optim.lr/betas/eps/weight_decay) for embeddings, output layer,
  norms and biases, as megatron-core's get_megatron_muon_optimizer assigns them.
- `optim.muon.*`, megatron-core's OptimizerConfig defaults except `tp_mode`:
  `momentum` 0.95, `nesterov` false, `scale_mode` spectral (spectral | unit_rms_norm |
  shape_scaling), `ns_steps` 5, `split_qkv` true (Newton-Schulz on Q, K and V apart),
  `extra_scale_factor` 1.0, `fp32_matmul_prec` medium (medium | high | highest: medium runs the
  Newton-Schulz iteration in bf16), `tp_mode` duplicated (duplicated | distributed | blockwise).
  `duplicated` gathers each tensor-parallel weight and orthogonalizes the full matrix, so a TP
  run trains the model a TP1 run trains; megatron-core's default `blockwise` orthogonalizes
  each TP shard on its own (layout-dependent: TP2 trains a different model than TP1).
- `optim.qk_clip` (MuonClip; `qk_clip_alpha` 0.5, `qk_clip_threshold` 100, megatron-core's
  defaults): refused by name. megatron-core 0.16.1 records the max attention logit only in
  Transformer Engine's attention and clips only multi-latent attention; this engine's attention
  is megatron's local one on every family it trains without Transformer Engine.

- `optim.fused`: null (default) | true | false: torch's fused AdamW kernel for every AdamW of
  the run: null = on when the parameters are on CUDA (engine.training.fused_adamw).
- `optim.distributed_optimizer` with `optim.name=muon`: true (the default) selects
  megatron-core's layer-wise distributed optimizer (`LayerWiseDistributedOptimizer`: whole
  parameters, Muon's and AdamW's, dealt to the data-parallel x context-parallel ranks by size,
  expert parameters to the expert-data-parallel ranks; gradients all-reduced by plain DDP; each
  rank updates its own parameters, then every rank all-gathers them); false keeps the whole
  optimizer state on every DP rank. megatron-core's ZeRO-style distributed optimizer (which
  shards flat gradient buckets) cannot run Muon, which needs whole matrices:
  engine.training.muon's `megatron_distributed_optimizer` says which of the two DDP sees.

Refused by name before any process group (`optim_problems`): a bad choice or range,
optim.name=muon without emerging-optimizers or triton installed or with megatron-core >= 0.17
(whose Muon is built through another API, not wired here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.training.muon import (EMERGING_OPTIMIZERS, INSTALL_HINT,  # noqa: F401 (re-exported)
                                  emerging_optimizers_installed, layer_wise_muon,
                                  megatron_core_problem, megatron_distributed_optimizer,
                                  triton_problem)

OPTIMIZERS = ("adamw", "muon")
MUON_TP_MODES = ("duplicated", "distributed", "blockwise")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("medium", "high", "highest")


@dataclass
class MuonConfig:
    momentum: float = 0.95               # Muon's momentum coefficient, in [0, 1)
    nesterov: bool = False               # Nesterov momentum
    scale_mode: str = "spectral"         # spectral | unit_rms_norm | shape_scaling
    ns_steps: int = 5                    # Newton-Schulz iterations per update (>= 1)
    split_qkv: bool = True               # Newton-Schulz on Q, K and V apart
    tp_mode: str = "duplicated"          # duplicated | distributed | blockwise (layout-dependent)
    extra_scale_factor: float = 1.0      # multiplies the scaled update (> 0)
    fp32_matmul_prec: str = "medium"     # medium (bf16 Newton-Schulz) | high | highest


@dataclass
class OptimConfig:
    lr: float = 1e-5             # peak learning rate (after warmup_steps)
    min_lr: float = 0.0          # the cosine schedule's final learning rate
    warmup_steps: int = 0        # linear warmup from 0 to lr over this many steps
    weight_decay: float = 0.0    # decoupled (AdamW) weight decay
    clip_grad: float = 1.0       # clip the global gradient norm to this (0: no clipping)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's beta1, beta2
    eps: float = 1e-8            # Adam's epsilon
    schedule: str = "cosine"     # cosine | constant
    # megatron's distributed optimizer (state sharded over DP); with name=muon its layer-wise
    # distributed optimizer (docs/optimizers.md)
    distributed_optimizer: bool = True
    # torch's fused AdamW kernel: null = on with CUDA parameters | true | false (engine.training.fused_adamw)
    fused: Optional[bool] = None
    # adamw | muon (Muon for 2-D hidden weights, AdamW for the rest; engine.config.optim_settings,
    # docs/optimizers.md)
    name: str = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    # MuonClip: only false is accepted (true is refused: megatron-core 0.16.1 clips only
    # multi-latent attention under Transformer Engine; docs/optimizers.md)
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5           # MuonClip's alpha (unused: qk_clip is refused)
    qk_clip_threshold: float = 100.0     # MuonClip's max-logit threshold (unused: as qk_clip)


def _choice(problems: list[str], value, key: str, choices: tuple) -> None:
    if value not in choices:
        problems.append(f"{key}={value!r} is not one of {', '.join(choices)}")


def optim_problems(optim) -> list[str]:
    """Problems of optim.name, optim.muon.* and optim.qk_clip* (no process group, no import
    of the optimizer)."""
    p: list[str] = []
    _choice(p, optim.name, "optim.name", OPTIMIZERS)
    m = optim.muon
    _choice(p, m.tp_mode, "optim.muon.tp_mode", MUON_TP_MODES)
    _choice(p, m.scale_mode, "optim.muon.scale_mode", MUON_SCALE_MODES)
    _choice(p, m.fp32_matmul_prec, "optim.muon.fp32_matmul_prec", MATMUL_PRECISIONS)
    if not isinstance(m.ns_steps, int) or m.ns_steps < 1:
        p.append(f"optim.muon.ns_steps={m.ns_steps} must be an integer >= 1")
    if not 0.0 <= m.momentum < 1.0:
        p.append(f"optim.muon.momentum={m.momentum} must be in [0, 1)")
    if not m.extra_scale_factor > 0:
        p.append(f"optim.muon.extra_scale_factor={m.extra_scale_factor} must be > 0")
    if optim.qk_clip:
        p.append("optim.qk_clip=true is not supported: megatron-core 0.16.1 records the max "
                 "attention logit only in Transformer Engine's attention and clips only "
                 "multi-latent attention, and this engine trains with megatron's local "
                 "attention; supported: optim.qk_clip=false")
    if optim.name == "muon":
        if megatron_core_problem():
            p.append(megatron_core_problem())
        if not emerging_optimizers_installed():
            p.append(f"optim.name=muon needs {EMERGING_OPTIMIZERS}, which is not installed: "
                     f"{INSTALL_HINT}")
        elif triton_problem():      # emerging-optimizers imports it unconditionally
            p.append(triton_problem())
    return p

