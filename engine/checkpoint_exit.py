"""When a training loop (SFT or RL) saves and stops, decided the same way on every rank.

`StopMonitor.should_stop` says whether the run stops before train.max_steps after the current
step; `checkpoint_due` whether that step is saved (checkpoint.save_interval, or on exit with
checkpoint.save_on_exit); `prepare_resumed_run` handles a run that resumed at step `start`.

Signals: SIGTERM (cluster preemption; torchrun forwards it to its workers), SIGUSR1 (e.g.
`sbatch --signal=USR1@120`) and SIGINT (Ctrl-C) all mean "finish the current step, save, exit
0". A second SIGINT more than `ABORT_AFTER_S` seconds after the first aborts at once
(KeyboardInterrupt): the repeat inside that window is the same Ctrl-C arriving twice, once from
the terminal and once forwarded by torchrun."""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist


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
            if os.environ.get("RANK", "0") == "0":
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
            from parallel.cpu_runtime import device

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
    from engine.checkpoint_io import rewind_jsonl

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
