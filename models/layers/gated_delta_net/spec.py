"""The per-layer decoder spec of a hybrid (Qwen3.5) model on the local spec: Gated DeltaNet
layers (models.layers.gated_delta_net.module) where the HF `layer_types` say linear_attention, megatron's
gated attention elsewhere, every RMSNorm zero-centred (models.layers.norms.zero_centered), and the
GPTModel arguments the family needs (partial RoPE: `rotary_percent`).

The block of one pipeline stage / virtual chunk holds that stage's slice of the global layer
list (megatron's own offset), so a GDN/attention pattern splits at any layer.
"""
from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from models.families.registry import family_of
from models.families.base import field
from models.families.fields import rope_parameters
from models.layers.gated_delta_net.module import GatedDeltaNet
from models.hf.config import hf_config_object
from models.layers.norms.zero_centered import ZeroCenteredRMSNorm


def is_hybrid(hf_config: Any) -> bool:
    """True for families with per-layer mixers (Qwen3.5)."""
    return family_of(hf_config).hybrid


def gpt_model_kwargs(hf_config: Any) -> dict:
    """Extra GPTModel arguments: the rotated fraction of each head (partial RoPE)."""
    if not is_hybrid(hf_config):
        return {}
    factor = float(rope_parameters(_text(hf_config)).get("partial_rotary_factor", 1.0))
    return {"rotary_percent": factor}


def _text(hf_config: Any) -> Any:
    return hf_config_object(hf_config)


def zero_centered_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """A deep copy of an attention layer spec with every norm zero-centred (Qwen3.5's
    full-attention layer; also its MTP layer's decoder layer: models.layers.mtp.spec)."""
    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    layer.input_layernorm = ZeroCenteredRMSNorm
    layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = layer.self_attention.submodules
    attention.q_layernorm = ZeroCenteredRMSNorm
    attention.k_layernorm = ZeroCenteredRMSNorm
    return spec


def hybrid_layer_specs(layer_spec: ModuleSpec, hf_config: Any) -> list[ModuleSpec]:
    """One spec per global layer: GDN where layer_types says linear_attention."""
    attention = zero_centered_spec(layer_spec)
    gdn = copy.deepcopy(attention)
    gdn.submodules.self_attention = ModuleSpec(module=GatedDeltaNet)
    kinds = list(field(_text(hf_config), "layer_types"))
    return [gdn if kind == "linear_attention" else attention for kind in kinds]


def hybrid_block_spec(config, layer_spec: ModuleSpec, hf_config: Any,
                      vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage (virtual chunk `vp_stage`)."""
    specs = hybrid_layer_specs(layer_spec, hf_config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count],
                                      layer_norm=ZeroCenteredRMSNorm)

