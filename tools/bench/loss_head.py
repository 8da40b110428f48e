"""Loss-head memory: peak RSS of one SFT step and of RL forward-only log-probs, unchunked
(megatron's [tokens, vocab] logits) vs the chunked loss head (engine.training.loss_head).

Model: Qwen3-shaped, fp32, vocabulary 151,936 (Qwen's), hidden 64, 2 layers, tied embeddings
(the issue's setup: memory is dominated by the vocabulary, not the layers). One process (world
1, TP1, CPU). Each measurement runs in a fresh subprocess (`python -m tools.bench
_loss_head_worker ...`) so peaks never mix: it builds the TrainEngine, records its RSS, runs

  sft: one TrainEngine.train_batch (engine.sft.training.train_step: forward, loss, backward,
       Adam step) on one packed micro-batch of TOKENS tokens (sequences of 1,024 tokens, so the
       attention scores stay small next to the logits);
  rl:  engine.rl.policy.logprobs.compute_token_logprobs (forward-only) on the same tokens;

then reports the process's peak RSS (getrusage ru_maxrss) and, for sft, loss and grad norm
(the chunked head must give the unchunked numbers). "per token" = (peak - RSS before the
step) / tokens. `chunk` 0 = unchunked. The chunk sweep at the largest size is how the
default train.loss_chunk_tokens was chosen (docs/benchmarks.md "Loss head memory").
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

from tools.bench.common import (BenchResult, Table, constant_adam, fmt, last_json_line,
                                run_launch, subprocess_env)

MODEL = dict(vocab_size=151936, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
             head_dim=16, max_position_embeddings=2048)
SEQ = 1024                     # tokens per packed sequence
GOAL_GB = 3.0                  # the goal for the 8,192-token SFT step, chunked


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _sequences(tokens: int, vocab: int):
    import torch

    from engine.training.micro_batches import SequenceData

    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(tokens // SEQ):
        ids = torch.randint(4, vocab, (SEQ + 1,), generator=gen).tolist()
        seqs.append(SequenceData(ids[:-1], ids[1:], [0] * 16 + [1] * (SEQ - 16)))
    return seqs


def loss_head_worker(model_dir: str, mode: str, tokens: int, chunk: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import torch
    from megatron.core import parallel_state as ps

    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel

    torch.set_num_threads(1)
    init_distributed()
    setup_model_parallel(ParallelLayout(1))
    hf_config = read_config(model_dir)
    optim = constant_adam(1e-4)
    batching = BatchSettings(micro_batch_size=1, max_tokens_per_micro_batch=tokens,
                             packing=True)
    engine = TrainEngine.build(hf_config, optim, torch.float32, 1, batching,
                               weights_dir=model_dir, loss_chunk_tokens=chunk or None)
    seqs = _sequences(tokens, hf_config["vocab_size"])
    before = _rss_gb()
    start = time.perf_counter()
    out = {"mode": mode, "tokens": tokens, "chunk": chunk}
    if mode == "sft":
        from engine.sft.training import train_step

        m = train_step(engine, seqs, GlobalLossNormalizer("token-mean",
                                                          group=ps.get_data_parallel_group()))
        out.update(loss=m["loss"], grad_norm=m["grad_norm"], micro_batches=1)
    else:
        from engine.rl.policy.logprobs import compute_token_logprobs

        table = compute_token_logprobs(engine, seqs, 1.0)
        out.update(logprob_sum=float(table.double().sum()))
    out.update(seconds=time.perf_counter() - start, before_gb=before,
               peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    print(json.dumps(out), flush=True)


def _measure(model_dir: str, mode: str, tokens: int, chunk: int) -> dict:
    cmd = [sys.executable, "-m", "tools.bench", "_loss_head_worker",
           "--model-dir", model_dir, "--mode", mode, "--tokens", str(tokens),
           "--chunk", str(chunk)]
    out, _ = run_launch(cmd, subprocess_env(threads=1), 1800,
                        f"loss_head {mode} {tokens} {chunk}")
    r = last_json_line(out)
    r["per_token_mb"] = (r["peak_gb"] - r["before_gb"]) * 1e3 / tokens
    return r


def _row(r: dict) -> list[str]:
    return [r["mode"], str(r["tokens"]), "unchunked" if not r["chunk"] else str(r["chunk"]),
            fmt(r["peak_gb"], 2), fmt(r["before_gb"], 2), fmt(r["per_token_mb"], 3),
            fmt(r["seconds"], 1), fmt(r.get("loss"), 6) if "loss" in r else "-",
            fmt(r.get("grad_norm"), 6) if "grad_norm" in r else "-"]


def run_loss_head(quick: bool) -> BenchResult:
    """Peak RSS before/after for SFT and RL log-probs, plus (full size) a chunk-size sweep."""
    from engine.training.loss_head import DEFAULT_LOSS_CHUNK_TOKENS
    from tools.tiny_models import build_tiny_model

    sizes = [2048] if quick else [2048, 8192]
    sweep = [] if quick else [256, 512, 2048, 4096]
    with tempfile.TemporaryDirectory(prefix="bench_loss_head_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **MODEL)
        runs = [_measure(model_dir, mode, n, c) for mode in ("sft", "rl") for n in sizes
                for c in (0, DEFAULT_LOSS_CHUNK_TOKENS)]
        sweep_runs = [_measure(model_dir, "sft", sizes[-1], c) for c in sweep]
    head = ["mode", "tokens", "chunk", "peak RSS GB", "RSS before step GB", "MB per token",
            "step s", "loss", "grad norm"]
    tables = [Table("Loss head: peak RSS, unchunked vs chunked", head, [_row(r) for r in runs],
                    notes=[f"fp32, vocabulary {MODEL['vocab_size']:,}, hidden {MODEL['hidden']}, "
                           "1 process, 1 thread; default chunk "
                           f"{DEFAULT_LOSS_CHUNK_TOKENS} tokens."])]
    if sweep_runs:
        chosen = [r for r in runs if r["mode"] == "sft" and r["tokens"] == sizes[-1]]
        tables.append(Table(f"Chunk sweep (sft, {sizes[-1]} tokens)", head,
                            [_row(r) for r in sorted(sweep_runs + chosen[1:],
                                                     key=lambda r: r["chunk"])]))
    big = {(r["mode"], bool(r["chunk"])): r for r in runs if r["tokens"] == sizes[-1]}
    summary = {"loss_head_runs": runs + sweep_runs,
               "loss_head_sft_peak_gb": big[("sft", True)]["peak_gb"],
               "loss_head_sft_peak_gb_unchunked": big[("sft", False)]["peak_gb"],
               "loss_head_rl_peak_gb": big[("rl", True)]["peak_gb"],
               "loss_head_rl_peak_gb_unchunked": big[("rl", False)]["peak_gb"],
               "loss_head_tokens": sizes[-1]}
    return BenchResult(tables, summary)
