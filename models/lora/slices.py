"""What a LoRA adapter is made of, before any megatron module: the spec of model.lora.* (`LoraSpec`),
one HF projection inside a Megatron linear with the map of its output rows (`Slice`), and the
layout-independent initialisation of its matrices (`init_full`). models.lora.adapters builds the
adapters from these."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how (engine.config.lora_settings builds it from model.lora.*)."""

    rank: int
    alpha: float
    targets: frozenset          # HF projection names (models.lora.sites.TARGET_NAMES)
    dropout: float = 0.0
    rslora: bool = False        # scaling alpha / sqrt(rank) instead of alpha / rank
    seed: int = 0               # adapter initialisation (layout-independent)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class Slice:
    """One HF projection inside a Megatron linear: its name and full (unsharded) sizes, and
    how its output rows map onto Megatron's (column-parallel linears only):

    - `order`: Megatron's full row i is HF row order[i] (None: the same order). The gated
      attention's q_proj: HF rows per head [query; gate], Megatron's per query group [the
      group's queries; its gates] (models.layers.gated_delta_net.mapping, qkv_gated);
    - `parts`: row blocks (in Megatron's order, summing to out_features) that TP splits one by
      one (empty: one block). GDN's in_proj_qkv [q; k; v]: rank r holds [q_r; k_r; v_r].

    Each block's B is its own parameter, a contiguous TP split of a layout-independent
    tensor, so the distributed checkpoint reshards it to any TP size."""

    name: str
    in_features: int
    out_features: int
    order: tuple | None = None
    parts: tuple = ()

    def blocks(self) -> list[int]:
        return list(self.parts) or [self.out_features]

    def to_blocks(self, b_full: torch.Tensor) -> list[torch.Tensor]:
        """HF B [out, r] -> its blocks in Megatron's row order (full sizes)."""
        rows = b_full if self.order is None else b_full[list(self.order)]
        return list(torch.split(rows, self.blocks(), dim=0))

    def from_blocks(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `to_blocks`: the full blocks -> HF B [out, r]."""
        rows = torch.cat(blocks, dim=0)
        if self.order is None:
            return rows
        out = torch.empty_like(rows)
        out[list(self.order)] = rows
        return out


def init_full(spec: LoraSpec, key: str, sl: Slice) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's default initialisation of one slice, identical at every layout: A uniform in
    +-1/sqrt(in) (kaiming_uniform with a=sqrt(5)), B zero. `key` names the slice globally (layer,
    expert, projection) and seeds its generator together with spec.seed."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + _stable_hash(key))
    bound = 1.0 / math.sqrt(sl.in_features)
    a = (torch.rand(spec.rank, sl.in_features, generator=gen) * 2 - 1) * bound
    return a, torch.zeros(sl.out_features, spec.rank)


def _stable_hash(text: str) -> int:
    value = 0
    for ch in text.encode():
        value = (value * 131 + ch) % 2_147_483_629
    return value
