"""From a global mini-batch of samples to this rank's micro-batches with loss weights.

Shared by SFT training, SFT evaluation and the RL policy update: plan over DP ranks (engine.training.plan),
weights from the GlobalLossNormalizer (counts reduced over DP only), micro-batches padded or
packed and cut to this CP rank's zigzag shard (engine.training.micro_batches).

Padding multiple of every sequence (padded rows and packed segments alike): 2 x cp with context
parallelism (zigzag chunks), times tp with Megatron sequence parallelism (each CP shard then
splits evenly over the TP ranks); 1 otherwise. Padding carries weight 0 and never counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from engine.training.loss import GlobalLossNormalizer
from engine.training.micro_batches import (MicroBatch, SequenceData, build_packed, build_padded,
                                  dummy_sequence, empty_extras)
from engine.training.mtp import mtp_extras
from engine.training.plan import MiniBatchPlan, plan_mini_batch
from engine.training.prefix_tree import (prefix_units, tree_tokens, unshared_within_budget,
                                         worth_sharing)
from engine.training.tree_batch import build_tree_micro_batch, tree_row_length
from engine.training.tree_routing import trie_rows


@dataclass
class RankBatch:
    micro_batches: list[MicroBatch]
    plan: MiniBatchPlan
    positions: list[int]        # mini-batch positions of this rank's sequences, in plan order
    weights: torch.Tensor       # their loss weights (float64), same order
    num_tokens: int             # real tokens of the whole mini-batch (all ranks)
    num_padding: int            # padding tokens of the whole mini-batch (all ranks, all CP)
    model_tokens: int = 0       # real tokens run through the model (all ranks): tree nodes
    #                             with train.prefix_sharing, else num_tokens

    @property
    def prefix_token_ratio(self) -> float:
        """Tokens run through the model over the tokens of the unshared rows (1.0 unshared)."""
        return self.model_tokens / self.num_tokens if self.num_tokens else 1.0


def _layout():
    return dict(dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                dp_group=ps.get_data_parallel_group(),
                vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def context_parallel_group():
    """The context-parallel group of this rank, over which one sequence's shards are spread
    (engine.rl.algo.seq_reduce, engine.dpo.loss_fn sum per-sequence values over it), or None
    without CP (or without megatron state)."""
    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What every sequence's padded length must divide by (see the module docstring)."""
    multiple = 2 * cp if cp > 1 else 1
    return multiple * tp if sequence_parallel else multiple


def build_rank_batch(seqs: list[SequenceData], normalizer: GlobalLossNormalizer | torch.Tensor,
                     train_cfg, pad_id: int = 0, layout: dict | None = None,
                     sequence_parallel: bool = False,
                     units: list[list[int]] | None = None, mtp: bool = False) -> RankBatch:
    """This rank's micro-batches for the mini-batch `seqs` (every rank passes the same list).

    `train_cfg` supplies micro_batch_size, max_tokens_per_micro_batch, balance_dp, packing.
    `normalizer`: a GlobalLossNormalizer (collective over the DP group), or a tensor of weights
    already fixed for every sequence of `seqs` (e.g. evaluation over a whole eval set).
    `sequence_parallel`: the model runs with Megatron sequence parallelism (pads to tp).
    `units`: groups of positions of `seqs` kept in one micro-batch (plan_mini_batch).
    `mtp`: the sequences also carry their MTP targets (engine.training.mtp.mtp_extras).
    `train_cfg.prefix_sharing` (optional attribute): each micro-batch runs its rows as a prefix
    tree (engine.training.tree_batch); the plan keeps rows sharing a prefix in one micro-batch
    (prefix_tree.prefix_units: `micro_batch_size` then counts those groups) and its token
    budget and DP balance count tree tokens; a micro-batch that runs unshared (its tree saves
    too little) and exceeds the budget is re-planned by the unshared planner
    (prefix_tree.unshared_within_budget)."""
    lay = layout or _layout()
    lengths = [len(s.tokens) for s in seqs]
    sharing = bool(getattr(train_cfg, "prefix_sharing", False))
    trie = trie_rows(seqs) if sharing else None   # tokens, or (token, routing) with replay
    plan = _plan(lengths, train_cfg, lay, units, trie)
    mine = plan.ranks[lay["dp_rank"]]
    positions = [i for mb in mine for i in mb]
    counts = torch.tensor([int(sum(seqs[i].loss_mask)) for i in positions], dtype=torch.long)
    if isinstance(normalizer, torch.Tensor):
        weights = normalizer[torch.tensor(positions, dtype=torch.long)].to(torch.float64)
    else:
        weights = normalizer.sequence_weights(counts)
    weight_of = dict(zip(positions, weights.tolist()))
    multiple = pad_multiple(lay["cp"], lay["tp"] if sequence_parallel else 1, sequence_parallel)
    packing = bool(train_cfg.packing) or sharing
    fixed = None
    trees = _tree_sizes(trie, plan, lay["pp"] > 1) if sharing else None
    if lay["pp"] > 1:  # one p2p shape for every micro-batch of the step
        if sharing:
            fixed = max(tree_row_length(n, multiple) for n in trees)
        elif packing:
            fixed = max(sum(_round_up(lengths[i], multiple) for i in mb)
                        for ranks in plan.ranks for mb in ranks) or multiple
        else:
            fixed = _round_up(max(lengths), multiple)
    build = build_tree_micro_batch if sharing else build_packed if packing else build_padded
    # with PP every micro-batch has the same rows too: top up with fully masked dummies
    rows = max(len(mb) for r in plan.ranks for mb in r) if lay["pp"] > 1 and not packing else 1
    micro_batches = []
    for mb in mine:
        chosen = [SequenceData(seqs[i].tokens, seqs[i].labels, seqs[i].loss_mask,
                               weight_of[i], _extras(seqs[i], weight_of[i], mtp), seqs[i].vision)
                  for i in mb]
        index = list(mb)
        while not chosen or len(chosen) < rows:
            dummy = dummy_sequence(multiple, pad_id)
            template = _extras(seqs[0], 0.0, mtp) if seqs else {}
            if template:
                dummy.extras = empty_extras(template, len(dummy.tokens))
            chosen.append(dummy)
            index.append(-1)
        micro_batches.append(build(chosen, index, multiple, fixed, lay["cp"],
                                   lay["cp_rank"], pad_id))
    total_tokens = sum(lengths)
    padding = _global_padding(plan, lengths, multiple, packing and not sharing, fixed, rows) \
        if not sharing else sum(max(tree_row_length(n, multiple), fixed or 0) - n
                                for n in trees)
    return RankBatch(micro_batches, plan, positions, weights, total_tokens, padding,
                     sum(trees) if sharing else total_tokens)


