"""Grouped MoE experts (models.layers.experts.grouped) against megatron's SequentialMLP.

  python tests/multirank/grouped_experts_check.py --unit
  torchrun --nproc_per_node 2 tests/multirank/grouped_experts_check.py HF_DIR

--unit (1 process): one expert module, 4 local experts sharing the same weights in both
implementations, fp32 tokens already sorted by expert with counts (5, 0, 9, 0) (two experts
get no token) and random routing weights: outputs and the gradients of the tokens, the routing
weights and every expert weight, for the padded-bmm kernel and (where torch has it) the
`torch._grouped_mm` call the CUDA path makes; with megatron's fused weighted SwiGLU too. A
negative control routes the same tokens with counts (9, 0, 5, 0). One RESULT line each:
  {"case": ..., "out": rel, "grads": rel}      (rel: max |a - b| / max |b|)

Whole model (2 ranks, HF_DIR a tiny Qwen3-MoE): for each layout of LAYOUTS the model is built
twice from HF_DIR (moe.grouped_experts true / false; "ep2_fusions": the grouped one also with
the SwiGLU and residual fusions; "tp2sp_lora": both with LoRA adapters), one fp32 forward and
backward of
different random tokens per rank through GPTModel; the logits and every parameter gradient
are compared (relative, max over ranks). One RESULT line per layout:
  {"layout": ..., "logits": rel, "grads": rel, "grouped_modules": n}
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYOUTS = {"ep1": dict(tp=1, ep=1, sp=False), "ep2": dict(tp=1, ep=2, sp=False),
           "tp2sp": dict(tp=2, ep=1, sp=True), "ep2_fusions": dict(tp=1, ep=2, sp=False),
           "tp2sp_lora": dict(tp=2, ep=1, sp=True)}
# "tp2sp_lora": both models with LoRA adapters on the experts and the router (non-zero B),
# ranks 6 and 3 (not multiples of 4: the grouped experts take their padded-bmm kernel, whose
# weight gradients are not contiguous) at expert TP 2; every adapter gradient compared
LORA_PATTERN = {"experts.down_proj": 6, "experts.gate_up_proj": 3}
# "ep2_fusions": the grouped model with megatron's fused SwiGLU and bias-dropout-add and the
# compiled RMSNorm (model.fusions.swiglu / residual / rmsnorm; the last under the CPU runtime's
# device mapping, which dynamo traces) against the sequential, unfused one
FUSIONS = dict(bias_activation_fusion=True, bias_dropout_fusion=True, fused_norm=True)
BATCH, SEQ = 2, 16


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _expert_modules(fused: bool):
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.layers.experts.grouped import GroupedExperts

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            ffn_hidden_size=24, moe_ffn_hidden_size=24, num_moe_experts=4,
                            gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bias_activation_fusion=fused,
                            use_cpu_initialization=True, perform_initialization=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    seq, grouped = SequentialMLP(4, cfg, sub, pg_collection=pgs), GroupedExperts(
        4, cfg, sub, pg_collection=pgs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    grouped.load_state_dict(seq.state_dict())
    assert grouped.sequential_reason is None, grouped.sequential_reason
    return seq, grouped


def _run_experts(module, x, probs, counts):
    import torch

    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = module(x, torch.tensor(counts), probs)
    assert bias is None
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = [x.grad, probs.grad] + [p.grad for p in module.parameters()]
    return out.detach(), grads


def unit() -> None:
    import torch

    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    init_distributed()
    setup_model_parallel(ParallelLayout(1))
    gen = torch.Generator().manual_seed(1)
    x, probs = torch.randn(14, 16, generator=gen), torch.rand(14, generator=gen)
    kernels = ["padded"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])
    cases = [(k, False, (5, 0, 9, 0)) for k in kernels] + [("padded", True, (5, 0, 9, 0))]
    cases.append(("negative_control", False, (9, 0, 5, 0)))
    for kernel, fused, counts in cases:
        seq, grouped = _expert_modules(fused)
        grouped.kernel = "padded" if kernel == "negative_control" else kernel
        ref_out, ref_grads = _run_experts(seq, x, probs, (5, 0, 9, 0))
        out, grads = _run_experts(grouped, x, probs, counts)
        rel_grads = max(_rel(a, b) for a, b in zip(grads, ref_grads))
        name = kernel + ("_fused_swiglu" if fused else "")
        print("RESULT " + json.dumps({"case": name, "out": _rel(out, ref_out),
                                      "grads": rel_grads}), flush=True)
    shutdown()


def _world_max(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _lora_spec():
    from models.lora.slices import LoraSpec
    from models.lora.targets import PARAMETER_TARGETS

    return LoraSpec(4, 8.0, frozenset(PARAMETER_TARGETS), rank_pattern=LORA_PATTERN)


def _random_adapters(chunk) -> None:
    """Every adapter of `chunk` set to full matrices seeded by its name (the same model on
    every rank and in both builds), B non-zero."""
    import torch

    from models.lora.sites import adapters

    for name, adapter in adapters(chunk):
        for sl in adapter.slices:
            gen = torch.Generator().manual_seed(sum(map(ord, name + sl.name)))
            rank = adapter.ranks[sl.name]
            adapter.set_full(sl.name, torch.randn(rank, sl.in_features, generator=gen) * 0.3,
                             torch.randn(sl.out_features, rank, generator=gen) * 0.3)


def _forward_backward(cfg: dict, reader, tokens, grouped: bool, sp: bool, lora: bool = False,
                      **overrides):
    """(logits [b, s, v/tp], {name: grad of every parameter with one}) of one fp32
    forward/backward on `tokens`; `lora`: with _lora_spec's adapters (_random_adapters)."""
    import torch

    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.layers.experts.grouped import GroupedExperts
    from models.layers.norms.local import FusedRMSNorm

    (chunk,) = build_model_chunks(cfg, grouped_experts=grouped, sequence_parallel=sp,
                                  lora=_lora_spec() if lora else None, **overrides)
    load_hf_weights([chunk], reader, cfg)
    if lora:
        _random_adapters(chunk)
    n = sum(isinstance(m, GroupedExperts) for m in chunk.modules())
    norms = sum(isinstance(m, FusedRMSNorm) for m in chunk.modules())
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = chunk(tokens, positions, None)
    logits.backward(torch.cos(torch.arange(logits.numel(), dtype=torch.float32))
                    .view_as(logits))
    return logits.detach(), {k: p.grad for k, p in chunk.named_parameters()
                             if p.grad is not None}, (n, norms)


