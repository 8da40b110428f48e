"""The run loop shared by SFT and RL: resume, steps, metrics, progress, checkpoints, stop.

`RunLoop.run(step_fn)` calls `step_fn(step)` for every remaining step and owns everything
around it: the metrics logger (metrics.jsonl, TensorBoard and the experiment trackers that
`prepare` started, rank 0), the eval line of a step that evaluated (print_eval), the progress
bar, the non-finite divergence check after logging, the stop monitor, the save-due rule and the save (with the caller's checkpoint `extra`). `build_or_resume` is the resume preamble: it builds the
TrainEngine fresh from HF weights or loads the newest checkpoint into it.

When a run saves and stops is decided the same way on every rank: `StopMonitor.should_stop`
says whether the run stops before train.max_steps after the current step; `checkpoint_due`
whether that step is saved (checkpoint.save_interval, or on exit with checkpoint.save_on_exit);
`prepare_resumed_run` handles a run that resumed at step `start`.

Signals: SIGTERM (cluster preemption; torchrun forwards it to its workers), SIGUSR1 (e.g.
`sbatch --signal=USR1@120`) and SIGINT (Ctrl-C) all mean "finish the current step, save, exit
0". A second SIGINT more than `ABORT_AFTER_S` seconds after the first aborts at once
(KeyboardInterrupt): the repeat inside that window is the same Ctrl-C arriving twice, once from
the terminal and once forwarded by torchrun."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Optional

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from engine.checkpoint.hf_export import ExportExtras
from engine.checkpoint.io import CheckpointError, iteration_dir, rewind_jsonl
from engine.checkpoint.checkpointing import (DataPosition, load_training_checkpoint, read_checkpoint_info,
                                  save_training_checkpoint, select_resume_checkpoint)
from engine.config.schema import config_yaml
from engine.run.metrics import LinesAboveBar, MetricsLogger, format_postfix, progress_bar
from engine.run.trackers import close_trackers, open_trackers
from engine.training.train_engine import TrainEngine
from models.families.mtp import with_trained_mtp
from parallel.cpu_runtime import device


class StopMonitor:
    """Decides, identically on every rank, whether the run stops after the current step.

    Reasons: SIGTERM, SIGUSR1 or SIGINT received by any rank (handlers installed on
    construction, restored by `close`), `exit_interval` (stop after a step number that is a multiple of it),
    `exit_duration_mins` (wall time since construction, in minutes). `should_stop` is collective
    when torch.distributed is initialised (one all-reduce MAX of a 1-element tensor).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    ABORT_AFTER_S = 5.0

    def __init__(self, exit_interval: Optional[int] = None,
                 exit_duration_mins: Optional[float] = None):
        self.exit_interval = exit_interval
        self.exit_duration_mins = exit_duration_mins
        self.start = time.monotonic()
        self.signalled: Optional[int] = None
        self.silent = False   # a failed run: a signal is only recorded (RunLoop.run)
        self._signalled_at = 0.0
        self._previous = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: leave signals alone
                break

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if (signum == signal.SIGINT and self.signalled == signal.SIGINT
                and now - self._signalled_at > self.ABORT_AFTER_S):
            raise KeyboardInterrupt
        if self.signalled is None:
            self.signalled, self._signalled_at = signum, now
            if os.environ.get("RANK", "0") == "0" and not self.silent:
                print(f"[stop] {signal.Signals(signum).name} received: finishing the current step, "
                      "then saving and exiting" + (" (Ctrl-C again to abort)"
                                                   if signum == signal.SIGINT else ""),
                      flush=True)

    def should_stop(self, steps_done: int) -> Optional[str]:
        """The reason to stop after `steps_done` steps (same on every rank), or None."""
        code = 0
        if self.signalled is not None:
            code = 3
        elif (self.exit_duration_mins is not None
              and time.monotonic() - self.start >= 60.0 * self.exit_duration_mins):
            code = 2
        elif self.exit_interval and steps_done % self.exit_interval == 0:
            code = 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return {0: None, 1: f"train.exit_interval={self.exit_interval}",
                2: f"train.exit_duration_mins={self.exit_duration_mins}",
                3: "exit signal received"}[code]

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def checkpoint_due(ck, done: int, max_steps: int, stop: Optional[str]) -> bool:
    """Whether to save after `done` steps: a checkpoint.dir is set and the step is a multiple
    of checkpoint.save_interval, or the run ends here (max_steps or `stop`) with
    checkpoint.save_on_exit. `ck` is a CheckpointConfig."""
    periodic = bool(ck.save_interval) and done % ck.save_interval == 0
    on_exit = ck.save_on_exit and (stop is not None or done == max_steps)
    return bool(ck.dir) and (periodic or on_exit)


