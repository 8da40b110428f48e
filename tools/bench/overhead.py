"""Engine overhead: the engine's SFT step against a bare megatron-core loop, same model/layout.

`run_overhead` builds a small Qwen3-style HF model, then re-launches `python -m tools.bench
_overhead_worker` under torchrun (4 gloo ranks as TP2 x DP2 on a CPU host; see `default_layout`)
and parses the JSON line rank 0 prints last.

In the worker both loops share one `TrainState` (the same DDP-wrapped GPTModel chunks and the
same megatron distributed optimizer), so they differ only in what the engine adds:
- engine: `engine.sft.training.train_step(state, seqs, normalizer)`: global loss weights
  (GlobalLossNormalizer, an all-reduce over DP), the DP balance plan, micro-batches built from
  token lists, `run_micro_batches`, optimizer and LR scheduler step, reductions of the logged
  metrics over DP and PP;
- bare: the micro-batch tensors of the same global batch built once before timing, a plain
  `forward_step` that calls the model and megatron's `vocab_parallel_cross_entropy` times the
  precomputed per-token weights (the same loss), `get_forward_backward_func()` and
  `optimizer.step()`; nothing else.
Steps alternate (engine, bare), (bare, engine), ... after warm-up; each step is bracketed by
barriers so the time is that of the slowest rank. Reported: ratio of medians (engine / bare).
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from types import SimpleNamespace

from tools.bench.common import (BenchResult, Table, constant_adam, fmt, free_port,
                                last_json_line, median, run_launch, subprocess_env)

# model of the overhead benchmark (Qwen3-style; head_dim 32, vocab a multiple of 128 so the
# engine's padded-vocab masking is a no-op and both loops compute the very same loss)
MODEL = dict(vocab_size=2048, hidden=256, layers=4, heads=8, kv_heads=4, intermediate=1024,
             head_dim=32)
GLOBAL_BATCH, MICRO_BATCH, MIN_LEN, MAX_LEN, NUM_BATCHES = 16, 2, 64, 384, 4


def default_layout() -> tuple[int, int]:
    """(ranks, tp): 4 gloo ranks as TP2 x DP2 on a CPU host; on GPUs one rank per GPU (at most
    4; NCCL allows one rank per device), TP2 when the count is even."""
    import torch

    if not torch.cuda.is_available():
        return 4, 2
    nproc = min(4, torch.cuda.device_count())
    return nproc, 2 if nproc % 2 == 0 else 1


def run_overhead(quick: bool, timeout_s: int = 1200) -> BenchResult:
    """Build the model, launch the torchrun worker, return its tables and summary."""
    from tools.tiny_models import build_tiny_model

    nproc, tp = default_layout()
    pairs, warmup = (20, 2) if quick else (40, 3)
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, **MODEL)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "tools.bench", "_overhead_worker", "--model-dir", model_dir,
               "--tp", str(tp), "--pairs", str(pairs), "--warmup", str(warmup)]
        out, _ = run_launch(cmd, subprocess_env(threads=1), timeout_s, "overhead worker")
    return overhead_result(last_json_line(out), quick)


def overhead_result(raw: dict, quick: bool) -> BenchResult:
    """Tables and summary from the worker's raw timings (seconds per step)."""
    eng, bare, build = raw["engine_s"], raw["bare_s"], raw["build_s"]
    ratio = median(eng) / median(bare)
    paired = median([e / b for e, b in zip(eng, bare)])
    loss_rel = abs(raw["engine_loss"] - raw["bare_loss"]) / abs(raw["bare_loss"])
    rows = [["engine train_step", fmt(median(eng), 4), fmt(min(eng), 4), fmt(max(eng), 4),
             str(len(eng))],
            ["bare megatron-core loop", fmt(median(bare), 4), fmt(min(bare), 4), fmt(max(bare), 4),
             str(len(bare))],
            ["engine batch building alone", fmt(median(build), 4), fmt(min(build), 4),
             fmt(max(build), 4), str(len(build))]]
    layout = raw["layout"]
    table = Table(
        "Engine overhead (seconds per optimizer step)",
        ["loop", "median", "min", "max", "steps"], rows,
        [f"ratio of medians engine / bare = {ratio:.4f} (median of per-pair ratios "
         f"{paired:.4f}); same loss check: engine {raw['engine_loss']:.6f} vs bare "
         f"{raw['bare_loss']:.6f} (relative difference {loss_rel:.1e}).",
         f"layout {layout}; model {raw['model']}; "
         f"global batch {GLOBAL_BATCH} sequences of {MIN_LEN}-{MAX_LEN} tokens, micro-batch "
         f"{MICRO_BATCH}; {raw['warmup']} warm-up pairs not counted; steps interleaved."])
    summary = {"overhead_ratio": ratio, "overhead_paired_ratio": paired,
               "overhead_loss_rel_diff": loss_rel, "overhead_engine_median_s": median(eng),
               "overhead_bare_median_s": median(bare), "overhead_steps": len(eng),
               "overhead_layout": layout, "overhead_seconds": raw["seconds"],
               "overhead_quick": quick}
    return BenchResult([table], summary)


# ------------------------------------------------------------------------------ the worker

