"""HF names of the trained MTP layer (models.layers.mtp), as DeepSeek-V3, Kimi-K2 and GLM-4.5
checkpoints store it: layer index N = num_hidden_layers.

  megatron (under mtp.layers.0.)     HF (under model.layers.{N}.)          kind
  enorm.weight                       enorm.weight                          replicated
  hnorm.weight                       hnorm.weight                          replicated
  eh_proj.weight                     eh_proj.weight [h, 2h]                column (rows over TP)
  final_layernorm.weight             shared_head.norm.weight               replicated
  transformer_layer.<suffix>         as decoder layer N's <suffix>         the layer's own
  (megatron-core 0.19 names it mtp_model_layer.<suffix>)

The checkpoint also stores `embed_tokens.weight` and `shared_head.head.weight` under
model.layers.{N}.: copies of the model's embedding and output head, which the MTP layer shares
(megatron ties them; vLLM's MTP drafters load them into the target's tensors). Loading checks
they equal the main tensors (`shared_copies`); export writes the main tensors under both names.
"""
from __future__ import annotations

import re
from typing import Callable

MTP_PARAM = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_OWN = {"enorm.weight": ("replicated", "enorm.weight"),
        "hnorm.weight": ("replicated", "hnorm.weight"),
        "eh_proj.weight": ("column", "eh_proj.weight"),
        "final_layernorm.weight": ("replicated", "shared_head.norm.weight")}
# the decoder layer's attribute: transformer_layer (megatron-core 0.16), mtp_model_layer (0.19)
_LAYER_PREFIXES = ("transformer_layer.", "mtp_model_layer.")

# claim(suffix, layer) -> (kind, HF names) of a decoder-layer suffix at global layer `layer`
LayerClaim = Callable[[str, int], "tuple[str, tuple[str, ...]] | None"]


def mtp_mapping(name: str, num_layers: int, claim: LayerClaim
                ) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of megatron parameter `name` of the MTP block (`mtp.layers.{k}.*`), or
    None when `name` is not one (or has no HF twin). `num_layers`: the trunk's layers."""
    match = MTP_PARAM.match(name)
    if match is None:
        return None
    layer, suffix = num_layers + int(match.group(1)), match.group(2)
    if suffix in _OWN:
        kind, hf = _OWN[suffix]
        return kind, (f"model.layers.{layer}.{hf}",)
    for prefix in _LAYER_PREFIXES:
        if suffix.startswith(prefix):
            return claim(suffix[len(prefix):], layer)
    return None


def shared_copies(num_layers: int, mtp_layers: int, tied: bool) -> dict[str, str]:
    """{HF name of an MTP layer's copy: HF name of the main tensor it must equal}."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    out = {}
    for k in range(mtp_layers):
        prefix = f"model.layers.{num_layers + k}."
        out[prefix + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[prefix + "shared_head.head.weight"] = head
    return out
