"""The decoder block of a stack with dense layers first and MoE layers after them
(`first_k_dense_replace`: GLM-4.5, DeepSeek-V3; models.families.sigmoid_routed), on the local spec.

Megatron's TransformerConfig carries the MoE settings for the whole model (`num_moe_experts`,
`moe_layer_freq`); the block of one pipeline stage / virtual chunk is built from one spec per
layer: the MoE layer spec where `moe_layer_freq` says 1, the same layer spec built for a dense
MLP (`ffn_hidden_size`) where it says 0, sliced at megatron's own layer offset, so a pipeline
stage may hold only dense layers, only MoE layers, or both.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from models.families.registry import moe_family
from models.layers.spec import local_norm


def is_heterogeneous(hf_config: Any) -> bool:
    """True for families whose layers differ between dense and MoE (SigmoidRoutedMoe)."""
    fam = moe_family(hf_config)
    return fam is not None and fam.heterogeneous


def dense_config(config):
    """A shallow copy of a MoE TransformerConfig that a layer-spec builder reads as dense."""
    dense = copy.copy(config)
    dense.num_moe_experts = None
    return dense


def moe_pattern(config) -> list[int]:
    """moe_layer_freq as one 0/1 entry per global layer."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(x) for x in freq]


def routed_block_spec(config, make_layer_spec: Callable, vp_stage: int | None = None,
                      fused_norm: bool = False) -> TransformerBlockSubmodules:
    """The block of this pipeline stage (virtual chunk `vp_stage`): `make_layer_spec(config)`
    builds a layer spec (models.layers.spec.layer_spec on the local spec) for the MoE config and
    for its dense twin; the final norm is the local norm (sequence-parallel aware)."""
    moe = make_layer_spec(config)
    dense = make_layer_spec(dense_config(config))
    specs = [moe if flag else dense for flag in moe_pattern(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count],
                                      layer_norm=local_norm(fused_norm))