def whole_model(hf_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    rank, world = init_distributed()
    cfg, reader = read_config(hf_dir), SafetensorsReader(hf_dir)
    for name, lay in LAYOUTS.items():
        setup_model_parallel(ParallelLayout(world, tp=lay["tp"], ep=lay["ep"],
                                            sequence_parallel=lay["sp"]))
        dp_rank = rank // lay["tp"]
        gen = torch.Generator().manual_seed(100 + dp_rank)
        tokens = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=gen)
        fused = FUSIONS if name.endswith("fusions") else {}
        lora = name.endswith("lora")
        got, got_grads, (n, norms) = _forward_backward(cfg, reader, tokens, True, lay["sp"],
                                                       lora, **fused)
        ref, ref_grads, (n_ref, _) = _forward_backward(cfg, reader, tokens, False, lay["sp"], lora)
        assert n > 0 and n_ref == 0, (n, n_ref)
        assert set(got_grads) == set(ref_grads) and (not lora or all(
            "_lora." in k for k in ref_grads)), sorted(set(got_grads) ^ set(ref_grads))
        grads = max(_rel(got_grads[k], ref_grads[k]) for k in ref_grads)
        record = {"layout": name, "logits": _world_max(_rel(got, ref)),
                  "grads": _world_max(grads), "grouped_modules": n, "fused_norms": norms}
        if rank == 0:
            print("RESULT " + json.dumps(record), flush=True)
    dist.barrier()
    shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir", nargs="?")
    parser.add_argument("--unit", action="store_true")
    args = parser.parse_args()
    if args.unit:
        unit()
    else:
        whole_model(args.hf_dir)
    return 0


if __name__ == "__main__":
    # a plain exit: engine.cli.exit_process joins non-daemon threads before the atexit hooks
    # that stop a ThreadPoolExecutor this path starts, and would wait forever
    sys.exit(main())
