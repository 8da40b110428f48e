"""The process pool of `reward.num_workers` that scores reward calls (docs/rewards.md).

Each worker is a fresh interpreter (engine.rl.rewards.worker) in a session of its own, started
once and kept across steps. Each worker gets up to DEPTH calls ahead of its answers; a call's
clock (`timeout_s`) starts when the one before it was answered. A call past it has its
worker's process group killed and the worker replaced, as has a worker that dies mid-call (a
crash, an exit, the OOM killer): the item fails (its Outcome names the kind; it scores
`failure_score`, NaN when that is None: engine.rl.rewards.outcome), the worker's later calls
go back to the queue and the others go on. A replacement worker that cannot start (the
reward module no longer imports, no process can be started) stops the pool: every wait()
then raises RuntimeError naming the cause, never blocks.

Scores equal serial scoring exactly: every item is one call of the same function on the same
arguments, in whichever worker.

Use: ``pool.submit(key, item)`` as items are ready (replies finishing during generation), then
``pool.wait(keys)``; or ``pool.score(items)`` for a whole batch. A service thread in the
caller's process reads results, enforces deadlines and dispatches queued items meanwhile, so
the pool works while the caller generates.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any, Hashable

from engine.rl.rewards.cpus import default_num_workers
from engine.rl.rewards.outcome import Outcome, ScoreReport, failed_score
from engine.rl.rewards.registry import RewardFn, check_picklable
from engine.rl.rewards.scoring import check_items
from engine.rl.rewards.worker_process import WorkerProcess

__all__ = ["DEPTH", "Outcome", "RewardPool", "STARTUP_TIMEOUT_S", "ScoreReport",
           "default_num_workers"]

logger = logging.getLogger(__name__)

DEPTH = 2                  # calls sent to a worker ahead of its answers
STARTUP_TIMEOUT_S = 120.0  # a worker that has not loaded the function by then is an error


class RewardPool:
    """Worker processes scoring ``fn`` (module docstring).

    Args:
        fn: the reward function; it must pickle (engine.rl.rewards.check_picklable).
        num_workers: processes (>= 1); None: default_num_workers().
        timeout_s: per call, from its start; None: unbounded.
        failure_score: the score of an item that raised, returned a non-finite value, crashed
            its worker or timed out; None: NaN (no score; its Outcome names the failure).
    """

    def __init__(self, fn: RewardFn, num_workers: int | None = None,
                 timeout_s: float | None = 30.0, failure_score: float | None = None) -> None:
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        if self.num_workers < 1 or (timeout_s is not None and timeout_s <= 0):
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0 or None, got "
                             f"{num_workers}, {timeout_s}")
        check_picklable(fn, getattr(fn, "__qualname__", type(fn).__name__))
        self.fn_bytes = pickle.dumps(fn)
        self.timeout_s, self.failure_score = timeout_s, failure_score
        self._failed = failed_score(failure_score)
        t0 = time.perf_counter()
        self.workers = [WorkerProcess(self.fn_bytes) for _ in range(self.num_workers)]
        self.queue: deque[tuple[Hashable, Mapping[str, Any]]] = deque()
        self.done: dict[Hashable, Outcome] = {}
        self.replaced = 0
        self._cond = threading.Condition()   # guards the state above (two threads use it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self.broken: str | None = None      # why the pool stopped (a replacement failed)
        # at close, garbage collection or exit: kill the workers, wake the thread to end
        self._closer = weakref.finalize(self, _shut_down, self.workers, self._wake_w)
        try:
            self._await_ready(self.workers)
        except RuntimeError:
            self._closer()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self.startup_s = time.perf_counter() - t0
        # reads results, replaces dead or late workers and dispatches queued items while the
        # caller does other work (generation): the pool makes progress between calls
        # (it holds the pool weakly, so a pool nobody holds is collected and its workers end)
        self._service = threading.Thread(target=_serve, args=(weakref.ref(self),),
                                         name="reward-pool", daemon=True)
        self._service.start()

    def submit(self, key: Hashable, item: Mapping[str, Any]) -> None:
        """Queue one item under ``key`` and hand it to an idle worker if there is one;
        RuntimeError naming the cause once the pool stopped (module docstring)."""
        check_items([item])
        with self._cond:
            self._check_running()
            self.queue.append((key, item))
            self._dispatch()

    def knows(self, key: Hashable) -> bool:
        """Whether ``key`` was submitted and not forgotten since."""
        with self._cond:
            return key in self.done or any(k == key for k, _ in self.queue) or any(
                t[0] == key for w in self.workers for t in w.tasks)

    def wait(self, keys: Iterable[Hashable]) -> list[Outcome]:
        """The outcomes of ``keys`` in their order (a key may repeat), waiting for the ones
        still running; they stay until ``forget``. RuntimeError naming the cause when the
        pool stopped before they were scored (module docstring)."""
        keys = list(keys)
        with self._cond:
            while any(k not in self.done for k in keys):
                self._check_running()
                self._cond.wait()
            return [self.done[k] for k in keys]

    def forget(self, keys: Iterable[Hashable] | None = None, keep: set = frozenset()) -> None:
        """Drop the results of ``keys`` (None: every finished one) but those in ``keep``."""
        with self._cond:
            for key in [k for k in (list(self.done) if keys is None else keys) if k not in keep]:
                self.done.pop(key, None)

    def score(self, items: Sequence[Mapping[str, Any]]) -> ScoreReport:
        """Score a whole batch: its report, scores in item order."""
        check_items(items)
        keys = [("batch", id(items), i) for i in range(len(items))]
        with self._cond:
            self._check_running()
            self.queue.extend(zip(keys, items))
            self._dispatch()
        report = ScoreReport.of(self.wait(keys))
        self.forget(keys)
        if report.errors:
            logger.warning("reward function failed on %d of %d items (%d timed out, %d crashed "
                           "their worker); first: %s", report.errors, len(items),
                           report.timeouts, report.failures, report.details[0])
        return report

    def close(self) -> None:
        """Stop the service thread and kill every worker (also done when the pool is collected
        or at exit)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._closer()
        self._service.join()

    def watch(self) -> tuple[list[WorkerProcess], float | None] | None:
        """The service thread's next wait: the busy workers and the seconds to the next
        deadline (None: none); None once the pool is closed."""
        with self._cond:
            if self._closed:
                return None
            busy = [w for w in self.workers if w.tasks]
            deadline = self._next_deadline(busy) if busy else None
        return busy, None if deadline is None else max(0.0, deadline - time.monotonic())

    def handle(self, busy: list[WorkerProcess], ready: list) -> None:
        """After the service thread's wait: results of the `ready` workers, deaths, timeouts;
        then dispatch and notify the waiters."""
        with self._cond:
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            for worker in busy:
                if worker.outbox in ready and worker.tasks and worker in self.workers:
                    self._receive(worker)
            self._expire(busy)
            self._dispatch()
            self._cond.notify_all()

    def _expire(self, busy: list[WorkerProcess]) -> None:
        """Replace the workers whose call ran past timeout_s."""
        now = time.monotonic()
        for worker in busy:
            if (worker.tasks and worker in self.workers and self.timeout_s is not None
                    and now - worker.tasks[0][2] >= self.timeout_s):
                self._replace(worker, Outcome(self._failed, "timeout",
                                              f"timed out after {self.timeout_s:g} s"))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:   # already pending
            pass

    def _next_deadline(self, busy: list[WorkerProcess]) -> float | None:
        return None if self.timeout_s is None else min(w.tasks[0][2] for w in busy) + self.timeout_s

    def _receive(self, worker: WorkerProcess) -> None:
        """The worker's answer to its first task (the next one starts now), or its death."""
        key = worker.tasks[0][0]
        try:
            kind, _, value = worker.outbox.recv()
        except (EOFError, OSError):
            code = worker.proc.wait()
            self._replace(worker, Outcome(self._failed, "crash",
                                          f"the worker died (exit status {code})"))
            return
        now = time.monotonic()
        seconds = now - worker.tasks.popleft()[2]
        outcome = (Outcome(float(value), seconds=seconds) if kind == "ok"
                   else Outcome(self._failed, "error", str(value), seconds))
        self.done[key] = outcome
        if worker.tasks:
            worker.tasks[0][2] = now

    def _replace(self, worker: WorkerProcess, outcome: Outcome) -> None:
        """Record the failed (first) item, queue the worker's later ones again (not started),
        kill the worker and start a fresh one in its place. A fresh one that cannot start
        stops the pool (`_stop`): the waiters raise instead of waiting for ever."""
        key, _, start = worker.tasks.popleft()
        outcome.seconds = time.monotonic() - start
        self.done[key] = outcome
        self.queue.extendleft((k, item) for k, item, _ in reversed(worker.tasks))
        worker.tasks.clear()
        worker.kill()
        try:
            fresh = WorkerProcess(self.fn_bytes)
        except OSError as exc:   # no process can be started (fork limit, memory)
            self._stop(f"a replacement reward worker could not be started: {exc!r}")
            return
        self.workers[self.workers.index(worker)] = fresh
        self.replaced += 1
        try:
            self._await_ready([fresh])
        except RuntimeError as exc:
            self._stop(f"a replacement for a reward worker whose call failed ({outcome.failure}: "
                       f"{outcome.detail}) did not start: {exc}")

    def _stop(self, reason: str) -> None:
        """Stop scoring (the caller holds the lock): kill every worker, drop the queue and wake
        every waiter, whose wait() raises RuntimeError naming `reason`."""
        self.broken = reason
        logger.error("reward pool stopped: %s", reason)
        for w in self.workers:
            if not w.inbox.closed:
                w.kill()
            w.tasks.clear()
        self.workers.clear()
        self.queue.clear()
        self._cond.notify_all()

    def _check_running(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"reward scoring stopped: {self.broken}")

    def _dispatch(self) -> None:
        """Queued items to the workers, up to DEPTH unanswered each, so a worker starts its
        next call without waiting for this process to read its answer (the caller holds the
        lock); wakes the service thread to watch them."""
        sent = False
        for depth in range(1, DEPTH + 1):
            for worker in list(self.workers):
                if self.queue and len(worker.tasks) < depth and worker in self.workers:
                    sent = True
                    key, item = self.queue.popleft()
                    worker.tasks.append([key, item, time.monotonic()])
                    try:
                        worker.inbox.send((key, dict(item)))
                    except (BrokenPipeError, OSError):
                        self._replace(worker, Outcome(self._failed, "crash",
                                                      "the worker died before the call"))
        if sent:
            self._wake()

    def _await_ready(self, workers: list[WorkerProcess]) -> None:
        """Wait for each worker's "ready"; RuntimeError with the reason if one cannot load the
        function."""
        for worker in workers:
            if not worker.outbox.poll(STARTUP_TIMEOUT_S):
                worker.kill()
                raise RuntimeError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:g} s")
            try:
                kind, _, reason = worker.outbox.recv()
            except EOFError:
                kind, reason = "fatal", f"it exited with status {worker.proc.wait()}"
            if kind != "ready":
                worker.kill()
                raise RuntimeError(f"reward worker failed to start: {reason}")
            worker.ready = True


def _shut_down(workers: list[WorkerProcess], wake_w: int) -> None:
    """Kill the workers and wake the service thread (which closes the wake pipe)."""
    for worker in workers:
        if not worker.inbox.closed:
            worker.kill()
    try:
        os.write(wake_w, b"x")
    except (BlockingIOError, OSError):
        pass


def _serve(ref: weakref.ref) -> None:
    """The service thread: waits on the busy workers' pipes, the wake pipe and the next
    deadline, then lets the pool handle what happened. It holds the pool only between waits,
    so a pool nobody else holds is collected (its finalizer wakes this thread to end)."""
    pool = ref()
    wake_r, wake_w = pool._wake_r, pool._wake_w
    del pool
    while True:
        pool = ref()
        plan = pool.watch() if pool is not None else None
        del pool
        if plan is None:
            break
        busy, timeout = plan
        try:
            ready = wait([w.outbox for w in busy] + [wake_r], timeout)
        except (OSError, ValueError):   # a worker replaced meanwhile closed its pipe
            ready = []
        pool = ref()
        if pool is None:
            break
        pool.handle(busy, ready)
        del pool
    os.close(wake_r)
    os.close(wake_w)
