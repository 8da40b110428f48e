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

`--transport` (`run_transport`; `python -m tools.bench.sync --transport [--quick]`): the
vLLM rollout engine's sync by rollout.sync_transport, `handle` against `file`, side by side in
one process: the ~100M-parameter checkpoint of tools/bench/backends.py (fp32, 382 MB, one
bucket at the default 512 MiB) loaded into one CPU vLLM engine (TP 1), then synced
TRANSPORT_REPEATS times per transport after one warm-up each, the transports taken in turn (the
order swapped every round). Timed: every `update_weights` call of a sync (the owner's packing
or file write, the RPC, the worker's rebuild or read and vLLM's weight loaders) and, apart, the
sync's close (the next generate: vLLM finalises the reload; one greedy token). Owner side
alone: the refill of a reused shared buffer (handle: every sync after the first reuses the
last sync's buffers) vs `write_bucket` + `discard` (file). The first (warm-up) sync of each
transport is reported apart: by handle it allocates the shared buffers.
After the last syncs the worker's weights are compared bitwise (rl_weight_digest).
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
TRANSPORT_REPEATS, TRANSPORT_QUICK = 7, 2   # timed syncs per transport (--transport)
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

    from engine.generation import make_rollout_engine
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
    from engine.generation import SamplingParams
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def _buckets(weights: dict, bucket_mb: float) -> list[list]:
    """[(name, tensor), ...] in checkpoint order, cut at `bucket_mb` MiB (sync_weights' rule:
    a bucket closes before the tensor that would overflow it)."""
    buckets, current, size = [], [], 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_mb * 2 ** 20:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    return buckets + ([current] if current else [])


def _owner_side(buckets: list[list], transport: str, buffers: dict) -> float:
    """Seconds of the owner's part alone: the refill of a reused shared buffer per bucket
    (handle, as every sync after the first; `buffers` keeps them) or write + delete of the
    file (file)."""
    from engine.generation.sync.bucket_files import discard, write_bucket
    from engine.generation.sync.handles import layout, new_buffer, pack_into

    start = time.perf_counter()
    for i, bucket in enumerate(buckets):
        if transport == "handle":
            slots, nbytes = layout(bucket)
            if i not in buffers:   # allocated outside the timing
                pause = time.perf_counter()
                buffers[i] = new_buffer(nbytes, torch_device_of(bucket))
                start += time.perf_counter() - pause
            pack_into(buffers[i], slots, bucket)
        else:
            discard(write_bucket(bucket)[0])
    return time.perf_counter() - start


def torch_device_of(bucket: list):
    return bucket[0][1].device


def run_transport(quick: bool) -> BenchResult:
    """The vLLM engine's sync by handle vs by file (module docstring)."""
    import torch  # torch, vLLM and the engine imported on use, as in run_sync
    from safetensors.torch import load_file

    from engine.config.rollout_settings import VLLMConfig
    from engine.generation import make_rollout_engine
    from engine.generation.vllm.settings import engine_args
    from tools.bench.backends import MODEL as BACKENDS_MODEL, THREADS
    from tools.bench.common import machine_info
    from tools.tiny_models import build_tiny_model

    repeats, order = (TRANSPORT_QUICK if quick else TRANSPORT_REPEATS), ["handle", "file"]
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # vLLM's worker process reads it
    times = {t: {"sync": [], "close": [], "owner": [], "first": []} for t in order}
    owner_buffers: dict = {}
    with torch_threads(THREADS), tempfile.TemporaryDirectory(prefix="bench_transport_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", seed=0,
                                     eos_token_id=1, **BACKENDS_MODEL)
        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        buckets = _buckets(weights, DEFAULT_BUCKET_MB)
        engine = make_rollout_engine("vllm", model_dir, dtype=torch.float32, seed=0,
                                     **engine_args(VLLMConfig(), 1, True))
        digests = {}
        try:
            for i in range(repeats + 1):   # i == 0: one warm-up per transport
                for transport in (order if i % 2 == 0 else order[::-1]):
                    engine.sync_transport = transport
                    start = time.perf_counter()
                    for bucket in buckets:
                        engine.update_weights(bucket)
                    loaded = time.perf_counter()
                    engine.generate([[5, 6, 7]], _greedy(1))   # closes the sync
                    closed = time.perf_counter()
                    owner = _owner_side(buckets, transport, owner_buffers)
                    digests[transport] = engine.llm.collective_rpc("rl_weight_digest")
                    if i == 0:
                        times[transport]["first"].append(loaded - start)
                    for key, value in (("sync", loaded - start), ("close", closed - loaded),
                                       ("owner", owner)) if i > 0 else ():
                        times[transport][key].append(value)
        finally:
            engine.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    med = {t: {k: median(v) for k, v in parts.items()} for t, parts in times.items()}
    rows = [[t, fmt(med[t]["sync"], 3), f"{min(times[t]['sync']):.3f} - "
             f"{max(times[t]['sync']):.3f}", fmt(nbytes / med[t]["sync"] / 1e9, 2),
             fmt(med[t]["owner"], 3), fmt(med[t]["close"], 3), fmt(med[t]["first"], 3)]
            for t in order]
    host = machine_info()
    speedup = med["file"]["sync"] / med["handle"]["sync"]
    table = Table(
        "vLLM weight sync by rollout.sync_transport (median per sync, same process)",
        ["transport", "update_weights s", "range s", "GB/s", "owner side s",
         "close + 1 token s", "first sync s"], rows,
        [f"~100M-parameter Qwen3-shaped checkpoint (tools/bench/backends.py), fp32, "
         f"{nbytes / 1e6:.0f} MB in {len(buckets)} bucket(s) of <= {DEFAULT_BUCKET_MB} MiB; "
         f"vLLM CPU engine, TP 1, {THREADS} threads; {repeats} timed syncs per transport after "
         f"one warm-up each, in turn; file / handle = {speedup:.2f}x; weights bitwise equal "
         f"after both: {digests['handle'] == digests['file']}",
         f"host: {host['cpu']} ({host['cpu_vector_units']}), {host['cpu_cores']} cores, "
         f"load {host.get('load_avg_1m')}"])
    return BenchResult([table], {"sync_transport_seconds": med,
                                 "sync_transport_file_over_handle": speedup,
                                 "sync_transport_bitwise_equal":
                                     digests["handle"] == digests["file"],
                                 "sync_transport_bytes": nbytes, "machine": host})


if __name__ == "__main__":   # python -m tools.bench.sync --transport [--quick]
    import argparse

    from tools.bench.common import emit, quiet_libraries

    parser = argparse.ArgumentParser(prog="python -m tools.bench.sync",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", action="store_true",
                        help="the vLLM sync by handle vs by file (else: the HF engine's sync)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    cli = parser.parse_args()
    quiet_libraries()
    emit(run_transport(cli.quick) if cli.transport else run_sync(cli.quick))