def _plan(lengths: list[int], train_cfg, lay: dict, units: list[list[int]] | None,
          trie: list[list[int]] | None) -> MiniBatchPlan:
    """The mini-batch's plan over DP ranks and micro-batches (the same on every rank): with
    prefix sharing (`trie` given) rows sharing a prefix stay in one micro-batch, budgets count
    tree tokens and a micro-batch that runs unshared is re-planned within the budget (pp 1;
    with pp > 1 every micro-batch stays a tree); with virtual pipeline stages the count is
    topped up to a multiple of pp."""
    budget, given, unit_lengths = train_cfg.max_tokens_per_micro_batch, units, None
    if trie is not None:
        units, unit_lengths = prefix_units(trie, budget, units)
    plan = plan_mini_batch(lengths, lay["dp"], train_cfg.balance_dp, train_cfg.micro_batch_size,
                           budget, units, unit_lengths)
    if trie is not None and budget and lay["pp"] == 1:
        plan = MiniBatchPlan(unshared_within_budget(plan.ranks, trie, given, budget),
                             plan.dp_imbalance)
    if lay.get("vpp", 1) > 1 and plan.num_micro_batches % lay["pp"]:
        # megatron's interleaved schedule wants a multiple of pp micro-batches (a remainder
        # below pp is refused): top every rank up with empty, zero-weight micro-batches
        extra = lay["pp"] - plan.num_micro_batches % lay["pp"]
        plan = MiniBatchPlan([r + [[] for _ in range(extra)] for r in plan.ranks],
                             plan.dp_imbalance)
    return plan


def _tree_sizes(trie: list[list[int]], plan: MiniBatchPlan, fixed_shape: bool) -> list[int]:
    """Tokens every micro-batch of every rank runs through the model (the same on every rank):
    its tree's nodes, or its rows' tokens where it runs unshared (tree_batch: never with a
    fixed shape, pipeline parallelism). `trie`: the rows the trie merges (tree_routing)."""
    sizes = []
    for ranks in plan.ranks:
        for mb in ranks:
            rows = [trie[i] for i in mb]
            size, total = tree_tokens(rows), sum(len(r) for r in rows)
            sizes.append(size if fixed_shape or worth_sharing(size, total) else total)
    return sizes


def _extras(seq: SequenceData, weight: float, mtp: bool) -> dict:
    """A sequence's per-token extras, with its MTP targets when `mtp`."""
    return {**seq.extras, **mtp_extras(seq, weight)} if mtp else seq.extras


def _global_padding(plan: MiniBatchPlan, lengths: list[int], pad_multiple: int, packing: bool,
                    fixed: int | None, rows: int = 1) -> int:
    """Padding tokens over all ranks' micro-batches (computed from the shared plan)."""
    pad = 0
    for ranks in plan.ranks:
        for mb in ranks:
            ls = [lengths[i] for i in mb] or [pad_multiple]
            if packing:
                row = sum(_round_up(n, pad_multiple) for n in ls)
                pad += max(row, fixed or 0) - sum(lengths[i] for i in mb)
            else:
                width = fixed or _round_up(max(ls), pad_multiple)
                pad += width * max(len(ls), rows) - sum(lengths[i] for i in mb)
    return pad