def synthetic_global_batches(vocab: int, seed: int = 0) -> list[list]:
    """NUM_BATCHES global batches of GLOBAL_BATCH sequences; lengths MIN_LEN..MAX_LEN, loss on a
    random suffix (like a chat response)."""
    from engine.training.micro_batches import SequenceData

    rng = random.Random(seed)
    batches = []
    for _ in range(NUM_BATCHES):
        seqs = []
        for _ in range(GLOBAL_BATCH):
            n = rng.randint(MIN_LEN, MAX_LEN)
            ids = [rng.randrange(4, vocab) for _ in range(n + 1)]
            start = rng.randint(1, n // 2)
            seqs.append(SequenceData(ids[:-1], ids[1:], [0] * start + [1] * (n - start)))
        batches.append(seqs)
    return batches


def _on_device(mb, device):
    """The micro-batch with the tensors the bare loop reads moved to `device` (in place)."""
    for name in ("tokens", "labels", "token_weights", "position_ids"):
        setattr(mb, name, getattr(mb, name).to(device))
    return mb


def bare_forward_backward(state, micro_batches: list, forward_only: bool = False) -> float:
    """Megatron-core only: forward (and backward) of pre-built micro-batches with loss = sum of
    vocab-parallel cross entropy x per-token weight. Returns this rank's loss sum (last stage)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb.tokens, mb.position_ids, None)

        def loss_func(logits):
            nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float().contiguous(),
                                                               mb.labels)
            loss = (nll * mb.token_weights).sum()
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach()}

        return output, loss_func

    shape = micro_batches[0].tokens.shape
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=state.chunks[0],
        num_microbatches=len(micro_batches), seq_length=shape[1], micro_batch_size=shape[0],
        forward_only=forward_only)
    return sum(float(r["loss"]) for r in reports)


def bare_step(state, micro_batches: list) -> None:
    """One optimizer step with megatron-core only (zero grads, forward/backward, step)."""
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    bare_forward_backward(state, micro_batches)
    state.optimizer.step()


def same_loss_check(state, seqs, prebuilt, normalizer, train_cfg) -> tuple[float, float]:
    """(engine loss, bare loss) of one global batch, forward only, summed over DP: the two
    loops must compute the same number."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.training.rank_batch import build_rank_batch
    from engine.training.schedule import reduce_reports, run_micro_batches
    from engine.sft.training import sft_loss_fn

    with torch.no_grad():
        batch = build_rank_batch(seqs, normalizer, train_cfg)
        reports = run_micro_batches(state.chunks, batch.micro_batches,
                                    sft_loss_fn(state.vocab_size), forward_only=True)
        engine_loss = reduce_reports(reports, ["loss"])["loss"]
        bare = torch.tensor([bare_forward_backward(state, prebuilt, forward_only=True)],
                            dtype=torch.float64)
    dist.all_reduce(bare, group=ps.get_data_parallel_group())
    return engine_loss, float(bare)


def overhead_worker(model_dir: str, tp: int, pairs: int, warmup: int) -> None:
    """Runs on every torchrun rank; rank 0 prints one JSON line of raw timings."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from engine.training.loss import GlobalLossNormalizer
    from engine.training.rank_batch import build_rank_batch
    from engine.sft.training import train_step
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel import cpu_runtime
    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel, shutdown

    t_start = time.perf_counter()
    rank, world = init_distributed()
    layout = ParallelLayout(world, tp=tp)
    setup_model_parallel(layout)
    hf_config = read_config(model_dir)
    optim = constant_adam(1e-4)
    steps = 2 * (pairs + warmup)
    train_cfg = SimpleNamespace(micro_batch_size=MICRO_BATCH, max_tokens_per_micro_batch=None,
                                balance_dp=True, packing=False)
    state = TrainEngine.build(hf_config, optim, torch.float32, steps, train_cfg,
                              weights_dir=model_dir)
    normalizer = GlobalLossNormalizer("token-mean", group=ps.get_data_parallel_group())
    batches = synthetic_global_batches(hf_config["vocab_size"])
    # the bare loop's inputs: the very micro-batches (and weights) the engine builds, moved to
    # this rank's device once
    device = cpu_runtime.device()
    prebuilt = [[_on_device(mb, device) for mb in build_rank_batch(seqs, normalizer,
                                                                   train_cfg).micro_batches]
                for seqs in batches]
    engine_loss, bare_loss = same_loss_check(state, batches[0], prebuilt[0], normalizer,
                                             train_cfg)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(fn) -> float:
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - t0

    engine_s, bare_s, build_s = [], [], []
    for i in range(warmup + pairs):
        b = i % NUM_BATCHES
        run_engine = lambda: train_step(state, batches[b], normalizer)
        run_bare = lambda: bare_step(state, prebuilt[b])
        first, second = (run_engine, run_bare) if i % 2 == 0 else (run_bare, run_engine)
        t_first, t_second = timed(first), timed(second)
        t_engine, t_bare = (t_first, t_second) if i % 2 == 0 else (t_second, t_first)
        t_build = timed(lambda: build_rank_batch(batches[b], normalizer, train_cfg))
        if i >= warmup:
            engine_s.append(t_engine)
            bare_s.append(t_bare)
            build_s.append(t_build)
    if rank == 0:
        model = (f"qwen3 h{MODEL['hidden']} L{MODEL['layers']} heads {MODEL['heads']}/"
                 f"{MODEL['kv_heads']} ffn {MODEL['intermediate']} vocab {MODEL['vocab_size']}")
        print(json.dumps({"engine_s": engine_s, "bare_s": bare_s, "build_s": build_s,
                          "engine_loss": engine_loss, "bare_loss": bare_loss,
                          "layout": layout.describe(), "model": model, "warmup": warmup,
                          "seconds": time.perf_counter() - t_start}), flush=True)
    shutdown()
