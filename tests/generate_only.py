"""GenerateOnlyEngine: the base of the tests' scripted rollout engines, which only generate
(their subclasses define `generate`; the collector under test never syncs weights into them,
and sleeping or waking them does nothing)."""
from __future__ import annotations

from engine.generation.base import RolloutEngine


class GenerateOnlyEngine(RolloutEngine):
    def update_weights(self, named_tensors):
        raise AssertionError("not used")

    def sleep(self):
        pass

    def wake(self):
        pass
