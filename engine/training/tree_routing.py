"""MoE routing replay on a prefix tree (train.prefix_sharing with moe.routing_replay,
docs/prefix-sharing.md).

A tree node stands for several (row, position) tokens of the unshared rows. Their hidden states
are equal (each sees the same row prefix), so their routers' own choices are equal too, but the
routing REPLAYED for them comes from a recording that may differ per row: the rollout engine's
(R3: each row's prefill and decode ran on its own), or the old-log-prob forward's (R2) when the
rows ran in different micro-batches or unshared there (a near-tie of the k-th and (k+1)-th
scores can flip with the rounding of another layout). A node replays one routing, so:

- `trie_rows(seqs)`: the rows the trie merges. Without routed experts, the token ids (the
  trie of tokens). When the sequences carry ROUTED_EXPERTS (the extra replayed,
  engine.training.routing), one integer per distinct (token, recorded routing of every layer)
  pair: rows share a node only where their tokens AND their recorded routings agree up to
  and including it, so every node's replayed routing is the one each row it stands for
  recorded. Exact; rows whose routings agree share as much as by tokens alone.
- `tree_routing(...)`: what engine.training.routing needs to record and replay on the tree
  row instead of the unshared rows (`TreeRouting`, host tensors):
  `natural` the natural tree-row index of every token of this CP rank's shard;
  `members` (node, sequence index, position) of every real token of the unshared rows (all
  CP shards): recording writes a node's choice to each of them, one writer per entry (the
  CP rank whose shard holds the node);
  `routed` [1, T/cp, width] (int16) the replayed routing of every node (None without routed
  experts);
  `weight` [1, T/cp] float64: the real tokens each node stands for (0 on padding and on nodes
  of dummy rows only): the replay-mismatch counts weigh a node by it, so moe/replay_mismatch
  counts every row's token as without sharing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from engine.training.micro_batches import SequenceData
from engine.training.prefix_tree import PrefixTree
from engine.training.routing import ROUTED_EXPERTS
from parallel import zigzag


@dataclass
class TreeRouting:
    natural: torch.Tensor                                  # [1, T/cp] long
    members: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # node, seq index, position [M]
    routed: torch.Tensor | None                            # [1, T/cp, width] int16, or None
    weight: torch.Tensor                                   # [1, T/cp] float64


def _routing_rows(seqs: Sequence[SequenceData]) -> np.ndarray | None:
    """The sequences' routed experts, concatenated: [sum of lengths, width] int16 (expert
    indices < 32768; numpy: torch's copies of these small tables are slower on a loaded CPU),
    or None when none carries any; a sequence without them (none in the engine's batches) gets
    rows of -1 (never shared with a recorded one)."""
    tables = [s.extras.get(ROUTED_EXPERTS) for s in seqs]
    known = [t for t in tables if t is not None]
    if not known:
        return None
    width = torch.as_tensor(known[0]).reshape(len(known[0]), -1).shape[1]
    parts = [torch.as_tensor(t).reshape(len(s.tokens), width).numpy() if t is not None
             else np.full((len(s.tokens), width), -1, dtype=np.int16)
             for s, t in zip(seqs, tables)]
    return np.concatenate(parts).astype("<i2", copy=False) if parts else None


def trie_rows(seqs: Sequence[SequenceData]) -> list[list[int]]:
    """The rows prefix_tree merges for `seqs` (module docstring): token ids, or ids of
    (token, recorded routing) pairs when the sequences carry routed experts. Equal pairs get
    equal ids within one call, so a trie over these rows counts the same nodes as one over any
    subset of them in another call."""
    routing = _routing_rows(seqs)
    if routing is None:
        return [list(s.tokens) for s in seqs]
    if not sum(len(s.tokens) for s in seqs):
        return [[] for _ in seqs]
    # one byte string per token: its id (int64) then its routing (int16: experts < 32768, -1
    # where none), numbered in order of first appearance (torch.unique(dim=0): ~70x slower)
    tokens = np.concatenate([np.asarray(s.tokens, dtype="<i8") for s in seqs])
    keys = np.concatenate([tokens.view(np.uint8).reshape(len(tokens), 8),
                           routing.view(np.uint8).reshape(len(tokens), -1)], axis=1)
    keys = np.ascontiguousarray(keys).view(f"V{keys.shape[1]}").ravel()
    number: dict[bytes, int] = {}
    ids = [number.setdefault(key, len(number)) for key in keys.tolist()]
    out, start = [], 0
    for s in seqs:
        out.append(ids[start:start + len(s.tokens)])
        start += len(s.tokens)
    return out


def node_tokens(tree: PrefixTree, seqs: Sequence[SequenceData]) -> list[int]:
    """The token id of every node of a trie built over `trie_rows(seqs)`."""
    tokens = [0] * tree.num_tokens
    for path, s in zip(tree.gather, seqs):
        for node, tok in zip(path, s.tokens):
            tokens[node] = int(tok)
    return tokens


def tree_routing(seqs: Sequence[SequenceData], seq_index: Sequence[int], tree: PrefixTree,
                 total: int, cp: int, cp_rank: int) -> TreeRouting:
    """The tree row's routing inputs (module docstring) for a tree row of `total` tokens
    (padding included) over `seqs` (`seq_index`: their indices in the run, -1 for dummies)."""
    nodes, seq_ids, positions = [], [], []
    for path, index in zip(tree.gather, seq_index):
        if index < 0 or not path:
            continue
        nodes.append(torch.tensor(path, dtype=torch.long))
        seq_ids.append(torch.full((len(path),), index, dtype=torch.long))
        positions.append(torch.arange(len(path), dtype=torch.long))
    cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
    members = (cat(nodes), cat(seq_ids), cat(positions))
    weight = torch.bincount(members[0], minlength=total).to(torch.float64)
    routing = _routing_rows(seqs)
    routed = None
    if routing is not None:
        flat = torch.from_numpy(routing)
        routed = torch.zeros(total, flat.shape[1], dtype=torch.int16)
        routed[torch.tensor([n for path in tree.gather for n in path], dtype=torch.long)] = flat
        routed = zigzag.shard(routed[None], [total], cp, cp_rank)
    natural = zigzag.shard(torch.arange(total)[None], [total], cp, cp_rank)
    return TreeRouting(natural, members, routed, zigzag.shard(weight[None], [total], cp, cp_rank))
