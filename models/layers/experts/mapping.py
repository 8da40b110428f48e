"""HF <-> Megatron mapping of MoE expert weights (megatron's SequentialMLP local experts).

Megatron names an expert weight `decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{1,2}
.weight`: local expert j of expert-parallel (EP) rank r is global expert r * L + j, with
L = num_experts / ep experts per EP rank. Each expert is an MLP tensor-parallel over the
expert-tensor-parallel group (here always the TP size): linear_fc1 fuses gate and up per
expert-TP rank (as the dense MLP, models.layers.transforms.merge_gate_up), linear_fc2 is split
along its input dimension. The router `mlp.router.weight` is replicated. HF names come from
the family's ExpertNaming (models.families.moe), under `model.layers.{i}.`: Qwen3-MoE
`mlp.experts.{e}.{gate,up,down}_proj.weight` and `mlp.gate.weight`, Mixtral
`block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` and `block_sparse_moe.gate.weight`.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.layers import transforms as wm
from models.families.moe import ExpertNaming

_EXPERT = re.compile(
    r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)$")
_ROUTER = "mlp.router.weight"
_ROUTER_BIAS = "mlp.router.bias"  # gpt-oss (models.layers.biased_experts.spec.BiasedRouter)
# expert_bias: an expert's down-projection bias (gpt-oss), whole on every expert-TP rank
EXPERT_KINDS = ("expert_fc1", "expert_row", "expert_bias")


def _ep() -> tuple[int, int]:
    return ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()


def _etp() -> tuple[int, int]:
    return (ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank())


def expert_mapping(suffix: str, layer: int, num_experts: int, naming: ExpertNaming | None
                   ) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a megatron per-layer suffix that is the router ("replicated") or a
    local expert weight of this EP rank (`layer` is the global 0-based layer index), else
    None (also for every suffix of a dense model, `naming` None)."""
    if naming is None:
        return None
    head = f"model.layers.{layer}."
    if suffix == _ROUTER:
        return "replicated", (head + naming.router,)
    if suffix == _ROUTER_BIAS:
        return "replicated", (head + naming.router_bias,)
    match = _EXPERT.match(suffix)
    if not match:
        return None
    ep, rank = _ep()
    expert = rank * (num_experts // ep) + int(match.group(1))
    if match.group(3) == "bias":  # gpt-oss: fc1 bias [gate; up] per expert-TP rank
        if match.group(2) == "linear_fc1":
            return "expert_fc1", (head + naming.expert_bias(expert, "gate"),
                                  head + naming.expert_bias(expert, "up"))
        return "expert_bias", (head + naming.expert_bias(expert, "down"),)
    if match.group(2) == "linear_fc1":
        return "expert_fc1", (head + naming.expert(expert, "gate"),
                              head + naming.expert(expert, "up"))
    return "expert_row", (head + naming.expert(expert, "down"),)


def expert_local_shard(kind: str, hf: list[torch.Tensor]) -> torch.Tensor:
    """This expert-TP rank's shard of one expert's HF weights (`hf`: [gate, up] or [down])."""
    etp, rank = _etp()
    if kind == "expert_fc1":
        return wm.merge_gate_up(hf[0], hf[1], etp)[rank]
    if kind == "expert_row":
        return hf[0].chunk(etp, dim=1)[rank]
    if kind == "expert_bias":
        return hf[0]
    raise ValueError(f"unknown expert mapping kind {kind}")


def _all_gather(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def export_expert(kind: str, data: torch.Tensor, hf_names: tuple[str, ...], num_experts: int
                  ) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors of local expert `hf_names` on every EP rank: all-gather over the
    expert-TP group (shards of one expert), then over the EP group (the same local index on
    each EP rank, i.e. experts j, L + j, 2L + j, ...). Collective over both groups: every rank
    of the EP x expert-TP group calls it for the same parameter in the same order."""
    etp, _ = _etp()
    if kind == "expert_bias":  # whole on every expert-TP rank: nothing to gather
        etp = 1
    shards = _all_gather(data, etp, ps.get_expert_tensor_parallel_group(check_initialized=False))
    if kind == "expert_fc1":
        full = list(wm.split_gate_up(shards))
    elif kind == "expert_row":
        full = [torch.cat(shards, dim=1)]
    elif kind == "expert_bias":
        full = shards
    else:
        raise ValueError(kind)
    ep, rank = _ep()
    local = num_experts // ep
    out = []
    for name, tensor in zip(hf_names, full):
        per_rank = _all_gather(tensor, ep, ps.get_expert_model_parallel_group())
        for r, t in enumerate(per_rank):
            out.append((_renumber(name, (r - rank) * local), t.contiguous()))
    return out


def _renumber(hf_name: str, shift: int) -> str:
    """`model.layers.{i}.<block>.experts.{e}.x` -> the same with expert e + shift."""
    head, expert, tail = re.match(r"^(.*\.experts\.)(\d+)(\..*)$", hf_name).groups()
    return f"{head}{int(expert) + shift}{tail}"
