"""Prefix sharing (train.prefix_sharing) against the unshared rows: one process, the same
batches, side by side (docs/prefix-sharing.md, docs/benchmarks.md "Prefix sharing").

    python -m tools.bench prefix_sharing [--quick]

Model: Qwen3-shaped, fp32, hidden 256, 8 layers, 8 query / 2 KV heads, vocabulary 4,096 (the
output layer ~15 % of a token's linear work), random weights, world 1, CPU (or one GPU).
Workloads (rows = prompt + reply; every pass sees the same rows in both modes):

  grpo:   one 1,024-token prompt x rollout.n=8 replies, log-normal lengths (median 128);
  dpo:    4 pairs: 512-token prompts, 256-token chosen and rejected answers;
  agent:  8 rows, each extending the previous one by one 128-token turn;
  short:  4 prompts of 32 tokens x 2 replies of 512 tokens (sharing saves little).

Per workload and mode, the three passes of an RL step: the log-prob stage and the reference
(each engine.rl.policy.logprobs.compute_token_logprobs, forward only; the reference is the same
pass a frozen copy runs) and one GRPO update (engine.rl.policy.update.policy_update: forward,
loss, backward, Adam), packed micro-batches of at most 4,096 tokens. Reported: the token ratio
(train/prefix_token_ratio), seconds of each pass, the peak RSS increase over each workload's
passes (sampled every 5 ms), the largest differences of the log-prob table, loss and grad
norm between the modes, and which tree attention the shared mode ran (`attention`: calls per
path of parallel.tree_attention; on a GPU one FlexAttention call per layer and micro-batch). Each mode runs three times per workload, alternating with the other,
and each pass keeps its smallest time (other load on the host only adds). `--quick` (the CI
size): a 2-layer model, workloads a quarter long, one run each.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time

from tools.bench.common import BenchResult, Table, fmt

MODEL = dict(vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=2, intermediate=768,
             head_dim=32, max_position_embeddings=4096)
QUICK_MODEL = dict(MODEL, layers=2, hidden=128, intermediate=384, head_dim=16)
BUDGET = 4096                 # train.max_tokens_per_micro_batch, both modes
GOALS = {"grpo": 3.0, "dpo": 1.3, "agent": 3.0, "short": 0.97}


def _workloads(vocab: int, scale: float) -> dict:
    """name -> (prompts, replies): the module docstring's rows, lengths times `scale`."""
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(4, vocab) for _ in range(max(1, int(n * scale)))]

    prompt = ids(1024)
    grpo = ([prompt] * 8, [ids(min(1024, rng.lognormvariate(math.log(128), 0.6)))
                           for _ in range(8)])
    dpo_p, dpo_r = [], []
    for _ in range(4):
        p = ids(512)
        dpo_p += [p, p]
        dpo_r += [ids(256), ids(256)]
    agent_p, agent_r, history = [], [], ids(64)
    for _ in range(8):
        turn = ids(128)
        agent_p.append(list(history))
        agent_r.append(turn)
        history = history + turn
    short_p, short_r = [], []
    for _ in range(4):
        p = ids(32)
        short_p += [p, p]
        short_r += [ids(512), ids(512)]
    return {"grpo": grpo, "dpo": (dpo_p, dpo_r), "agent": (agent_p, agent_r),
            "short": (short_p, short_r)}


