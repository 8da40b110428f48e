"""MFU of the engine's SFT step: a ~1B Qwen3-shaped model, bf16, 4096-token packed rows (CUDA).

Runs `engine.sft.training.train_step` (packing, micro-batches by a 4096-token budget, megatron
distributed optimizer, bf16 params with fp32 master weights) on sequences drawn from the
benchmark's chat/reasoning mixture (clipped to 4096 tokens) and reports model TFLOP/s per GPU
and MFU = TFLOP/s / the GPU's dense bf16 peak.

FLOP count (`train_flops`): 3 x forward (backward = 2 x forward; no activation recomputation),
forward = per token 2 x (QKV, O, gate/up/down and LM-head weights) + causal attention per packed
sequence: 2 matmuls (QK^T, AV) x 2 FLOP x q_dim x L(L+1)/2 per layer. Attention never crosses
sequence boundaries in a packed row, so it is counted per sequence; norms, rotary, softmax and
the loss are not counted. One process drives one GPU; under torchrun each GPU is a DP rank.
"""
from __future__ import annotations

import time

from tools.bench.common import BenchResult, Table, constant_adam, fmt, median

# Qwen3-shaped, ~1.1B parameters (Qwen3-1.7B widths with 16 layers); tied embeddings
QWEN3_1B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=6144)
SEQ_TOKENS = 4096

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("H200", 989.4), ("A100", 312.0))


def qwen3_hf_config(dims: dict) -> dict:
    """A complete HF config dict (what `models` reads) for Qwen3 with the given widths."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
            "torch_dtype": "bfloat16", **dims}


def peak_bf16_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU by its CUDA device name, or None when unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def train_flops(hf_config: dict, sequence_lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward) over sequences of these lengths."""
    h, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    q = hf_config["num_attention_heads"] * hf_config["head_dim"]
    kv = hf_config["num_key_value_heads"] * hf_config["head_dim"]
    ffn, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
    weights_per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * ffn) + h * vocab
    tokens = sum(sequence_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in sequence_lengths)
    forward = 2 * weights_per_token * tokens + layers * 2 * 2 * q * causal_pairs
    return 3.0 * forward


