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
(train/prefix_token_ratio), each pass's median seconds, the largest peak RSS increase over a
workload's passes (sampled every 5 ms), the largest differences of the log-prob table, loss and
grad norm between the modes (each engine's first run: both from the same weights), and which tree
attention the shared mode ran (`attention`: calls per path of parallel.tree_attention; on a
GPU one FlexAttention call per layer and micro-batch).

Timing: each mode's engine is built once per workload; the three passes then run REPEATS times
(4; `--quick` 2), the modes interleaved pass by pass (each pass of one mode right after or
before the same pass of the other, the first mode alternating by repeat, so each goes first
in half of them) so that the host's load at any moment hits both (one untimed run of each mode
before the first workload). A repeat's speed-up is the unshared passes' seconds over the
shared ones' of that repeat; reported: their median (the `speedup`) and spread (`spread`:
smallest and largest; `speedups`: all). The goal is judged against the spread (`judge`): met
when the smallest speed-up reaches it, missed when the largest stays under it, and otherwise
neither (`met` null, "within the spread": the noise decides; rerun on a quieter host or with
more repeats). `--quick` (the CI size): a 2-layer
model, workloads a quarter long, 2 repeats; the goals are the full size's, so its verdicts say
only how that small size compares.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time

from tools.bench.common import BenchResult, Table, constant_adam, fmt, median

MODEL = dict(vocab_size=4096, hidden=256, layers=8, heads=8, kv_heads=2, intermediate=768,
             head_dim=32, max_position_embeddings=4096)
QUICK_MODEL = dict(MODEL, layers=2, hidden=128, intermediate=384, head_dim=16)
BUDGET = 4096                 # train.max_tokens_per_micro_batch, both modes
GOALS = {"grpo": 3.0, "dpo": 1.3, "agent": 3.0, "short": 0.97}
# timed repeats per mode and workload, full and --quick: even, each mode goes first in half
REPEATS = {False: 4, True: 2}


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
    import torch

    from engine.training.train_engine import BatchSettings, TrainEngine
    from models.hf.io import read_config

    optim = constant_adam(1e-5)
    batching = BatchSettings(micro_batch_size=1, max_tokens_per_micro_batch=BUDGET,
                             packing=True, prefix_sharing=sharing)
    return TrainEngine.build(read_config(model_dir), optim, torch.float32, 1, batching,
                             weights_dir=model_dir)


class _Mode:
    """One mode's engine on one workload: `start` makes fresh sequences of the rows, then
    `run(name)` runs one of the three passes (PASSES, in order) and records its seconds and
    peak; `result` holds them with the numbers compared between the modes."""

    def __init__(self, engine, rows):
        import torch

        self.engine, self.rows = engine, rows
        self.adv = torch.randn(len(rows[1]), generator=torch.Generator().manual_seed(0)).tolist()

    def start(self) -> None:
        from engine.rl.collect.batch import RolloutBatch, build_sequences
        from parallel.tree_attention import PATHS_RUN

        prompts, replies = self.rows
        self.seqs = build_sequences(RolloutBatch(prompts, replies,
                                                 [[0.0] * len(r) for r in replies], self.adv))
        self.paths_before = dict(PATHS_RUN)
        self.result = {"peak_gb": 0.0, "tokens": sum(len(s.tokens) for s in self.seqs)}

    def run(self, name: str) -> None:
        with _PeakRSS() as peak:
            t0 = time.perf_counter()
            getattr(self, "_" + name)()
            seconds = time.perf_counter() - t0
        self.result[name] = seconds
        self.result["peak_gb"] = max(self.result["peak_gb"], peak.gb)

    def _logprob_s(self) -> None:
        from engine.rl.policy.logprobs import compute_token_logprobs

        self.result["table"] = compute_token_logprobs(self.engine, self.seqs, 1.0)

    def _reference_s(self) -> None:
        from engine.rl.policy.logprobs import compute_token_logprobs

        self.ref = compute_token_logprobs(self.engine, self.seqs, 1.0)

    def _update_s(self) -> None:
        from types import SimpleNamespace

        from engine.rl.policy.logprobs import attach_extra
        from engine.rl.policy.update import PolicyLossSettings, policy_update
        from parallel.tree_attention import PATHS_RUN

        table = self.result["table"]
        for name, values in (("old_logprobs", table), ("ref_logprobs", self.ref),
                             ("rollout_logprobs", table)):
            attach_extra(self.seqs, name, values)
        settings = PolicyLossSettings(vocab_size=self.engine.vocab_size, temperature=1.0,
                                      eps_low=0.2, eps_high=0.28, kl_beta=0.01)
        m = policy_update(self.engine, self.seqs, SimpleNamespace(
            agg_mode="token-mean", count_empty_sequences=True), settings, 1024)
        self.result.update(loss=m["policy/pg_loss"], grad_norm=m["grad_norm"],
                           ratio=m["train/prefix_token_ratio"],
                           attention={p: c - self.paths_before.get(p, 0)
                                      for p, c in PATHS_RUN.items()
                                      if c > self.paths_before.get(p, 0)})


PASSES = ("logprob_s", "reference_s", "update_s")


