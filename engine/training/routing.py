"""Routing replay of one TrainEngine's MoE routers: routing travels with the sequence.

A sequence's routing is the extra ROUTED_EXPERTS: one row per token, the top-k expert indices
of every MoE layer, [len(tokens), num_layers * k] (layer-major: columns l*k .. l*k+k-1 are layer
l+1's choice), an integer tensor. Like the log-probs it is cut into micro-batches, packed, and
sharded along the sequence under CP zigzag exactly as the tokens (engine.training.
micro_batches); `begin` then takes, before each chunk's forward, this rank's rows in the
router's token order: the micro-batch transposed to [s, b] (megatron's sequence-major
flattening) and, with Megatron sequence parallelism, the TP rank's slice of s.

`RoutingReplay` (models.layers.experts.replay.ReplaySlot on every router):
- mode "record" (forward-only passes): every router's own choice is written into a table
  [sequences, width, num_layers * k] at (mb.seq_ids, mb.position_ids) - the same placement that
  undoes DP partition, packing and CP sharding for the log-probs; one writer per entry (TP rank
  0, or each TP rank for its own slice with sequence parallelism; each pipeline stage its own
  layers), then summed over the world: `recorded()`.
- mode "replay": every forward uses the micro-batch's ROUTED_EXPERTS on real tokens (padding
  and dummy sequences keep the router's own choice).
- a prefix tree row (train.prefix_sharing, engine.training.tree_routing): the router runs the
  tree's nodes; recording writes a node's choice to every (sequence, position) it stands for
  (the CP rank whose shard holds the node writes them), replay takes the node's routing (the
  trie is keyed by (token, routing), so every row it stands for recorded it) and counts its
  mismatch once per row token it stands for.
- `mismatch()`: the fraction of (token, MoE layer) pairs of the run whose recomputed top-k set
  differs from the replayed one, real tokens only, summed over the world (TP duplicates
  counted once): a global count, the same at every layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.training.micro_batches import MicroBatch
from models.layers.experts.replay import MODES, attach_slots
from parallel.wrappers import unwrap

ROUTED_EXPERTS = "routed_experts"


class RoutingReplay:
    """Record/replay controller of one engine's chunks (collective methods say so)."""

    def __init__(self, chunks: list):
        config = unwrap(chunks[0]).config
        if not config.num_moe_experts:
            raise ValueError("routing replay needs a MoE model (this one has no experts)")
        self.num_layers, self.topk = int(config.num_layers), int(config.moe_router_topk)
        self.num_experts = int(config.num_moe_experts)
        self.sequence_parallel = bool(config.sequence_parallel)
        self._slots = attach_slots(chunks)
        self._chunk_of = {id(c): i for i, c in enumerate(chunks)}
        writer = self.sequence_parallel or ps.get_tensor_model_parallel_rank() == 0
        for slot in self.slots:
            slot.sink = self._record
            slot.counting = writer
        self.writer = writer
        self.mode: str | None = None
        self.table: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tree_rows: tuple | None = None   # recording a prefix tree row (_begin_tree)

    @property
    def slots(self):
        return [s for slots in self._slots.values() for s in slots]

    @property
    def width(self) -> int:
        """Columns of ROUTED_EXPERTS: num_layers x k."""
        return self.num_layers * self.topk

    def set_mode(self, mode: str | None) -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r}; choose one of {MODES}")
        self.mode = mode
        for slot in self.slots:
            slot.mode = mode

    def start(self, num_seqs: int, max_len: int) -> None:
        """Before a run of micro-batches over `num_seqs` sequences of at most `max_len`
        tokens: clear the slots (targets, recompute queues, counts); allocate the table when
        recording."""
        for slot in self.slots:
            slot.reset()
        self.table = (torch.zeros(num_seqs, max_len, self.width, dtype=torch.int32)
                      if self.mode == "record" else None)

    def _token_order(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] micro-batch tensor -> [tokens, ...] in the router's order."""
        x = x.transpose(0, 1)
        if self.sequence_parallel:
            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            part = x.shape[0] // tp
            x = x[rank * part:(rank + 1) * part]
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def begin(self, model, mb: MicroBatch) -> None:
        """Before `model`'s forward of `mb` (engine.training.schedule's before_forward)."""
        if self.mode is None:
            return
        if mb.tree is not None:
            self._begin_tree(model, mb.tree)
            return
        seq_ids = self._token_order(mb.seq_ids.cpu())
        if self.mode == "record":
            self._rows = (seq_ids, self._token_order(mb.position_ids.cpu()))
            return
        if ROUTED_EXPERTS not in mb.extras:
            raise RuntimeError("routing replay: the micro-batch carries no routed experts "
                               f"(extra {ROUTED_EXPERTS!r})")
        routed = self._token_order(mb.extras[ROUTED_EXPERTS]).long()
        valid = seq_ids >= 0
        for slot in self._slots[self._chunk_of[id(model)]]:
            layer = slot.layer_number - 1
            slot.set_target(routed[:, layer * self.topk:(layer + 1) * self.topk], valid)

    def _begin_tree(self, model, tree) -> None:
        """`begin` for a prefix tree row (engine.training.tree_routing.TreeRouting): the
        router runs the tree's nodes; recording writes each node's choice to every row token
        it stands for, replay takes each node's routing (every row it stands for recorded
        it: the trie is keyed by it) and weighs its mismatch by those tokens."""
        routing = tree.routing
        if self.mode == "record":
            order = self._token_order(routing.natural)
            where = torch.full((tree.row_length,), -1, dtype=torch.long)
            where[order] = torch.arange(order.numel())
            self._rows = None
            self._tree_rows = (routing.members, where)
            return
        if routing.routed is None:
            raise RuntimeError("routing replay: the micro-batch carries no routed experts "
                               f"(extra {ROUTED_EXPERTS!r})")
        routed = self._token_order(routing.routed).long()
        weight = self._token_order(routing.weight)
        for slot in self._slots[self._chunk_of[id(model)]]:
            layer = slot.layer_number - 1
            slot.set_target(routed[:, layer * self.topk:(layer + 1) * self.topk], weight > 0,
                            weight)

    def _record(self, layer_number: int, indices: torch.Tensor) -> None:
        if not self.writer or self.table is None:
            return
        cols = slice((layer_number - 1) * self.topk, layer_number * self.topk)
        if self._rows is None:   # a prefix tree row (_begin_tree)
            (nodes, seq_ids, positions), where = self._tree_rows
            token = where[nodes]
            mine = token >= 0
            self.table[seq_ids[mine], positions[mine], cols] = \
                indices.cpu()[token[mine]].to(torch.int32)
            return
        seq_ids, positions = self._rows
        valid = seq_ids >= 0
        self.table[seq_ids[valid], positions[valid], cols] = indices.cpu()[valid].to(torch.int32)

    def recorded(self) -> torch.Tensor:
        """The recorded routing [sequences, max_len, num_layers * k] (int32), identical on
        every rank. Collective over the world."""
        table = self.table
        if dist.get_world_size() > 1:
            dist.all_reduce(table)
        self.table = None
        return table

    def mismatch(self) -> float:
        """Fraction of replayed (token, layer) pairs whose own top-k differed, since `start`.
        Collective over the world."""
        counts = sum((s.counts for s in self.slots), torch.zeros(2, dtype=torch.float64))
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def compact(table: torch.Tensor, num_experts: int) -> torch.Tensor:
    """An integer routing table in the smallest dtype that holds expert indices."""
    return table.to(torch.uint8 if num_experts <= 256 else torch.int16)
