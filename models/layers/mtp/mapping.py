"""HF names of the trained MTP layer (models.layers.mtp), in the checkpoint's own layout
(models.families.mtp.mtp_tensor_names): DeepSeek-V3, Kimi-K2 and GLM-4.5 store it as decoder
layer N = num_hidden_layers, Qwen3.5 under `mtp.*`.

  megatron (mtp.layers.k.)    DeepSeek-V3 (model.layers.{N+k}.)  Qwen3.5 (mtp.)         kind
  enorm.weight                enorm.weight                       pre_fc_norm_embedding  replicated
  hnorm.weight                hnorm.weight                       pre_fc_norm_hidden     replicated
  eh_proj.weight [h, 2h]      eh_proj.weight                     fc.weight              column
  final_layernorm.weight      shared_head.norm.weight            norm.weight            replicated
  transformer_layer.<suffix>  <suffix> as decoder layer N's      layers.k.<suffix>      the layer's
  (megatron-core 0.19 names it mtp_model_layer.<suffix>)

DeepSeek-V3's layout also stores `embed_tokens.weight` and `shared_head.head.weight` under
model.layers.{N}.: copies of the model's embedding and output head, which the MTP layer shares
(megatron ties them; vLLM's MTP drafters load them into the target's tensors). Loading checks
they equal the main tensors (`shared_copies`); export writes the main tensors under both names.
Qwen3.5 stores no copies (vLLM's qwen3_5_mtp takes the target's embedding and lm_head).
"""
from __future__ import annotations

import re
from typing import Any, Callable

from models.families.mtp import mtp_tensor_names, trained_mtp_layers

MTP_PARAM = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# the decoder layer's attribute: transformer_layer (megatron-core 0.16), mtp_model_layer (0.19)
_LAYER_PREFIXES = ("transformer_layer.", "mtp_model_layer.")

# claim(suffix, layer) -> (kind, HF names) of a decoder-layer suffix at global layer `layer`
LayerClaim = Callable[[str, int], "tuple[str, tuple[str, ...]] | None"]


def mtp_mapping(name: str, hf_config: Any, claim: LayerClaim
                ) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of megatron parameter `name` of the MTP block (`mtp.layers.{k}.*`), or
    None when `name` is not one (or has no HF twin). The decoder layer's tensors are claimed as
    decoder layer N + k's (`claim`, names under model.layers.{N+k}.) and moved under the
    layout's `layer_prefix`."""
    match = MTP_PARAM.match(name)
    if match is None:
        return None
    k, suffix = int(match.group(1)), match.group(2)
    names = mtp_tensor_names(hf_config, k)
    if suffix in names.own():
        kind = "column" if suffix == "eh_proj.weight" else "replicated"
        return kind, (names.own()[suffix],)
    layer = int(hf_config["num_hidden_layers"]) + k
    for prefix in _LAYER_PREFIXES:
        if suffix.startswith(prefix):
            claimed = claim(suffix[len(prefix):], layer)
            if claimed is None:
                return None
            stored = f"model.layers.{layer}."
            return claimed[0], tuple(names.layer_prefix + n[len(stored):]
                                     if n.startswith(stored) else n for n in claimed[1])
    return None


def shared_copies(hf_config: Any) -> dict[str, str]:
    """{HF name of a trained MTP layer's copy: HF name of the main tensor it must equal}."""
    out = {}
    for k in range(trained_mtp_layers(hf_config)):
        out.update(mtp_tensor_names(hf_config, k).copies)
    return out