class _PeakRSS:
    """Peak resident memory (GB) above the level at start, sampled every 5 ms (CUDA: the
    allocator's peak instead)."""

    def __enter__(self):
        import torch
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 1e9
            return self
        self.base = self.peak = _rss_gb()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _rss_gb())
            time.sleep(0.005)

    def __exit__(self, *exc):
        import torch
        if self.cuda:
            self.gb = torch.cuda.max_memory_allocated() / 1e9 - self.base
        else:
            self.running = False
            self.thread.join()
            self.gb = self.peak - self.base


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _engine(model_dir: str, sharing: bool):
    from types import SimpleNamespace

    import torch

    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config

    optim = SimpleNamespace(lr=1e-5, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    batching = BatchSettings(micro_batch_size=1, max_tokens_per_micro_batch=BUDGET,
                             packing=True, prefix_sharing=sharing)
    return TrainEngine.build(read_config(model_dir), optim, torch.float32, 1, batching,
                             weights_dir=model_dir)


def _run(model_dir: str, rows, sharing: bool) -> dict:
    """The three passes of one workload in one mode (module docstring)."""
    from types import SimpleNamespace

    import torch

    from engine.rl.collect.batch import RolloutBatch, build_sequences
    from engine.rl.policy.logprobs import attach_extra, compute_token_logprobs
    from engine.rl.policy.update import PolicyLossSettings, policy_update
    from parallel.tree_attention import PATHS_RUN

    engine = _engine(model_dir, sharing)
    paths_before = dict(PATHS_RUN)
    prompts, replies = rows
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(len(replies), generator=gen).tolist()
    batch = RolloutBatch(prompts, replies, [[0.0] * len(r) for r in replies], adv)
    seqs = build_sequences(batch)
    out = {}
    with _PeakRSS() as peak:
        t0 = time.perf_counter()
        table = compute_token_logprobs(engine, seqs, 1.0)
        t1 = time.perf_counter()
        ref = compute_token_logprobs(engine, seqs, 1.0)
        t2 = time.perf_counter()
        for name, values in (("old_logprobs", table), ("ref_logprobs", ref),
                             ("rollout_logprobs", table)):
            attach_extra(seqs, name, values)
        settings = PolicyLossSettings(vocab_size=engine.vocab_size, temperature=1.0,
                                      eps_low=0.2, eps_high=0.28, kl_beta=0.01)
        m = policy_update(engine, seqs, SimpleNamespace(agg_mode="token-mean",
                                                        count_empty_sequences=True),
                          settings, 1024)
        t3 = time.perf_counter()
    out.update(logprob_s=t1 - t0, reference_s=t2 - t1, update_s=t3 - t2, peak_gb=peak.gb,
               table=table, loss=m["policy/pg_loss"], grad_norm=m["grad_norm"],
               ratio=m["train/prefix_token_ratio"], tokens=sum(len(s.tokens) for s in seqs),
               attention={p: c - paths_before.get(p, 0) for p, c in PATHS_RUN.items()
                          if c > paths_before.get(p, 0)})
    engine.release()
    return out


def _best_pair(model_dir: str, rows, repeats: int) -> tuple[dict, dict]:
    """(unshared, shared): `_run` of each mode `repeats` times, alternating (a load that
    drifts over the minutes hits both modes alike); each pass's seconds and the peak the
    smallest (a loaded host's noise only ever adds); the other numbers of the last run."""
    runs: dict = {False: [], True: []}
    for _ in range(repeats):
        for sharing in (False, True):
            runs[sharing].append(_run(model_dir, rows, sharing))
    out = []
    for sharing in (False, True):
        best = dict(runs[sharing][-1])
        for key in ("logprob_s", "reference_s", "update_s", "peak_gb"):
            best[key] = min(r[key] for r in runs[sharing])
        out.append(best)
    return out[0], out[1]


def run_prefix_sharing(quick: bool) -> BenchResult:
    """Every workload shared and unshared in this process (module docstring)."""
    import torch

    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel
    from tools.tiny_models import build_tiny_model

    init_distributed()   # a 1-process group of its own unless launched (a free port)
    setup_model_parallel(ParallelLayout(1))
    spec = QUICK_MODEL if quick else MODEL
    repeats = 1 if quick else 3
    rows, summary = [], {"prefix_sharing_quick": quick,
                         "prefix_sharing_device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory(prefix="bench_prefix_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, initializer_range=0.05, **spec)
        work = _workloads(spec["vocab_size"], 0.25 if quick else 1.0)
        _run(model_dir, work["agent"], True)   # warm-up (allocator, kernels), not reported
        for name, batch in work.items():
            off, on = _best_pair(model_dir, batch, repeats)
            total_off = off["logprob_s"] + off["reference_s"] + off["update_s"]
            total_on = on["logprob_s"] + on["reference_s"] + on["update_s"]
            speed = total_off / total_on
            lp = float((on["table"] - off["table"]).abs().max())
            loss_rel = abs(on["loss"] - off["loss"]) / max(abs(off["loss"]), 1e-12)
            gn_rel = abs(on["grad_norm"] - off["grad_norm"]) / max(off["grad_norm"], 1e-12)
            summary[f"prefix_sharing_{name}"] = dict(
                speedup=speed, ratio=on["ratio"], tokens=off["tokens"],
                off={k: off[k] for k in ("logprob_s", "reference_s", "update_s", "peak_gb")},
                on={k: on[k] for k in ("logprob_s", "reference_s", "update_s", "peak_gb")},
                logprob_max_abs=lp, loss_rel=loss_rel, grad_norm_rel=gn_rel,
                attention=on["attention"],
                goal=GOALS[name], met=speed >= GOALS[name])
            for mode, r in (("unshared", off), ("shared", on)):
                rows.append([name, mode, str(r["tokens"]), fmt(r["ratio"], 3),
                             fmt(r["logprob_s"], 2), fmt(r["reference_s"], 2),
                             fmt(r["update_s"], 2), fmt(r["peak_gb"], 2)])
            rows.append([name, "shared / unshared", "", "", "", "", f"x{fmt(speed, 2)} faster",
                         f"lp {lp:.1e}, loss {loss_rel:.1e}, gn {gn_rel:.1e}; attention "
                         + (", ".join(sorted(on["attention"])) or "unshared")])
    head = ["workload", "mode", "tokens (rows)", "token ratio", "log-prob s", "reference s",
            "update s", "peak RSS +GB"]
    notes = [f"Qwen3-shaped fp32, hidden {spec['hidden']}, {spec['layers']} layers, vocabulary "
             f"{spec['vocab_size']:,}; 1 process, torch threads {torch.get_num_threads()}; "
             f"micro-batches <= {BUDGET} tokens (packed). Goals (log-prob + reference + "
             "update time): grpo >= 3x, dpo >= 1.3x, agent >= 3x, short >= 0.97x. Last row "
             "per workload: largest |log-prob| difference, loss and grad-norm relative "
             "differences between the modes, and the tree attention the shared mode ran "
             "(parallel.tree_attention.PATHS_RUN: flex on CUDA; split / per_run on the CPU)."]
    return BenchResult([Table("Prefix sharing: shared vs unshared, same batches", head, rows,
                              notes=notes)], summary)
