"""Grouped MoE experts (models.layers.experts.grouped) vs megatron's SequentialMLP: forward + backward
time of one expert module on this host, side by side in one process, same weights and tokens.

  python -m tools.bench.experts [--experts 16] [--hidden 512] [--ffn 256] [--tokens 4096]
                                [--reps 10] [--dtype float32|bfloat16]

Tokens are routed with a skewed distribution (expert e gets weight 1/(e+1); some experts may
get none), sorted by expert as megatron's dispatcher hands them over. Prints one table and, as
its last line, one JSON object with the medians (ms) and sequential / grouped. On a CPU host
the grouped path is the padded bmm; on a Hopper GPU in bf16 it is torch._grouped_mm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # also `python tools/bench/experts.py`


def _modules(args, dtype):
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.layers.experts.grouped import GroupedExperts
    from parallel import cpu_runtime

    cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                            ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
                            num_moe_experts=args.experts, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
                            perform_initialization=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    seq = SequentialMLP(args.experts, cfg, sub, pg_collection=pgs)
    grouped = GroupedExperts(args.experts, cfg, sub, pg_collection=pgs)
    with torch.no_grad():
        for p in seq.parameters():
            p.normal_(0, 0.05)
    grouped.load_state_dict(seq.state_dict())
    dev = cpu_runtime.device()
    return seq.to(dev), grouped.to(dev)


def _inputs(args, dtype):
    import torch

    from parallel import cpu_runtime

    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, args.experts + 1, dtype=torch.float64)
    experts = torch.multinomial(weights, args.tokens, replacement=True, generator=gen)
    counts = torch.bincount(experts, minlength=args.experts)
    dev = cpu_runtime.device()
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(dev, dtype)
    probs = torch.rand(args.tokens, generator=gen).to(dev)
    return x, counts, probs


def _time(module, x, counts, probs, reps: int) -> list[float]:
    import torch

    out = []
    for _ in range(reps + 1):  # the first is a warm-up
        a = x.detach().requires_grad_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        y, _ = module(a, counts, probs)
        y.float().square().sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
        module.zero_grad(set_to_none=True)
    return out[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, default in (("experts", 16), ("hidden", 512), ("ffn", 256), ("tokens", 4096),
                          ("reps", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)

    import torch

    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    init_distributed()
    setup_model_parallel(ParallelLayout(1))
    dtype = getattr(torch, args.dtype)
    seq, grouped = _modules(args, dtype)
    x, counts, probs = _inputs(args, dtype)
    # interleaved, so a noisy host slows both alike
    times = {"sequential": [], "grouped": []}
    for _ in range(2):
        times["sequential"] += _time(seq, x, counts, probs, args.reps // 2)
        times["grouped"] += _time(grouped, x, counts, probs, args.reps // 2)
    med = {k: statistics.median(v) for k, v in times.items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{'module':<12}{'median ms':>12}   ({args.experts} experts, hidden {args.hidden}, "
          f"ffn {args.ffn}, {args.tokens} tokens, {args.dtype}, {device}, "
          f"{int((counts == 0).sum())} experts without tokens)")
    for k, v in med.items():
        print(f"{k:<12}{v:>12.2f}")
    result = {"sequential_ms": med["sequential"], "grouped_ms": med["grouped"],
              "speedup": med["sequential"] / med["grouped"], "device": device, **vars(args)}
    print(json.dumps(result), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())  # a plain exit (see tests/multirank/grouped_experts_check.py)
