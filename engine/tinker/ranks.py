"""The replicas of the Tinker service's model: how a batch's rows are spread over them and how
their gradients, norms and results come together (engine.tinker.compute).

`OneProcess`: the transformers backend, everything local. `MegatronRanks`
(engine.tinker.mcore_ranks): the Megatron backend (engine.tinker.mcore) at a TP x DP layout. Rows are split over the data-parallel
replicas (each replica's TP ranks run the same rows); a replica's gradients are summed over
the data-parallel group (`reduce_grads`, the losses being sums, the whole batch's gradient),
and an adapter matrix megatron computes from a sequence shard (sequence parallelism: tagged
`sequence_parallel`) over the TP group too; `grad_norm` counts a TP-split matrix
(`tensor_model_parallel`) once per shard and a replicated one once. Every method is
collective over the whole world (every rank calls it with its own rows)."""
from __future__ import annotations

import torch


class RankFailed(RuntimeError):
    """Another rank's rows failed (its message), so this rank's were not applied either."""


class OneProcess:
    """One process holds the model: nothing to split or reduce."""

    root = True

    def split(self, lengths: list[int]) -> list[int]:
        return list(range(len(lengths)))

    def agree(self, error: Exception | None) -> None:
        if error is not None:
            raise error

    def gather(self, per_row: dict) -> list:
        return [per_row[r] for r in sorted(per_row)]

    def reduce_grads(self, params: list[torch.Tensor]) -> None:
        pass

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                     for p in params]))
