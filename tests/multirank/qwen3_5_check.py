"""Gated DeltaNet layer checks at 2 ranks (launched by tests/test_qwen3_5.py):

    torchrun --nproc_per_node 2 tests/multirank/qwen3_5_check.py

One GatedDeltaNet layer (models.layers.gated_delta_net.module) with the same weights on every rank:
1. packing (cp 1, each rank alone): three sequences packed in one thd row give the outputs and
   parameter gradients of running each sequence alone (rel 1e-5); negative control: the state
   and conv window not restarted at segment starts (`restart_segments = False`) differ;
2. CP2, Ulysses (zigzag shards, padded and packed rows): outputs and gradients (summed over the
   CP ranks, as DDP does) equal the whole-sequence run; negative control: each CP rank running
   its shard as one sequence without the exchange (cp_size forced to 1) differs.
Rank 0 prints one "RESULT {json}" line per check with its relative difference.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.layout import ParallelLayout  # noqa: E402
from parallel.process_groups import init_distributed, setup_model_parallel, shutdown  # noqa: E402

HIDDEN, LENGTHS = 32, [12, 20, 8]


def build(cp: int):
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: F401 (megatron after init)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from models.layers.gated_delta_net.module import GatedDeltaNet

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, context_parallel_size=cp,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, layernorm_epsilon=1e-6,
        use_cpu_initialization=True, perform_initialization=False)
    layer = GatedDeltaNet(config, layer_number=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return layer


def packed_params(lengths: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)


def run(layer, x, params=None):
    """(output, {param: grad}) of a sum-of-squares-weighted loss on `x` [s, b, h]."""
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    out, _ = layer(x, packed_seq_params=params)
    weights = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def grads_rel(a: dict, b: dict) -> float:
    return max(rel(a[n], b[n]) for n in b)


def check_packing(results: list) -> None:
    layer = build(1)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, 1, HIDDEN, generator=gen) for n in LENGTHS]
    alone = [run(layer, s) for s in seqs]
    ref_out = torch.cat([o for o, _ in alone])
    ref_grad = {n: sum(g[n] for _, g in alone) for n in alone[0][1]}
    row = torch.cat(seqs)
    # gradients of the packed row weigh tokens like the separate runs: same weights per token
    out, grads = run_weighted(layer, row, packed_params(LENGTHS), [s.shape[0] for s in seqs])
    results.append(dict(check="packing", out_rel=rel(out, ref_out),
                        grad_rel=grads_rel(grads, ref_grad)))
    layer.restart_segments = False
    leak, _ = run_weighted(layer, row, packed_params(LENGTHS), [s.shape[0] for s in seqs])
    results.append(dict(check="packing_leak_control", out_rel=rel(leak, ref_out)))


def run_weighted(layer, row, params, lengths):
    """`run` with each segment's loss weights restarting like separate runs."""
    layer.zero_grad()
    x = row.detach().requires_grad_(True)
    out, _ = layer(x, packed_seq_params=params)
    weights = torch.cat([torch.linspace(0.5, 1.5, n * HIDDEN).reshape(n, 1, HIDDEN)
                         for n in lengths])
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def check_cp(results: list, packed: bool) -> None:
    from megatron.core import parallel_state as ps
    from parallel import zigzag

    lengths = LENGTHS if packed else [sum(LENGTHS)]
    params = packed_params(lengths) if packed else None
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(sum(lengths), 1, HIDDEN, generator=gen)
    weights = torch.linspace(0.5, 1.5, row.numel()).reshape(row.shape)
    setup_model_parallel(ParallelLayout(2, tp=1, pp=1, cp=1))
    ref_out, ref_grad = loss_grads(build(1), row, weights, params)
    setup_model_parallel(ParallelLayout(2, tp=1, pp=1, cp=2))
    rank = ps.get_context_parallel_rank()
    layer = build(2)
    local = zigzag.shard(row, lengths, 2, rank, dim=0)
    local_w = zigzag.shard(weights, lengths, 2, rank, dim=0)
    out, grads = loss_grads(layer, local, local_w, params)
    pieces = [torch.empty_like(out) for _ in range(2)]
    dist.all_gather(pieces, out.contiguous(), group=ps.get_context_parallel_group())
    full = zigzag.unshard(pieces, lengths, 2, dim=0)
    for g in grads.values():
        dist.all_reduce(g, group=ps.get_context_parallel_group())
    name = "cp2_packed" if packed else "cp2"
    results.append(dict(check=name, out_rel=rel(full, ref_out), grad_rel=grads_rel(grads,
                                                                                ref_grad)))
    layer.cp_size = 1   # negative control: no exchange, each rank runs its shard as one row
    bad, _ = loss_grads(layer, local, local_w, None)
    pieces = [torch.empty_like(bad) for _ in range(2)]
    dist.all_gather(pieces, bad.contiguous(), group=ps.get_context_parallel_group())
    results.append(dict(check=f"{name}_no_exchange_control",
                        out_rel=rel(zigzag.unshard(pieces, lengths, 2, dim=0), ref_out)))


def loss_grads(layer, x, weights, params):
    layer.zero_grad()
    out, _ = layer(x.detach().requires_grad_(True), packed_seq_params=params)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def main() -> None:
    _, world = init_distributed()
    setup_model_parallel(ParallelLayout(world, tp=1, pp=1, cp=1))
    results: list = []
    check_packing(results)
    check_cp(results, packed=False)
    check_cp(results, packed=True)
    if dist.get_rank() == 0:
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
