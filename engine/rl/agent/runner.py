"""The user's agent function, once per episode, concurrently (docs/agents.md).

`AgentRunner(server, function, name, concurrency, timeout_s).run(backend, rows, seeds)` opens
one episode per (row, seed) on `server`, and calls `function(base_url, row)` for each on up to
`concurrency` threads (engine.rl.env.stepper.run_calls; None: all at once), `row` a deep copy
of the dataset row (`function(base_url, row, api_key=KEY)` when the server has a key,
env.agent_api_key: the function's OpenAI client sends it). The calling thread, which owns the engines, serves the episodes' generate
requests meanwhile (AgentServer.serve) and returns once every function returned or timed out.

A function returns a finite int/float reward, or {"reward": number, "metrics": {name: number}}.
It fails its episode (reward 0, `error` set, the run goes on) by raising, by returning anything
else, by running past `timeout_s` counted from its call (not from its queueing: the episode's
later calls get 410, its thread is abandoned and frees its slot, the run's exit never waits
for it), or by making no call. Every episode is closed when `run` returns. A backend failure
closes every episode and is raised.
"""
from __future__ import annotations

import copy
import math
import numbers
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from engine.api.backend import GenerateBackend
from engine.rl.agent.server import AgentServer
from engine.rl.agent.sessions import Episode, Trajectory
from engine.rl.env.stepper import run_calls


class AgentError(ValueError):
    """An agent function broke the contract (its episode fails, the run goes on)."""


@dataclass
class AgentOutcome:
    """One episode: its reward and metrics, its error (None: it succeeded), its trajectories
    (kept, and dumped, on error too) and how many calls it made."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    trajectories: list[Trajectory] = field(default_factory=list)
    calls: int = 0
    tool_call_replies: int = 0   # choices answered with finish_reason "tool_calls"


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value)


def check_result(value: Any, name: str) -> tuple[float, dict[str, float]]:
    """(reward, metrics) of what agent `name` returned; AgentError naming it otherwise."""
    expected = "a finite int/float, or {'reward': number, 'metrics': {name: number}}"
    if _finite(value):
        return float(value), {}
    if not isinstance(value, dict) or "reward" not in value or not _finite(value["reward"]):
        raise AgentError(f"agent {name} returned {value!r:.200}; expected {expected}")
    extra = set(value) - {"reward", "metrics"}
    if extra:
        raise AgentError(f"agent {name} returned keys {sorted(extra)}; expected {expected}")
    metrics = value.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and _finite(v)
                                                for k, v in metrics.items()):
        raise AgentError(f"agent {name} returned metrics {metrics!r:.200}; expected a dict of "
                         "names to finite numbers")
    return float(value["reward"]), {k: float(v) for k, v in metrics.items()}


class AgentRunner:
    """See the module docstring."""

    def __init__(self, server: AgentServer, function: Callable[[str, dict], Any], name: str,
                 concurrency: int | None = None, timeout_s: float | None = 600.0) -> None:
        self.server, self.function, self.name = server, function, name
        self.concurrency, self.timeout_s = concurrency, timeout_s

    def _call(self, episode: Episode, row: dict) -> tuple[float, dict, str | None]:
        """One episode's function on a worker thread: (reward, metrics, error)."""
        episode.start(self.timeout_s)
        self.server.queue.wake()
        try:
            url = self.server.base_url(episode.id)
            key = self.server.api_key
            value = self.function(url, row) if key is None else \
                self.function(url, row, api_key=key)
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            return 0.0, {}, f"agent {self.name} raised {type(e).__name__}: {e}"
        finally:
            episode.close("its function returned")
            self.server.queue.wake()
        try:
            reward, metrics = check_result(value, self.name)
        except AgentError as e:
            return 0.0, {}, str(e)
        return reward, metrics, None

    def run(self, backend: GenerateBackend, rows: list[dict], seeds: list[int]
            ) -> list[AgentOutcome]:
        """One outcome per (row, seed), in order (module docstring)."""
        episodes = [self.server.open_episode(s) for s in seeds]
        calls = [partial(self._call, e, copy.deepcopy(r)) for e, r in zip(episodes, rows)]
        done, box = threading.Event(), {}

        def coordinate() -> None:
            try:
                box["results"] = run_calls(calls, self.concurrency or max(len(calls), 1),
                                           self.timeout_s)
            finally:
                done.set()
                self.server.queue.wake()

        threading.Thread(target=coordinate, name="agent-episodes", daemon=True).start()
        try:
            self.server.serve(backend, done.is_set)
        except BaseException:
            for e in episodes:
                self.server.close_episode(e.id, "the run stopped serving")
            self.server.queue.fail_pending("the run stopped serving")
            raise
        outcomes = [self._outcome(e, *box["results"][i]) for i, e in enumerate(episodes)]
        self.server.queue.fail_pending()   # calls an abandoned function made meanwhile
        return outcomes

    def _outcome(self, episode: Episode, result, error: str | None) -> AgentOutcome:
        self.server.close_episode(episode.id)
        trajectories = episode.trajectories()
        if error is not None:  # run_calls: the deadline passed
            out = AgentOutcome(0.0, error=f"agent {self.name} ran past its timeout of "
                               f"{self.timeout_s:g} s (env.agent_timeout_s)")
        else:
            reward, metrics, failed = result
            out = AgentOutcome(reward, metrics, failed)
            if failed is None and not episode.nodes:
                out = AgentOutcome(0.0, error=f"agent {self.name} made no call to its base_url")
        out.trajectories, out.calls = trajectories, episode.calls
        out.tool_call_replies = sum(n.finish_reason == "tool_calls" for n in episode.nodes)
        return out