def _repeats(model_dir: str, rows, repeats: int, warm_up: bool) -> tuple[list, list]:
    """(unshared runs, shared runs): each mode's engine built once, then the three passes
    `repeats` times, the modes interleaved pass by pass (a repeat runs the log-prob pass of
    both modes, then the reference of both, then the update of both; which mode goes first
    alternates by repeat), so that the host's load at any moment hits both alike. The first
    run of each engine is the one whose numbers are compared (both from the same weights).
    `warm_up`: one untimed run of each mode first (the allocator's and kernels' first calls;
    then the compared run)."""
    modes = {sharing: _Mode(_engine(model_dir, sharing), rows) for sharing in (False, True)}
    runs: dict = {False: [], True: []}
    try:
        for k in range(repeats + int(warm_up)):
            order = (False, True) if k % 2 == 0 else (True, False)
            for sharing in order:
                modes[sharing].start()
            for name in PASSES:
                for sharing in order:
                    modes[sharing].run(name)
            for sharing in order:
                runs[sharing].append(modes[sharing].result)
    finally:
        for mode in modes.values():
            mode.engine.release()
    return runs[False], runs[True]


def judge(ratios: list[float], goal: float) -> bool | None:
    """Whether a workload meets its goal, judged against the spread of its repeats' speed-ups
    (module docstring): True when the smallest reaches the goal, False when the largest stays
    under it, None when the goal lies within the spread (the host's noise decides)."""
    if min(ratios) >= goal:
        return True
    if max(ratios) < goal:
        return False
    return None


def run_prefix_sharing(quick: bool) -> BenchResult:
    """Every workload shared and unshared in this process (module docstring)."""
    import torch

    from parallel.layout import ParallelLayout
    from parallel.process_groups import init_distributed, setup_model_parallel
    from tools.tiny_models import build_tiny_model

    init_distributed()   # a 1-process group of its own unless launched (a free port)
    setup_model_parallel(ParallelLayout(1))
    spec = QUICK_MODEL if quick else MODEL
    repeats = REPEATS[quick]
    rows, summary = [], {"prefix_sharing_quick": quick,
                         "prefix_sharing_device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory(prefix="bench_prefix_") as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), "qwen3", tokenizer=False,
                                     seed=0, initializer_range=0.05, **spec)
        work = _workloads(spec["vocab_size"], 0.25 if quick else 1.0)
        for n, (name, batch) in enumerate(work.items()):
            offs, ons = _repeats(model_dir, batch, repeats, warm_up=n == 0)
            off, on = offs[0], ons[0]   # the compared numbers: each engine's first run
            offs, ons = offs[-repeats:], ons[-repeats:]   # the timed ones
            ratios = [sum(a[k] for k in PASSES) / sum(b[k] for k in PASSES)
                      for a, b in zip(offs, ons)]
            speed, met = median(ratios), judge(ratios, GOALS[name])
            lp = float((on["table"] - off["table"]).abs().max())
            loss_rel = abs(on["loss"] - off["loss"]) / max(abs(off["loss"]), 1e-12)
            gn_rel = abs(on["grad_norm"] - off["grad_norm"]) / max(off["grad_norm"], 1e-12)
            seconds = {mode: {k: median([r[k] for r in runs]) for k in PASSES}
                       | {"peak_gb": max(r["peak_gb"] for r in runs)}
                       for mode, runs in (("off", offs), ("on", ons))}
            summary[f"prefix_sharing_{name}"] = dict(
                speedup=speed, speedups=ratios, spread=[min(ratios), max(ratios)],
                ratio=on["ratio"], tokens=off["tokens"], **seconds,
                logprob_max_abs=lp, loss_rel=loss_rel, grad_norm_rel=gn_rel,
                attention=on["attention"], goal=GOALS[name], met=met)
            for mode, r in (("unshared", off), ("shared", on)):
                t = seconds["off" if mode == "unshared" else "on"]
                rows.append([name, mode, str(r["tokens"]), fmt(r["ratio"], 3),
                             fmt(t["logprob_s"], 2), fmt(t["reference_s"], 2),
                             fmt(t["update_s"], 2), fmt(t["peak_gb"], 2)])
            verdict = {True: "met", False: "MISSED", None: "within the spread"}[met]
            rows.append([name, "shared / unshared", "", "", "",
                         f"x{fmt(speed, 2)} [{fmt(min(ratios), 2)}-{fmt(max(ratios), 2)}]",
                         f">= {GOALS[name]}: {verdict}",
                         f"lp {lp:.1e}, loss {loss_rel:.1e}, gn {gn_rel:.1e}; attention "
                         + (", ".join(sorted(on["attention"])) or "unshared")])
    head = ["workload", "mode", "tokens (rows)", "token ratio", "log-prob s", "reference s",
            "update s", "peak RSS +GB"]
    notes = [f"Qwen3-shaped fp32, hidden {spec['hidden']}, {spec['layers']} layers, vocabulary "
             f"{spec['vocab_size']:,}; 1 process, torch threads {torch.get_num_threads()}; "
             f"micro-batches <= {BUDGET} tokens (packed). Goals (log-prob + reference + "
             "update time): grpo >= 3x, dpo >= 1.3x, agent >= 3x, short >= 0.97x. Seconds: "
             f"medians of {repeats} repeats, the modes interleaved. Last row per workload: the "
             "median speed-up [smallest-largest], the goal judged against that spread (met: "
             "the smallest reaches it; MISSED: the largest stays under it; else within the "
             "spread), the largest |log-prob| difference, loss and grad-norm relative "
             "differences between the modes, and the tree attention the shared mode ran "
             "(parallel.tree_attention.PATHS_RUN: flex on CUDA; split / per_run on the CPU)."]
    return BenchResult([Table("Prefix sharing: shared vs unshared, same batches", head, rows,
                              notes=notes)], summary)
