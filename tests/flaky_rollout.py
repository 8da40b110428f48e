"""Rollout backends that fail on purpose, for the retry tests (engine.rl.collect.collector).

Used as `rollout.backend=tests.flaky_rollout:FlakyHFEngine` (a user-supplied backend class,
like any "package.module:Class"). Both are the HF backend with a failing `_generate`:
- FlakyHFEngine: the first FLAKY_ROLLOUT_FAILURES (environment, default 2) generate calls raise
  ConnectionError, later calls work: a transient failure the retries absorb;
- BrokenHFEngine: every call raises RuntimeError: a backend that is gone for good;
- DyingHFEngine: on its DYING_ROLLOUT_AT_CALL-th generate call (default 2) the engine "dies"
  (`is_alive` False, every later call raises), once per run: only while the file named by
  DYING_ROLLOUT_MARKER does not exist (it is created then), so the restarted engine works.
- DyingVLLMEngine: the vLLM backend whose model process is really killed (SIGKILL) at that
  call, under the same marker rule: vLLM's executor sees its worker die, `is_alive` turns
  False and `generate` refuses, as after a crash.
"""
from __future__ import annotations

import os
import signal
import time

from engine.generation.hf.backend import HFRolloutEngine
from engine.generation.vllm.backend import VLLMRolloutEngine


class FlakyHFEngine(HFRolloutEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures_left = int(os.environ.get("FLAKY_ROLLOUT_FAILURES", "2"))

    def _generate(self, prompts, params):
        if self.failures_left > 0:
            self.failures_left -= 1
            raise ConnectionError("simulated: connection to the inference server was reset")
        return super()._generate(prompts, params)


class BrokenHFEngine(HFRolloutEngine):
    def _generate(self, prompts, params):
        raise RuntimeError("simulated: CUDA error: an illegal memory access was encountered")


class DyingHFEngine(HFRolloutEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dead = False

    @property
    def is_alive(self) -> bool:
        return not self.dead

    def _generate(self, prompts, params):
        if not self.dead and _dies_now(self):
            self.dead = True
        if self.dead:
            raise RuntimeError("simulated: the engine's server process exited")
        return super()._generate(prompts, params)


def _dies_now(engine) -> bool:
    """Whether this generate call is the one to die on (then the marker is created)."""
    marker = os.environ.get("DYING_ROLLOUT_MARKER")
    if (marker and not os.path.exists(marker)
            and engine.num_generate_calls == int(os.environ.get("DYING_ROLLOUT_AT_CALL", "2"))):
        open(marker, "w").close()
        return True
    return False


class DyingVLLMEngine(VLLMRolloutEngine):
    def _generate(self, prompts, params):
        if _dies_now(self):
            for pid in self.engine_pids():
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while self.is_alive and time.monotonic() < deadline:   # vLLM's monitor notices
                time.sleep(0.1)
        return super()._generate(prompts, params)