def make_sequences(vocab: int, total_tokens: int, seed: int = 0) -> list:
    """Sequences from the 'mixture' length distribution, clipped to SEQ_TOKENS, whose lengths
    sum to at most `total_tokens` (a length that would overflow is skipped); loss on the second
    half of each (a response)."""
    import numpy as np

    from tools.bench.balance import sample_lengths
    from engine.training.micro_batches import SequenceData

    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < 2 * total_tokens:
        lengths += [min(n, SEQ_TOKENS) for n in sample_lengths("mixture", 64, rng)]
    out, used = [], 0
    for n in lengths:
        if used + n > total_tokens:
            continue
        ids = rng.integers(4, vocab, n + 1).tolist()
        out.append(SequenceData(ids[:-1], ids[1:], [0] * (n // 2) + [1] * (n - n // 2)))
        used += n
    return out


def _init_weights(state) -> None:
    """Random weights in place (norms 1, others N(0, 0.02)), then refresh the optimizer's fp32
    master copies from them."""
    import torch

    with torch.no_grad():
        for chunk in state.chunks:
            for name, param in chunk.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
    state.optimizer.reload_model_params()


def measure_sft_step(hf_config: dict, micro_batches: int, steps: int, warmup: int,
                     dtype, profile: bool = False) -> dict:
    """Time `steps` engine SFT steps (after `warmup`) on this process's device under the current
    torch.distributed world (DP = world). Returns step seconds, FLOPs per step per GPU, tokens.
    With `profile`, one more step runs under torch.profiler (not timed) and "kernels" holds its
    30 largest GPU kernels by total device time: (name, calls, ms), plus "kernel_ms" (all)."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from engine.training.loss import GlobalLossNormalizer
    from engine.sft.training import train_step
    from engine.training.train_engine import TrainEngine
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    world = dist.get_world_size()
    setup_model_parallel(ParallelLayout(world))
    optim = constant_adam(1e-5)
    train_cfg = SimpleNamespace(micro_batch_size=1, max_tokens_per_micro_batch=SEQ_TOKENS,
                                balance_dp=True, packing=True)
    state = TrainEngine.build(hf_config, optim, dtype, steps + warmup, train_cfg,
                              load_weights=False)
    _init_weights(state)
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    # ~97% of micro_batches x world full rows: first-fit decreasing then needs about that many
    seqs = make_sequences(hf_config["vocab_size"], int(0.97 * micro_batches * world * SEQ_TOKENS))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times, metrics = [], {}
    for i in range(warmup + steps):
        sync()
        dist.barrier()
        start = time.perf_counter()
        metrics = train_step(state, seqs, normalizer)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    lengths = [len(s.tokens) for s in seqs]
    kernels = profile_step(lambda: train_step(state, seqs, normalizer), sync) if profile else {}
    return {**kernels, "step_s": times, "flops_per_gpu": train_flops(hf_config, lengths) / world,
            "tokens": sum(lengths), "sequences": len(seqs), "world": world,
            "loss": metrics.get("loss"), "padding": metrics.get("batch/padding_fraction")}


def profile_step(step, sync) -> dict:
    """Run `step()` once under torch.profiler; the GPU kernels' device time, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    rows = [(e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaLaunchKernel")
    return {"kernels": rows[:30], "kernel_ms": sum(r[2] for r in rows),
            "kernel_launches": launches}


def run_mfu(quick: bool, profile: bool = False) -> BenchResult:
    """On CUDA: measure and report MFU; elsewhere a 'skipped: no CUDA' table and mfu null."""
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA (the mfu benchmark needs a GPU)", flush=True)
        table = Table("MFU (~1B Qwen3-shaped SFT step, bf16, 4K packed rows)",
                      ["status"], [["skipped: no CUDA"]])
        return BenchResult([table], {"mfu": None, "tflops_per_gpu": None,
                                     "mfu_skipped": "no CUDA"})
    from parallel.process_groups import init_distributed, shutdown

    init_distributed()
    name = torch.cuda.get_device_name()
    hf_config = qwen3_hf_config(QWEN3_1B)
    steps, warmup = (5, 2) if quick else (10, 3)
    raw = measure_sft_step(hf_config, micro_batches=8, steps=steps, warmup=warmup,
                           dtype=torch.bfloat16, profile=profile)
    shutdown()
    step = median(raw["step_s"])
    tflops = raw["flops_per_gpu"] / step / 1e12
    peak = peak_bf16_tflops(name)
    mfu = tflops / peak if peak else None
    from tools.bench.sync import count_parameters
    params = count_parameters(hf_config)
    table = Table(
        "MFU (~1B Qwen3-shaped SFT step, bf16, 4K packed rows)",
        ["GPU", "GPUs", "params", "tokens/step/GPU", "median step s", "TFLOP/s per GPU",
         "peak bf16", "MFU"],
        [[name, str(raw["world"]), f"{params / 1e9:.2f}B", str(raw["tokens"] // raw["world"]),
          fmt(step, 3), fmt(tflops, 1), fmt(peak, 1), "n/a" if mfu is None else f"{mfu:.1%}"]],
        [f"{steps} timed steps after {warmup} warm-up; {raw['sequences']} sequences per step "
         f"(chat/reasoning mixture, <= {SEQ_TOKENS} tokens) packed into {SEQ_TOKENS}-token "
         "micro-batches; FLOPs: 3 x forward, causal attention per sequence."])
    tables = [table]
    if profile:
        tables.append(Table(
            f"GPU kernels of one profiled step ({raw['kernel_ms']:.0f} ms of kernel time, "
            f"{raw['kernel_launches']} cudaLaunchKernel calls)", ["kernel", "calls", "ms"],
            [[name[:90], str(calls), fmt(ms, 1)] for name, calls, ms in raw["kernels"]]))
    return BenchResult(tables, {"mfu": mfu, "tflops_per_gpu": tflops, "mfu_gpu": name,
                                 "mfu_step_s": step, "mfu_params": params,
                                 "mfu_tokens_per_step_per_gpu": raw["tokens"] // raw["world"]})
