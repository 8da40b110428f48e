"""Weight-sync throughput: Megatron GPTModel -> HF rollout engine, per bucket size.

One process (world 1, TP1, gloo on CPU / nccl on GPU): a >= 100M-parameter Qwen3-shaped model is
built as megatron chunks from an HF folder, and an HF rollout engine is loaded from the same
folder. Each sync streams `models.bridge.weights.export_hf_weights(chunks)` (the checkpoint-conversion
code path: megatron -> HF names, fused QKV and gate/up split, vocab unpadded) through
`engine.rl.policy.weight_sync.sync_weights` in buckets of `bucket_mb` MiB into
`HFRolloutEngine.update_weights` (a copy into the transformers model). Throughput = bytes moved
(fp32 weights) / wall seconds of the whole stream, in GB/s (1e9 bytes). An "export only" row
times the same stream without an engine (the conversion alone). On a CPU host torch runs with
CPU_THREADS intra-op threads (see common.torch_threads).
"""
from __future__ import annotations

import os
import tempfile
import time

from tools.bench.common import BenchResult, Table, fmt, median, torch_threads

# 8 layers x 11.8M + 32.8M tied embedding = 127M parameters (fp32: 508 MB)
MODEL = dict(vocab_size=32000, hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816,
             head_dim=64)
DEFAULT_BUCKET_MB = 512       # engine.rl.config rollout.sync_bucket_mb default
CPU_THREADS = 1               # torch intra-op threads on a CPU host (common.torch_threads)


def count_parameters(hf_config: dict) -> int:
    """Parameters of a Qwen3-style HF config (tied embeddings counted once; q/k norms incl.)."""
    h, layers, vocab = hf_config["hidden_size"], hf_config["num_hidden_layers"], \
        hf_config["vocab_size"]
    head_dim = hf_config["head_dim"]
    q, kv = hf_config["num_attention_heads"] * head_dim, \
        hf_config["num_key_value_heads"] * head_dim
    ffn = hf_config["intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * ffn + 2 * h + 2 * head_dim
    embed = vocab * h * (1 if hf_config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + h


def run_sync(quick: bool) -> BenchResult:
    """Time weight syncs per bucket size; returns tables and summary (GB/s)."""
    import torch

    from engine.rl.rollout import make_rollout_engine
    from engine.rl.policy.weight_sync import sync_weights
    from models.bridge.weights import export_hf_weights, load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader, read_config
    from parallel import cpu_runtime
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown
    from tools.tiny_models import build_tiny_model

    t0 = time.perf_counter()
    buckets, repeats = ([32, 128, DEFAULT_BUCKET_MB], 3) if quick else \
        ([16, 64, 256, DEFAULT_BUCKET_MB], 9)
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **MODEL)
        hf_config = read_config(model_dir)
        init_distributed()
        setup_model_parallel(ParallelLayout(1))
        chunks = build_model_chunks(hf_config)
        load_hf_weights(chunks, SafetensorsReader(model_dir), hf_config)
        engine = make_rollout_engine("hf", model_dir)
        engine.sleep()  # start from released memory: every parameter must be written by a sync
        engine.wake()
        stats = {b: [] for b in buckets}
        with torch_threads(CPU_THREADS if cpu_runtime.is_cpu_host() else torch.get_num_threads()):
            for i in range(repeats + 1):  # round robin over bucket sizes; i == 0: warm-up
                for bucket_mb in buckets:
                    one = sync_weights(export_hf_weights(chunks, hf_config), engine, bucket_mb)
                    if i > 0:
                        stats[bucket_mb].append(one)
            export_s = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _name, _tensor in export_hf_weights(chunks, hf_config):
                    pass
                export_s.append(time.perf_counter() - start)
        first = stats[buckets[0]][0]
        num_tensors, total_bytes = first.num_tensors, first.total_bytes
        rows, per_bucket = [], {}
        for bucket_mb in buckets:
            gbps = sorted(s.gbps for s in stats[bucket_mb])
            per_bucket[str(bucket_mb)] = median(gbps)
            rows.append([str(bucket_mb), str(stats[bucket_mb][0].num_buckets),
                         fmt(median([s.seconds for s in stats[bucket_mb]]), 3),
                         fmt(median(gbps), 2), f"{gbps[0]:.2f} - {gbps[-1]:.2f}"])
        rows.append(["export only (no engine)", "-", fmt(median(export_s), 3),
                     fmt(total_bytes / median(export_s) / 1e9, 2), ""])
        engine.generate([[5, 6, 7]], _greedy(1))  # the engine accepts the synced weights
        shutdown()
    params = count_parameters(hf_config)
    table = Table(
        "Weight sync: megatron export -> HF rollout engine (median per sync)",
        ["bucket MiB", "buckets", "median s", "median GB/s", "GB/s range"], rows,
        [f"model: qwen3 h{MODEL['hidden']} L{MODEL['layers']} vocab {MODEL['vocab_size']}, "
         f"{params / 1e6:.0f}M parameters, {num_tensors} HF tensors, "
         f"{total_bytes / 1e6:.0f} MB (fp32) per sync; TP1, one process; {repeats} timed "
         "syncs per bucket size after one warm-up, bucket sizes taken in turn; "
         f"torch threads on a CPU host: {CPU_THREADS}. "
         f"weight_sync_gbps = the median at the RL default bucket ({DEFAULT_BUCKET_MB} MiB)."])
    summary = {"weight_sync_gbps": per_bucket[str(DEFAULT_BUCKET_MB)],
               "weight_sync_bytes": total_bytes, "weight_sync_params": params,
               "weight_sync_per_bucket_gbps": per_bucket,
               "weight_sync_export_only_gbps": total_bytes / median(export_s) / 1e9,
               "sync_seconds": time.perf_counter() - t0}
    return BenchResult([table], summary)


def _greedy(max_new_tokens: int):
    from engine.rl.rollout import SamplingParams
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
