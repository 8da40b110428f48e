"""The Megatron backend's replicas (engine.tinker.ranks: what a backend's ranks answer): rows
split over the data-parallel replicas, gradients summed over them, over the context-parallel
ranks of a replica (each computed its own tokens' part) and, for matrices computed from a
sequence shard, over TP; the adapter's norm counted once per TP shard and summed over the
pipeline stages (each holds its own layers' adapters), results gathered to rank 0 from the
last stage (the only one with results). Every method is collective over the whole world."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.tinker.ranks import RankFailed


class MegatronRanks:
    """megatron parallel_state's TP, PP, CP and DP groups."""

    def __init__(self):
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), \
            ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), \
            ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_group, self.cp_rank = ps.get_context_parallel_group(), \
            ps.get_context_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.sends = self.tp_rank == 0 and self.cp_rank == 0 and ps.is_pipeline_last_stage()
        self.root = dist.get_rank() == 0

    def split(self, lengths: list[int]) -> list[int]:
        """This replica's rows, in order: longest first, each to the replica with the fewest
        tokens so far (ties: the lowest replica); the same on every rank."""
        load = [0] * self.dp_size
        owner = {}
        for r in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
            k = min(range(self.dp_size), key=lambda k: (load[k], k))
            owner[r] = k
            load[k] += lengths[r]
        return [r for r in range(len(lengths)) if owner[r] == self.dp_rank]

    def agree(self, error: Exception | None) -> None:
        """Raise on every rank if any rank's rows failed (the root's own error if it failed)."""
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: "
                               f"{error}")
        if error is not None:
            raise error
        failed = [e for e in errors if e is not None]
        if failed:
            raise RankFailed(failed[0])

    def gather(self, per_row: dict) -> list | None:
        """Every replica's {row: result} as one list in row order, on the root (None on the
        other ranks); the TP and CP ranks of a replica's last stage hold the same results,
        the first of them sends them."""
        parts = [None] * dist.get_world_size() if self.root else None
        dist.gather_object(per_row if self.sends else {}, parts, dst=0)
        if not self.root:
            return None
        merged = {r: v for part in parts for r, v in part.items()}
        return [merged[r] for r in sorted(merged)]

    def reduce_grads(self, params: list[torch.Tensor]) -> None:
        _all_reduce([p.grad for p in params], self.dp_group)
        _all_reduce([p.grad for p in params], self.cp_group)
        _all_reduce([p.grad for p in params if getattr(p, "sequence_parallel", False)],
                    self.tp_group)

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        split = [p.grad for p in params if getattr(p, "tensor_model_parallel", False)]
        whole = [p.grad for p in params if not getattr(p, "tensor_model_parallel", False)]
        split_squares = _squares(split)
        dist.all_reduce(split_squares, group=self.tp_group)
        squares = split_squares + _squares(whole)
        dist.all_reduce(squares, group=self.pp_group)
        return squares.sqrt()


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum().cpu()


def _all_reduce(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` in place over `group`, as one flat buffer."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
