"""What a LoRA adapter is made of, before any megatron module: the spec of model.lora.* (`LoraSpec`),
one HF projection inside a Megatron linear with the map of its output rows (`Slice`), and the
layout-independent initialisation of its matrices (`init_full`). models.lora.adapters builds the
adapters from these."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from models.lora.targets import pattern_key


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how (engine.config.lora_settings builds it from model.lora.*).
    `rank_pattern` / `alpha_pattern`: peft's {module pattern: rank / alpha} in order, matched
    against an adapter's peft key (`model.layers.3.self_attn.q_proj`,
    `model.layers.1.mlp.experts.gate_up_proj`, `model.layers.1.mlp.gate.weight`) as peft does
    (models.lora.targets.pattern_key); a key no pattern matches takes rank / alpha."""

    rank: int
    alpha: float
    targets: frozenset          # resolved targets (models.lora.targets)
    dropout: float = 0.0
    rslora: bool = False        # scaling alpha / sqrt(rank) instead of alpha / rank
    seed: int = 0               # adapter initialisation (layout-independent)
    rank_pattern: dict = field(default_factory=dict, hash=False)
    alpha_pattern: dict = field(default_factory=dict, hash=False)

    @property
    def scaling(self) -> float:
        return self.scaling_of(None)

    def rank_of(self, key: str | None) -> int:
        """The rank of the adapter with peft key `key` (None: `rank`)."""
        if key is None or not self.rank_pattern:
            return self.rank
        return int(self.rank_pattern.get(pattern_key(self.rank_pattern, key), self.rank))

    def alpha_of(self, key: str | None) -> float:
        """The alpha of the adapter with peft key `key` (None: `alpha`)."""
        if key is None or not self.alpha_pattern:
            return self.alpha
        return float(self.alpha_pattern.get(pattern_key(self.alpha_pattern, key), self.alpha))

    def scaling_of(self, key: str | None) -> float:
        """alpha / r (rsLoRA: alpha / sqrt(r)) of the adapter with peft key `key`, as peft
        computes it from the matched rank and alpha."""
        rank = self.rank_of(key)
        return self.alpha_of(key) / (math.sqrt(rank) if self.rslora else rank)


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


def init_full(spec: LoraSpec, key: str, sl: Slice,
              rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's default initialisation of one slice of rank `rank` (None: spec.rank), identical
    at every layout: A uniform in +-1/sqrt(in) (kaiming_uniform with a=sqrt(5)), B zero. `key`
    names the slice globally (layer, expert, projection) and seeds its generator together with
    spec.seed."""
    rank = spec.rank if rank is None else rank
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + _stable_hash(key))
    bound = 1.0 / math.sqrt(sl.in_features)
    a = (torch.rand(rank, sl.in_features, generator=gen) * 2 - 1) * bound
    return a, torch.zeros(sl.out_features, rank)


def _stable_hash(text: str) -> int:
    value = 0
    for ch in text.encode():
        value = (value * 131 + ch) % 2_147_483_629
    return value
