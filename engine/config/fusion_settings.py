"""The `model.fusions.*` keys: element-wise fusions available without Transformer Engine.

Each key is false (the default) or true; null, accepted for older configs, means false. They
are off by default because on one H100 (2026-11-24, docs/benchmarks.md "H100 session 2") each of
them made a 0.6B dense SFT step slower than the unfused path: rmsnorm +59 %, swiglu +23 %,
residual +13 %, all three +70 %. They stay available, exact, for hosts where they pay.

- `model.fusions.swiglu`: megatron's fused SwiGLU (`bias_activation_fusion`:
  megatron.core.fusions.fused_bias_swiglu, forward and a hand-written backward under megatron's
  jit fuser, i.e. torch.compile on CUDA). Dense MLPs and MoE experts (the weighted variant
  that also applies the routing probabilities; models.layers.experts.grouped). SwiGLU models only
  (HF `hidden_act` silu): megatron's fused GeGLU is the tanh approximation of gelu, not
  exact for HF's gelu, so other activations stay unfused whatever the key says.
- `model.fusions.residual`: megatron's fused bias-dropout-add (`bias_dropout_fusion`: the
  residual add of attention and MLP outputs, with dropout 0, under the same jit fuser).
- `model.fusions.rmsnorm`: RMSNorm through torch.compile (models.layers.norms.local.FusedRMSNorm: one
  fused forward kernel and a backward whose weight gradient is one fused reduction). On a CPU
  host too: torch >= 2.13's dynamo traces the CPU runtime's device-mapping torch function mode
  (parallel.cpu_runtime), as train.compile's regions do (inductor's C++ backend).

All three are exact rewrites of the unfused math (the same operations, in the same dtypes);
tests/test_fusions.py checks them against the unfused path on the CPU (rel 1e-5, forward and
backward; the compiled RMSNorm in a plain process). On a CPU host megatron's jit fuser is off
(parallel.cpu_runtime), so swiglu and residual run their eager functions there: allowed, exact,
not faster. RoPE fusion (megatron's `apply_rope_fusion`) needs Transformer Engine's kernel and
is not offered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

FUSIONS = ("swiglu", "residual", "rmsnorm")


@dataclass
class FusionConfig:
    swiglu: Optional[bool] = False    # megatron's fused SwiGLU
    residual: Optional[bool] = False  # megatron's fused bias-dropout-add
    rmsnorm: Optional[bool] = False   # torch.compile'd RMSNorm


def _fusions(cfg: Any) -> FusionConfig:
    return getattr(getattr(cfg, "model", None), "fusions", None) or FusionConfig()


def fusion_on(cfg: Any, name: str) -> bool:
    """model.fusions.<name> resolved (null: off, on every host)."""
    return bool(getattr(_fusions(cfg), name))


def fusion_problems(cfg: Any) -> list[str]:
    """Every invalid model.fusions.* value, naming the key (before any process group)."""
    fusions, p = _fusions(cfg), []
    for name in FUSIONS:
        value = getattr(fusions, name)
        if value is not None and not isinstance(value, bool):
            p.append(f"model.fusions.{name}={value!r} must be true or false")
    return p


def fusion_overrides(cfg: Any, hf_config: dict) -> dict:
    """build_model_chunks arguments of the model.fusions.* keys: two TransformerConfig
    fields and the builder's `fused_norm` (used by RMSNorm models; LayerNorm ones ignore it).
    The SwiGLU fusion applies to SwiGLU models only (`hidden_act` silu, HF's default)."""
    swiglu = hf_config.get("hidden_act", "silu") == "silu"
    return dict(bias_activation_fusion=swiglu and fusion_on(cfg, "swiglu"),
                bias_dropout_fusion=fusion_on(cfg, "residual"),
                fused_norm=fusion_on(cfg, "rmsnorm"))


def describe_fusions(cfg: Any) -> str:
    """e.g. "fusions: swiglu on, residual on, rmsnorm off"."""
    return "fusions: " + ", ".join(f"{n} {'on' if fusion_on(cfg, n) else 'off'}"
                                   for n in FUSIONS)
