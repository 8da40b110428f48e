"""Ulysses (all-to-all) context-parallel attention.

Each CP rank holds a zigzag shard of the sequence and all heads of its TP rank. An all-to-all
gathers the whole sequence and scatters heads (each rank keeps heads/cp; query, key and value
travel in one exchange), attention runs on the whole sequence in natural order, and a second
all-to-all returns to sequence shards. Both exchanges go through `all_to_all` below, an
autograd function (the backward of an all-to-all is the all-to-all of the gradients) that uses
NCCL's all-to-all for CUDA tensors and an all-gather for CPU tensors (gloo, which has no
all-to-all). (torch.distributed.nn's own gloo fallback passes group ranks as global ranks, so
it breaks whenever the CP group is not ranks 0..cp-1, e.g. TP2 x CP2.) KV heads are repeated
to the query head count first when the local KV head count is not divisible by cp (GQA with
fewer KV heads than cp). A prefix tree's row (parallel.tree_attention) is sharded as one sequence;
after the gather every rank attends the whole tree for its heads (with its heads' sinks and the
layer's window: parallel.tree_attention_sinks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from parallel import zigzag
from parallel.packed_seqs import host_cu_seqlens
from parallel.tree_attention import is_tree, tree_attention
from parallel.tree_attention_sinks import tree_sink_attention


def _cp_group():
    return parallel_state.get_context_parallel_group()


def _exchange(inputs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Chunk i of this rank goes to group rank i; returns the chunks received, by source."""
    inputs = [x.contiguous() for x in inputs]
    outputs = [torch.empty_like(x) for x in inputs]
    # by device, not by dist.get_backend(group): on GPUs that is "cpu:gloo,cuda:nccl"
    # (parallel.process_groups.GPU_BACKEND), and CUDA tensors go to NCCL
    if inputs[0].is_cuda:
        dist.all_to_all(outputs, inputs, group=group)
        return outputs
    # gloo (CPU tensors; it has no all_to_all): one all-gather of every rank's stacked chunks,
    # then keep the ones sent to us (cp times the traffic of an all-to-all, but one
    # collective instead of cp scatters)
    me = dist.get_rank(group)
    stacked = torch.stack(inputs)
    gathered = [torch.empty_like(stacked) for _ in inputs]
    dist.all_gather(gathered, stacked, group=group)
    return [g[me] for g in gathered]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *inputs):
        ctx.group = group
        return tuple(_exchange(list(inputs), group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_exchange(list(grads), ctx.group))


def all_to_all(inputs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Differentiable all-to-all of equally shaped chunks over `group`."""
    return list(_AllToAll.apply(group, *inputs))


def seq_to_heads(x: torch.Tensor, group, seq_dim: int, head_dim: int) -> torch.Tensor:
    """[.., s/cp, .., H, ..] -> [.., s, .., H/cp, ..]; the gathered sequence is in rank order."""
    return seq_to_heads_many([x], group, seq_dim, head_dim)[0]


def seq_to_heads_many(tensors: list[torch.Tensor], group, seq_dim: int,
                      head_dim: int) -> list[torch.Tensor]:
    """`seq_to_heads` of several tensors (e.g. q, k, v: head counts and head sizes may differ,
    the sequence shard is the same) in ONE all-to-all per dtype: the chunks bound for each
    rank are flattened into one buffer, exchanged, and split back. The same result and bytes
    as one exchange per tensor, with one collective in the forward and one in the backward
    instead of one per tensor."""
    cp = torch.distributed.get_world_size(group)
    if len({x.dtype for x in tensors}) > 1:   # one buffer holds one dtype: one per dtype
        by_dtype: dict = {}
        for i, x in enumerate(tensors):
            by_dtype.setdefault(x.dtype, []).append(i)
        out: list = [None] * len(tensors)
        for indices in by_dtype.values():
            for i, y in zip(indices, seq_to_heads_many([tensors[i] for i in indices], group,
                                                       seq_dim, head_dim)):
                out[i] = y
        return out
    if len(tensors) == 1:
        return [torch.cat(all_to_all(list(tensors[0].chunk(cp, dim=head_dim)), group),
                          dim=seq_dim)]
    chunks = [x.chunk(cp, dim=head_dim) for x in tensors]      # [tensor][destination]
    shapes = [c[0].shape for c in chunks]
    sizes = [c[0].numel() for c in chunks]
    payload = [torch.cat([c[dest].reshape(-1) for c in chunks]) for dest in range(cp)]
    received = all_to_all(payload, group)                       # [source]
    pieces = [buf.split(sizes) for buf in received]             # [source][tensor]
    return [torch.cat([pieces[src][i].view(shapes[i]) for src in range(cp)], dim=seq_dim)
            for i in range(len(tensors))]


def heads_to_seq(x: torch.Tensor, group, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Inverse of `seq_to_heads`."""
    cp = torch.distributed.get_world_size(group)
    return torch.cat(all_to_all(list(x.chunk(cp, dim=seq_dim)), group), dim=head_dim)


def _segments(packed_seq_params, total: int) -> list[int]:
    if packed_seq_params is None:
        return [total]
    bounds = host_cu_seqlens(packed_seq_params)   # host ints: no device read per layer
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _attention(qkv: list, scale: float, attend, first_head: int) -> torch.Tensor:
    if attend is None:
        return F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)
    return attend(*qkv, first_head)


def ulysses_attention(query, key, value, scale: float, packed_seq_params=None,
                      attend=None) -> torch.Tensor:
    """Causal attention over the CP group. sbhd: query [s/cp, b, h, d] -> [s/cp, b, h*d];
    thd: query [t/cp, h, d] -> [t/cp, h*d]. Key/value carry g <= h heads. `attend(q, k, v,
    first_head)` on [b, h/cp, s, d] (whole sequences, natural order; `first_head`: this CP
    rank's first head among the h) replaces causal SDPA (sinks, sliding windows)."""
    group = _cp_group()
    cp = torch.distributed.get_world_size(group)
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    head_dim_index = 1 if thd else 2
    heads, kv_heads = query.shape[head_dim_index], key.shape[head_dim_index]
    if kv_heads % cp:
        rep = heads // kv_heads
        key = key.repeat_interleave(rep, dim=head_dim_index)
        value = value.repeat_interleave(rep, dim=head_dim_index)
    q, k, v = seq_to_heads_many([query, key, value], group, 0, head_dim_index)
    segments = _segments(packed_seq_params if thd else None, q.shape[0])
    order = zigzag.gathered_to_natural(segments, cp).to(q.device)
    q, k, v = (x.index_select(0, order) for x in (q, k, v))
    first_head = dist.get_rank(group) * q.shape[head_dim_index]
    rep = q.shape[head_dim_index] // k.shape[head_dim_index]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=head_dim_index)
        v = v.repeat_interleave(rep, dim=head_dim_index)
    if thd and is_tree(packed_seq_params):   # prefix sharing: the whole tree on every rank
        out = (tree_attention(q, k, v, packed_seq_params, scale) if attend is None else
               tree_sink_attention(q, k, v, packed_seq_params, attend, first_head))
    elif thd:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # value head dim may differ (MLA)
        bounds = [0]
        for n in segments:
            bounds.append(bounds[-1] + n)
        for a, b in zip(bounds[:-1], bounds[1:]):
            seg = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            out[a:b] = _attention(seg, scale, attend, first_head)[0].transpose(0, 1)
    else:
        qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = _attention([qb, kb, vb], scale, attend, first_head).permute(2, 0, 1, 3)
    inverse = torch.argsort(order)
    out = out.index_select(0, inverse)
    out = heads_to_seq(out, group, 0, head_dim_index)
    return out.reshape(*out.shape[:head_dim_index], -1)