def prepare_resumed_run(tag: str, start: int, max_steps: int, log_dir: Optional[str],
                        log_names: tuple[str, ...]) -> bool:
    """For a run continuing after `start` steps: False (rank 0 says so) when nothing is left
    to do; otherwise rank 0 trims the JSON-lines logs `log_names` in `log_dir` to `start`
    (the steps after the checkpoint run again) and it returns True."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if start >= max_steps:
        if rank0:
            print(f"[{tag}] nothing to do: {start} steps done, train.max_steps={max_steps}",
                  flush=True)
        return False
    if rank0 and start > 0 and log_dir:
        for name in log_names:
            rewind_jsonl(os.path.join(log_dir, name), start)
    return True


def print_eval(tag: str, done: int, metrics: dict) -> None:
    """The step's evaluation metrics (`eval/*`, e.g. eval/loss every train.eval_interval
    steps) as one run-log line, "[sft] step 40: eval/loss 1.2345", progress bar or not (above
    the bar when it is drawn: RunLoop.run's LinesAboveBar)."""
    evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
    if evals:
        print(f"[{tag}] step {done}: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in evals.items()),
            flush=True)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def build_or_resume(cfg, build: Callable[[bool], TrainEngine], position: DataPosition,
                    batch_key: str = "train.global_batch_size"
                    ) -> tuple[TrainEngine, DataPosition, dict]:
    """Collective resume preamble. `build(load_weights)` makes the TrainEngine; when
    checkpoint.resume finds a checkpoint in checkpoint.dir, it is built without HF weights and
    the checkpoint (model, optimizer, scheduler per checkpoint.schedule, RNG at the same
    layout) is loaded into it.
    Returns (engine, the data position to continue from, the checkpoint's `extra` or {}).
    Raises CheckpointError / ResumeMismatchError (`position` describes this run; `batch_key`
    names its batch-size key in that message)."""
    resume_from = select_resume_checkpoint(cfg.checkpoint.resume, cfg.checkpoint.dir)
    engine = build(resume_from is None)
    if resume_from is None:
        return engine, position, {}
    saved = load_training_checkpoint(engine, resume_from, position, batch_key=batch_key,
                                     schedule=cfg.checkpoint.schedule)
    return engine, saved, read_checkpoint_info(resume_from)["extra"]


def resume_side_engines(cfg, engines: dict[str, tuple[TrainEngine, dict]],
                        position: DataPosition, batch_key: str) -> None:
    """Collective: after the main engine resumed at `position.step` steps, load each side
    engine's checkpoint of the same step from checkpoint.dir/<name>/ (RunLoop saves them
    first, so one exists whenever the main checkpoint does; CheckpointError otherwise)."""
    for name, (engine, _) in engines.items():
        path = iteration_dir(os.path.join(cfg.checkpoint.dir, name), position.step)
        if not path.is_dir():
            raise CheckpointError(f"{path} is missing: the {name} of the checkpoint at step "
                                  f"{position.step} in checkpoint.dir={cfg.checkpoint.dir}")
        load_training_checkpoint(engine, path, position, batch_key=batch_key,
                                 schedule=cfg.checkpoint.schedule)


@dataclass
class RunLoop:
    """Steps `start`+1 .. train.max_steps of one run, on every rank.

    `position(done)` is the DataPosition after `done` steps; `extra()` (collective, same value
    on every rank) the checkpoint's `extra`; `log_names` the JSON-lines logs trimmed on
    resume; `postfix(metrics)` extra progress-bar fields. `cfg` supplies train.max_steps,
    train.exit_interval, train.exit_duration_mins, checkpoint.*, logging.* and is saved as the
    checkpoint's config.yaml."""

    tag: str                    # message prefix ("sft", "rl")
    cfg: object
    engine: TrainEngine
    hf_config: dict
    position: Callable[[int], DataPosition]
    extra: Callable[[], dict] | None = None
    log_names: tuple[str, ...] = ("metrics.jsonl",)
    postfix: Callable[[dict], dict] = field(default=lambda metrics: {})
    desc: str | None = None     # progress-bar label (default: tag)
    # trained models beside `engine` (RL's PPO critic) with the HF config their checkpoints
    # carry: saved with every checkpoint, before it, under checkpoint.dir/<name>/ (resume:
    # resume_side_engines)
    side_engines: dict[str, tuple[TrainEngine, dict]] = field(default_factory=dict)
    # what the run adds to the main engine's checkpoint.save_hf folder (a reward model's
    # scoring files: engine.rm.export.hf_extras); None: convert's common export
    hf_extras: ExportExtras | None = None

    def prepare(self, start: int) -> bool:
        """Before building anything else: False (rank 0 says so) when `start` steps leave
        nothing to do; else the logs are trimmed to `start` (prepare_resumed_run) and the
        experiment trackers are started (collective; engine.run.trackers.open_trackers: a
        tracker that cannot start raises TrackerStartError on every rank). `run` ends them."""
        if not prepare_resumed_run(self.tag, start, self.cfg.train.max_steps,
                                   self.cfg.logging.dir, self.log_names):
            return False
        open_trackers(self.cfg, start, self.tag)
        return True

    def print_done(self, start: int, history: list[dict]) -> None:
        """Rank 0's closing line of a run that stepped from `start`: the steps done of
        train.max_steps, the first and last step's `loss` (nothing when no step ran here)."""
        if history and _rank0():
            print(f"[{self.tag}] done: {start + len(history)} of {self.cfg.train.max_steps} "
                  f"steps, first loss {history[0]['loss']:.4f}, last loss "
                  f"{history[-1]['loss']:.4f}", flush=True)

    def run(self, start: int, step_fn: Callable[[int], dict]) -> list[dict]:
        """Run `step_fn(step)` (0-based; returns the step's metrics) from `start` (after
        `prepare`) until train.max_steps or a stop reason; log, checkpoint and stop as the
        module docstring says. Returns the metrics of the steps run here."""
        cfg, max_steps = self.cfg, self.cfg.train.max_steps
        rank0 = _rank0()
        logger = MetricsLogger(cfg.logging.dir, enabled=rank0)
        bar = progress_bar(max_steps, enabled=rank0 and cfg.logging.progress_bar,
                           desc=self.desc or self.tag, initial=start)
        monitor = StopMonitor(cfg.train.exit_interval, cfg.train.exit_duration_mins)
        yaml = config_yaml(cfg)
        history, finished = [], False
        # lines printed during the run (checkpoint saves, stops) go above the bar, not on it
        try:
            with contextlib.redirect_stdout(LinesAboveBar(bar, sys.stdout)):
                for step in range(start, max_steps):
                    metrics = step_fn(step)
                    done = step + 1
                    logger.log(done, metrics)
                    history.append(metrics)
                    if rank0:
                        print_eval(self.tag, done, metrics)
                    bar.update(1)
                    bar.set_postfix({**format_postfix(metrics), **self.postfix(metrics)})
                    self.engine.guard.raise_if_diverged()  # after logging: bad steps are logged
                    stop = monitor.should_stop(done) if done < max_steps else None
                    if checkpoint_due(cfg.checkpoint, done, max_steps, stop):
                        self._save(done, yaml)
                    if stop is not None:
                        if rank0:
                            print(f"[{self.tag}] stopping after step {done}: {stop}", flush=True)
                        break
            finished = True
        finally:
            # On an error the stop handlers stay until the process ends: torchrun answers a
            # failed peer (a dead rollout rank) by sending SIGTERM to every rank, and the
            # default handler would kill this one before the entry point prints the error.
            if finished:
                monitor.close()
            else:
                monitor.silent = True
            bar.close()
            logger.close()
            close_trackers(failed=not finished)
        return history

    def _save(self, done: int, yaml: str) -> None:
        ck = self.cfg.checkpoint
        for name, (engine, hf_config) in self.side_engines.items():  # first: main one last
            save_training_checkpoint(engine, os.path.join(ck.dir, name), self.position(done),
                                     hf_config, self.cfg.model.hf_path, ck.keep_last, yaml,
                                     save_hf=ck.save_hf)
        extra = self.extra() if self.extra is not None else None
        # the run's config (a reward model's is its classifier's), marked when the engine
        # trains the MTP layer (models.families.mtp: bridge.json records it)
        hf_config = (with_trained_mtp(self.hf_config) if self.engine.mtp is not None
                     else self.hf_config)
        path = save_training_checkpoint(self.engine, ck.dir, self.position(done), hf_config,
                                        self.cfg.model.hf_path, ck.keep_last, yaml, extra=extra,
                                        save_hf=ck.save_hf, hf_extras=self.hf_extras)
        if _rank0():
            print(f"[checkpoint] saved {path}", flush=True)
