"""A micro-batch run as a prefix tree (train.prefix_sharing): the model's input and the one
gather that brings its outputs back to the unshared rows (docs/prefix-sharing.md).

`build_tree_micro_batch` returns an ordinary packed MicroBatch of the unshared rows (labels,
token weights, loss mask, seq_ids, position_ids, extras: everything a loss function, an output
function or a metric reads, built by micro_batches.build_packed exactly as without sharing)
plus `mb.tree`, a `TreeInput`: what the model runs instead (the tree's tokens, each token's
depth as its position, parallel.tree_attention.TreeAttentionParams) and `gather`, the tree
node of each token of the unshared layout. The schedule runs the model on the tree and hands
the loss function `unshared_output(output, mb.tree)`: the last stage's output (logits or
values [1, T/cp, ...]) gathered into the unshared layout [1, T_u/cp, ...], or with the
chunked loss head a `TreeHiddenStates`, whose log-probs run the output layer once per
distinct (tree node, next token) pair and are then gathered. From there the
loss, the GlobalLossNormalizer's counts, the metrics, KL and rollout-correction terms are
computed as without sharing; a node several rows contain receives each row's gradient, summed
by autograd through the gather.

MoE routing replay: rows carrying routed experts are merged by (token, recorded routing)
(engine.training.tree_routing.trie_rows), and `tree.routing` holds what engine.training.routing
records and replays on the tree row.

Context parallelism: the tree row is zigzag-sharded as one sequence (parallel.zigzag) and the
Ulysses attention sees the whole tree on every rank; before the gather each rank all-gathers
the output over the CP group (its backward sums the gradients over the group and keeps this
rank's shard), and gathers the tokens of its own zigzag shard of the unshared rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.training.loss_head import HiddenStates, chunked_logprobs
from engine.training.micro_batches import MicroBatch, SequenceData, build_packed
from engine.training.prefix_tree import build_prefix_tree, tree_tokens, worth_sharing
from engine.training.tree_routing import TreeRouting, node_tokens, trie_rows, tree_routing
from parallel import zigzag
from parallel.tree_attention import TreeAttentionParams, tree_params


@dataclass
class TreeInput:
    tokens: torch.Tensor            # [1, T/cp] the tree row's tokens (this CP rank's shard)
    position_ids: torch.Tensor      # [1, T/cp] their depths (position in their own rows)
    params: TreeAttentionParams
    gather: torch.Tensor            # [T_u/cp] long: tree row index (natural order) per token
    padding: torch.Tensor           # [1, T/cp] bool, True on the row's padding tail
    num_tokens: int                 # tree nodes (real tokens run through the model)
    row_length: int                 # T, padding included
    cp: int = 1
    routing: TreeRouting | None = None   # MoE routing replay on the tree (tree_routing; host)

    def to(self, device) -> "TreeInput":
        for name in ("tokens", "position_ids", "gather", "padding"):
            setattr(self, name, getattr(self, name).to(device))
        self.params.to_device(device)
        return self


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tree_row_length(tree_tokens: int, pad_multiple: int) -> int:
    """Length of a tree row of `tree_tokens` nodes: rounded up to `pad_multiple` (>= 1 token)."""
    return _round_up(max(tree_tokens, 1), pad_multiple)


def build_tree_micro_batch(seqs: list[SequenceData], seq_index: list[int], pad_multiple: int,
                           length: int | None, cp: int, cp_rank: int,
                           pad_id: int = 0) -> MicroBatch:
    """The unshared packed micro-batch of `seqs` with its tree (module docstring). The tree row
    is padded to a multiple of `pad_multiple` (the unshared rows' padding multiple) and to
    `length` when given (pipeline parallelism: one p2p shape; a multiple of pad_multiple).
    Without `length`, rows that share too little (prefix_tree.worth_sharing) run unshared:
    the plain packed micro-batch, no tree."""
    rows = trie_rows(seqs)   # token ids, or (token, routing) ids with routed experts
    if length is None and not worth_sharing(tree_tokens(rows), sum(len(r) for r in rows)):
        return build_packed(seqs, seq_index, pad_multiple, None, cp, cp_rank, pad_id)
    tree = build_prefix_tree(rows)
    tree.tokens = node_tokens(tree, seqs)
    mb = build_packed(seqs, seq_index, pad_multiple, None, cp, cp_rank, pad_id)
    real = tree.num_tokens
    total = max(tree_row_length(real, pad_multiple), length or 0)
    pad = total - real
    tokens = torch.tensor(tree.tokens + [pad_id] * pad, dtype=torch.long)
    depth = torch.tensor(tree.depth + list(range(pad)), dtype=torch.long)
    subtree_end = tree.subtree_end + [total] * pad
    padding = torch.zeros(total, dtype=torch.bool)
    padding[real:] = True
    # the unshared row's tokens -> tree nodes (its padding points at node 0: weight 0 there)
    seq_lengths = [_round_up(len(s.tokens), pad_multiple) for s in seqs]
    gather = torch.zeros(sum(seq_lengths), dtype=torch.long)
    start = 0
    for row, n in zip(tree.gather, seq_lengths):
        gather[start:start + len(row)] = torch.tensor(row, dtype=torch.long)
        start += n
    if cp > 1:
        bounds = [0, total]
        gather = zigzag.shard(gather[None], seq_lengths, cp, cp_rank)[0]
    else:
        bounds = tree.segments + ([total] if pad else [])
    local = [zigzag.shard(x[None], [total], cp, cp_rank) for x in (tokens, depth, padding)]
    longest = max(max(b - a for a, b in zip(bounds[:-1], bounds[1:])), max(depth.tolist()) + 1)
    params = tree_params(bounds, subtree_end, tree.runs, local[1][0], longest)
    mb.tree = TreeInput(local[0], local[1], params, gather, local[2], real, total, cp,
                        tree_routing(seqs, seq_index, tree, total, cp, cp_rank))
    return mb


class _GatherCP(torch.autograd.Function):
    """All-gather of [1, T/cp, ...] shards over the CP group in rank order; the backward sums
    the gradient over the group (an all-reduce: gloo has no reduce-scatter) and keeps this
    rank's shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.width = x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[:, rank * ctx.width:(rank + 1) * ctx.width], None


def _whole_row(x: torch.Tensor, tree: TreeInput) -> torch.Tensor:
    """[1, T/cp, ...] on this CP rank -> [1, T, ...], the whole tree row in natural order."""
    if tree.cp == 1:
        return x
    full = _GatherCP.apply(x, ps.get_context_parallel_group())
    return full.index_select(1, zigzag.gathered_to_natural([tree.row_length],
                                                           tree.cp).to(full.device))


class TreeHiddenStates(HiddenStates):
    """A HiddenStates of the unshared rows backed by the tree row's hidden states: `hidden`
    is the gather ([1, T_u/cp, h], made on first use: value heads read it), while `logprobs`
    runs the chunked loss head once per distinct (tree node, label) pair -- a node that
    several rows continue with the same next token is projected once -- and gathers the
    results: the same per-token numbers as the head on the gathered hidden states (the head
    treats tokens independently), at the cost of the tree's tokens instead of the rows'."""

    def __init__(self, tree_hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int,
                 gather: torch.Tensor):
        self.tree_hidden, self.gather = tree_hidden, gather   # [1, T, h], [T_u/cp] long
        self.weight, self.chunk_tokens = weight, chunk_tokens
        self._hidden = None

    @property
    def hidden(self) -> torch.Tensor:
        if self._hidden is None:
            self._hidden = self.tree_hidden.index_select(1, self.gather)
        return self._hidden

    def logprobs(self, labels: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                 with_entropy: bool = False):
        """HiddenStates.logprobs of the unshared rows (labels [1, T_u/cp])."""
        flat = labels.reshape(-1).to(torch.long)
        # the padded vocabulary bounds every label: a pair's key node * span + label is unique
        span = int(self.weight.shape[0]) * ps.get_tensor_model_parallel_world_size()
        pairs, inverse = torch.unique(self.gather * span + flat, return_inverse=True)
        nodes, pair_labels = pairs // span, pairs % span
        logp, entropy = chunked_logprobs(self.tree_hidden[0].index_select(0, nodes),
                                         self.weight, pair_labels, vocab_size, temperature,
                                         self.chunk_tokens, with_entropy)
        shape = labels.shape
        return (logp[inverse].view(shape),
                entropy[inverse].view(shape) if entropy is not None else None)


def unshared_output(output, tree: TreeInput | None):
    """The last stage's output of a tree row (logits/values [1, T/cp, ...] or a HiddenStates)
    in the unshared layout; `output` itself when the micro-batch has no tree."""
    if tree is None:
        return output
    if isinstance(output, HiddenStates):
        return TreeHiddenStates(_whole_row(output.hidden, tree), output.weight,
                                output.chunk_tokens, tree.gather)
    return _whole_row(output, tree).index_select(1, tree.gather)
