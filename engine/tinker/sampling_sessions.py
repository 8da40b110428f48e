"""The Tinker service's sampling sessions and which of their adapters the sampler keeps.

Every `save_weights_and_get_sampling_client` makes a sampling session with an adapter of its
own on the root's sampler (engine.tinker.sampler), and an RL loop makes one per step; kept
forever they would fill the device. So the sampler holds at most `limit` sessions' adapters
(the command's --max-samplers): registering one more releases the least recently used
(created or sampled) others' adapters. A released session made from saved sampler weights
(a tinker:// path) is loaded again from its file when it samples next; a released snapshot
(no path: the SDK's ephemeral weights) answers that it was released, naming the flag and
how to keep weights (save them with a name). Sessions of the base model hold no adapter and
are never released. Thread-safe: the routes look sessions up and add the base model's; the
worker loads (`load`), finds a session's adapter to sample (`adapter_of`) and releases."""
from __future__ import annotations

import collections
import dataclasses
import threading

from engine.tinker.lora import LoraSpec


@dataclasses.dataclass
class SamplingSession:
    owner: str
    adapter: str | None   # the sampler's adapter; None: the base model's session, or released
    path: str | None = None   # the sampler weights it was made from (reloaded after a release)
    released: bool = False

    @property
    def gone(self) -> bool:
        """Released with nothing to load it again from (a snapshot's)."""
        return self.released and self.path is None


class Released(ValueError):
    """A snapshot's sampling session whose adapter was released (the message says why)."""


class SamplingSessions:
    def __init__(self, limit: int, backend, read_state, new_name):
        """`limit` >= 1: the most sessions whose adapters the sampler holds at once;
        `backend`: the service's Adapters (or Lockstep): `frozen` loads an adapter on the
        sampler, `release` drops it; `read_state(owner, path)`: a saved state's dict;
        `new_name()`: a fresh adapter name."""
        self.limit, self.backend = limit, backend
        self.read_state, self.new_name = read_state, new_name
        self.lock = threading.Lock()
        self.by_id: collections.OrderedDict[str, SamplingSession] = collections.OrderedDict()

    def load(self, session_id: str, owner: str, spec, source: str | None = None,
             state: dict | None = None, path: str | None = None) -> None:
        """Session `session_id` of `owner` with a new sampler adapter of LoraSpec `spec`:
        training adapter `source`'s current weights (a snapshot) or `state`'s, read from
        `path`; the least recently used others beyond the limit released."""
        adapter = self.new_name()
        self.backend.frozen(adapter, spec, state=state, source=source)
        self._release(self.add(session_id, SamplingSession(owner, adapter, path)))

    def adapters_of(self, session_ids: list[str | None]) -> dict:
        """{session: `adapter_of` it} for the sessions of one generate call (at most `limit`
        of them): all become the most recently used first, so loading one again never
        releases another of the call."""
        with self.lock:
            for session_id in session_ids:
                session = self.by_id.get(session_id)
                if session is not None and not session.gone:
                    self.by_id.move_to_end(session_id)
        return {session_id: self.adapter_of(session_id) for session_id in session_ids}

    def adapter_of(self, session_id: str | None) -> str | None:
        """The sampler adapter to sample session `session_id` with (None: the base model),
        loaded again from its path if it was released (Released: a snapshot's); the session
        becomes the most recently used."""
        if session_id is None:
            return None
        session = self.get(session_id)
        if session.gone:
            raise Released(
                f"sampling_session_id {session_id!r}: its weights were released, the server "
                f"holding the {self.limit} most recently used sampling sessions' weights "
                "(--max-samplers); save_weights_for_sampler with a name keeps them at a path, "
                "which loads again when needed")
        reload = None
        if session.released:
            state = self.read_state(session.owner, session.path)
            reload = self.new_name()
            self.backend.frozen(reload, LoraSpec(**state["spec"]), state=state)
        self._release(self.used(session_id, reload))
        return session.adapter

    def _release(self, adapters: list[str]) -> None:
        for adapter in adapters:
            self.backend.release(adapter)

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
