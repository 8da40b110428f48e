"""megatron's MTP block spec for a model family: one `EngineMTPLayer` whose transformer layer
is the family's own layer spec for layer index N = num_hidden_layers (where checkpoints store
the MTP layer: a MoE layer in GLM-4.5 / DeepSeek-V3), with the local norms; for the hybrid
(Qwen3.5) families the full-attention layer spec with every norm zero-centred and zero-centred
enorm / hnorm / final norms (y = norm(x) * (1 + w), as vLLM's qwen3_5_mtp computes them)."""
from __future__ import annotations

from typing import Any, Callable

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                              MultiTokenPredictionLayerSubmodules)
from megatron.core.transformer.spec_utils import ModuleSpec

from models.families.base import field
from models.families.registry import moe_family
from models.layers.gated_delta_net.spec import is_hybrid, zero_centered_spec
from models.layers.mtp.layer import EngineMTPLayer
from models.layers.norms.zero_centered import ZeroCenteredRMSNorm
from models.layers.sigmoid_routing.spec import dense_config
from models.layers.spec import local_norm


def mtp_layer_config(config, hf_config: Any):
    """The TransformerConfig the MTP layer's spec is built from: dense when the family's layer
    N = num_hidden_layers is dense (first_k_dense_replace beyond it), the MoE config otherwise."""
    fam = moe_family(hf_config)
    layer = int(field(hf_config, "num_hidden_layers"))
    if fam is not None and getattr(fam, "heterogeneous", False) and \
            not fam.is_moe_layer(hf_config, layer):
        return dense_config(config)
    return config


def mtp_block_spec(config, hf_config: Any, make_layer_spec: Callable,
                   fused_norm: bool = False) -> MultiTokenPredictionBlockSubmodules:
    """One MTP layer (config.mtp_num_layers == 1) on the local spec."""
    norm = local_norm(fused_norm)
    layer_spec = make_layer_spec(mtp_layer_config(config, hf_config))
    if is_hybrid(hf_config):   # Qwen3.5: a full-attention layer, zero-centred norms
        norm, layer_spec = ZeroCenteredRMSNorm, zero_centered_spec(layer_spec)
    inner = {LAYER_FIELD: layer_spec}
    layer = ModuleSpec(module=EngineMTPLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, layer_norm=norm, **inner))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer])


# the MTP layer's decoder layer: `transformer_layer` (megatron-core 0.16),
# `mtp_model_layer` (0.19); also its attribute, so parameter names follow
LAYER_FIELD = ("transformer_layer" if "transformer_layer" in
               MultiTokenPredictionLayerSubmodules.__dataclass_fields__ else "mtp_model_layer")
