"""The table of layer kinds whose weights the bridge maps beyond the generic dense map.

Each row is one layer kind's mapping (its code lives in the kind's package under models.layers):
`claim(suffix, layer, config, naming)` gives (mapping kind, HF names) for a megatron per-layer
parameter suffix it owns, else None (`layer`: global 0-based index; `config`: the chunk's
TransformerConfig, whose features mark the kind; `naming`: the family's ExpertNaming or None);
`kinds` are the mapping kinds it shards and gathers itself, with
`shard(kind, hf tensors, hf_config, tp, rank)` -> this TP rank's tensor and
`export(kind, local tensor, HF names, hf_config, config, gather)` -> [(HF name, full tensor)],
where `gather(tensor, dim)` all-gathers over the tensor-parallel group (rank order). A row
without kinds claims names only and maps them with the generic kinds.

Adding a layer kind with its own weights: its package under models.layers and one row here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.layers.experts.mapping import (EXPERT_KINDS, expert_local_shard, expert_mapping,
                                           export_expert)
from models.layers.gated_delta_net.mapping import (HYBRID_KINDS, hybrid_export,
                                                   hybrid_local_shard, hybrid_mapping)
from models.layers.mla.mapping import MLA_KINDS, mla_export, mla_local_shard, mla_mapping
from models.layers.sigmoid_routing.mapping import routed_mapping

Claim = tuple[str, tuple[str, ...]]
Gather = Callable[[torch.Tensor, int], list[torch.Tensor]]


@dataclass(frozen=True)
class KindMapping:
    """One layer kind's row (module docstring)."""

    name: str
    claim: Callable[[str, int, Any, Any], Claim | None]
    kinds: tuple[str, ...] = ()
    shard: Callable[[str, list[torch.Tensor], dict, int, int], torch.Tensor] | None = None
    export: Callable[..., list[tuple[str, torch.Tensor]]] | None = None


def _gdn_export(kind, data, names, hf_config, config, gather: Gather):
    return list(zip(names, hybrid_export(kind, gather(data, 0), hf_config)))


def _mla_export(kind, data, names, hf_config, config, gather: Gather):
    return list(zip(names, mla_export(kind, data, hf_config, gather)))


def _experts_claim(suffix, layer, config, naming):
    return expert_mapping(suffix, layer, config.num_moe_experts or 0, naming)


def _experts_shard(kind, hf, hf_config, tp, rank):
    return expert_local_shard(kind, hf)   # expert TP and EP come from megatron's groups


def _experts_export(kind, data, names, hf_config, config, gather: Gather):
    return export_expert(kind, data, names, config.num_moe_experts)


# Tried in order; the first claim wins, and what none claims goes to the generic dense map.
LAYER_KINDS: tuple[KindMapping, ...] = (
    KindMapping("gated_delta_net", lambda s, i, c, n: hybrid_mapping(s, i, c), HYBRID_KINDS,
                hybrid_local_shard, _gdn_export),
    KindMapping("sigmoid_routing", lambda s, i, c, n: routed_mapping(s, i, c)),
    KindMapping("mla", lambda s, i, c, n: mla_mapping(s, i, c), MLA_KINDS, mla_local_shard,
                _mla_export),
    KindMapping("experts", _experts_claim, EXPERT_KINDS, _experts_shard, _experts_export),
)
OWNER: dict[str, KindMapping] = {kind: row for row in LAYER_KINDS for kind in row.kinds}


def claim(suffix: str, layer: int, config, naming) -> Claim | None:
    """The first row's (kind, HF names) for a megatron per-layer suffix, or None."""
    for row in LAYER_KINDS:
        claimed = row.claim(suffix, layer, config, naming)
        if claimed is not None:
            return claimed
    return None
