"""HF <-> Megatron mapping of the sigmoid-routed MoE pieces (models.families.sigmoid_routed) that the
generic maps (models.bridge.weights, models.layers.experts.mapping) lack, for every family that routes this way
(GLM-4.5, DeepSeek-V3):

  megatron (under decoder.layers.{i}.)     HF (under model.layers.{i}.)           kind
  mlp.router.expert_bias  (fp32 buffer)    mlp.gate.e_score_correction_bias [E]   replicated
  mlp.shared_experts.linear_fc1.weight     mlp.shared_experts.{gate,up}_proj      fc1 (gate/up
                                                                                  per TP rank)
  mlp.shared_experts.linear_fc2.weight     mlp.shared_experts.down_proj           row

The expert bias is a buffer, not a parameter (megatron updates it outside the optimizer:
engine.config.moe_settings `moe.bias_update_rate`); `mapped_buffers` lists the buffers the
bridge loads and exports besides the parameters.
"""
from __future__ import annotations

from models.families.sigmoid_routed import SCORE_BIAS, SHARED_EXPERTS

EXPERT_BIAS = "mlp.router.expert_bias"
_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    EXPERT_BIAS: ("replicated", (SCORE_BIAS,)),
    "mlp.shared_experts.linear_fc1.weight": (
        "fc1", (f"{SHARED_EXPERTS}.gate_proj.weight", f"{SHARED_EXPERTS}.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", (f"{SHARED_EXPERTS}.down_proj.weight",)),
}


def routed_mapping(suffix: str, layer: int, config) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a megatron per-layer suffix (`layer`: global, 0-based) of a
    sigmoid-routed model (its TransformerConfig enables the expert bias), else None."""
    if not getattr(config, "moe_router_enable_expert_bias", False) or suffix not in _MAP:
        return None
    kind, names = _MAP[suffix]
    return kind, tuple(f"model.layers.{layer}.{n}" for n in names)


def mapped_buffers(model) -> list:
    """(name, buffer) of every expert bias of a GPTModel chunk (empty for other models)."""
    return [(name, buf) for name, buf in model.named_buffers()
            if name.endswith("." + EXPERT_BIAS) and buf is not None]
