"""The Tinker service's sampling sessions and which of their adapters the sampler keeps.

Every `save_weights_and_get_sampling_client` makes a sampling session with an adapter of its
own on the root's sampler (engine.tinker.sampler), and an RL loop makes one per step; kept
forever they would fill the device. So the sampler holds at most `limit` sessions' adapters
(the command's --max-samplers): registering one more releases the least recently used
(created or sampled) others' adapters. A released session made from saved sampler weights
(a tinker:// path) is loaded again from its file when it samples next; a released snapshot
(no path: the SDK's ephemeral weights) answers that it was released, naming the flag and
how to keep weights (save them with a name). Sessions of the base model hold no adapter and
are never released. Thread-safe: the routes look sessions up, the worker loads, samples and
releases."""
from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass
class SamplingSession:
    owner: str
    adapter: str | None   # the sampler's adapter; None: the base model's session, or released
    path: str | None = None   # the sampler weights it was made from (reloaded after a release)
    released: bool = False


class SamplingSessions:
    def __init__(self, limit: int):
        """`limit` >= 1: the most sessions whose adapters the sampler holds at once."""
        self.limit = limit
        self.lock = threading.Lock()
        self.by_id: collections.OrderedDict[str, SamplingSession] = collections.OrderedDict()

    def get(self, session_id: str) -> SamplingSession | None:
        with self.lock:
            return self.by_id.get(session_id)

    def add(self, session_id: str, session: SamplingSession) -> list[str]:
        """Register `session` as the most recently used; returns the adapters to release (the
        least recently used others beyond `limit`), marked released here."""
        with self.lock:
            self.by_id[session_id] = session
            self.by_id.move_to_end(session_id)
            return self._beyond_limit()

    def used(self, session_id: str, adapter: str | None = None) -> list[str]:
        """`session_id` sampled now (its adapter `adapter` where it was loaded again): it
        becomes the most recently used; returns the adapters to release, as `add`."""
        with self.lock:
            session = self.by_id[session_id]
            if adapter is not None:
                session.adapter, session.released = adapter, False
            self.by_id.move_to_end(session_id)
            return self._beyond_limit()

    def _beyond_limit(self) -> list[str]:
        held = [s for s in self.by_id.values() if s.adapter is not None]
        out = []
        for session in held[:max(0, len(held) - self.limit)]:   # least recently used first
            out.append(session.adapter)
            session.adapter, session.released = None, True
        return out
