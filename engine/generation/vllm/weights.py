"""The weight sync of the vLLM rollout engine (engine.generation.vllm.backend's
VLLMRolloutEngine mixes `WeightSync` in; the worker side is engine.generation.vllm.worker /
vllm.sync / vllm.spec_sync), and what speculation does at a sync (engine.generation.
vllm.speculative: the off switch's rebuild, the warning about an MTP draft the sync did not
write, the counters handed to the pool).

Where a sync ends: its buckets arrive one `update_weights` call each, with no end mark; the
engine closes the open sync (the workers finalise vLLM's layerwise reload, engine.generation.
vllm.sync) at its next generate, probe or score, or where the next sync begins: a bucket that
brings a tensor the open sync already took (a sync writes each tensor once). Two syncs with
no generate between are ordinary in RL: a partial-rollout step (rollout.partial) whose batch
is only groups that waited from earlier steps generates nothing. Loaded into the first one's
reload, the second one's buckets met layers already finalised (on CPU their weights repacked
and replaced by empty tensors: "Attempted to load weight (torch.Size([128, 128])) into
parameter (torch.Size([0]))", a resumed run with rollout.partial_driver=true).

The mixin reads the engine's `llm`, `workers`, `sync_transport`, `shared_buckets`, `_adapter`,
`_sync_open`, `_sync_names`, `_stale`, `speculation`, `_start_args` / `_restart_args` /
`_start` and its `_usable` / `shutdown`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from engine.generation.sync.handles import send_bucket


class WeightSync:
    """update_weights / close of a VLLMRolloutEngine (module docstring)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full HF-named tensors (with `lora`: adapter tensors in peft's
        names, AdapterSync.take). The next generate closes the sync; a bucket that repeats a
        name of the open sync closes it first and begins the next one (module docstring)."""
        self._usable("update_weights")
        bucket = list(named_tensors)
        if not bucket:
            return
        names = {name for name, _ in bucket}
        if self._sync_open and not names.isdisjoint(self._sync_names):
            self._close_sync(superseded=True)
        self._sync_names = (self._sync_names if self._sync_open else set()) | names
        if not self._sync_open and self.speculation is not None and \
                self.speculation.off_requested:
            self._drop_speculation()   # this sync then writes every parameter of the new one
        if self._adapter is not None:
            self._adapter.take(bucket)
            self._sync_open = True
            return
        send_bucket(self.llm, bucket, self.sync_transport, self.shared_buckets, self.workers)
        self._sync_open = True

    def _close_sync(self, superseded: bool = False) -> None:
        """Close the open sync (none: nothing): the workers finalise their reload (or the
        adapter is served), the shared buckets are released, the prefix cache reset; raises
        when it left anything unwritten, unless `superseded` (the next sync begins: the engine
        refuses to sample until a sync closes complete, and that one is judged at its close)."""
        if not self._sync_open:
            return
        self._sync_open = False
        self._stale = ["(the sync failed to close)"]   # until it closes: never serve the old
        # every worker's (one per TP rank) unwritten names, or the adapter tensors not sent
        self._stale = (self._adapter.close() if self._adapter is not None else sorted(
            {n for names in self.llm.collective_rpc("rl_close_sync") for n in names}))
        # the buffers' lifetime (engine.generation.sync.lifetime): returned -> free, or
        # released where a worker still views one
        self.shared_buckets.closed(set().union(*self.llm.collective_rpc("rl_held_buckets")))
        if self.speculation is not None and self._adapter is None:
            self.speculation.after_sync(any(self.llm.collective_rpc("rl_draft_synced")))
        self.llm.reset_prefix_cache()  # its KV was computed with the old weights
        if self._stale and not superseded:
            raise RuntimeError(f"weight sync left {len(self._stale)} vLLM parameters, layers or "
                               f"adapter tensors not (fully) written: {self._stale[:5]}; "
                               "refusing to generate with stale weights")

    def _drop_speculation(self) -> None:
        """The off switch (vllm.speculative): this engine rebuilt without its draft."""
        self.shutdown()
        for key in ("speculative_config", "disable_log_stats"):
            self._start_args.pop(key, None)
        self._start(*self._restart_args)
        self.speculation.turned_off()

    def speculation_counters(self) -> dict[str, float]:
        """vLLM's spec-decode counters since the last call (vllm.speculative.Speculation.take;
        {} without speculation): drafts, proposed and accepted draft tokens, enabled 1/0."""
        return self.speculation.take() if self.speculation is not None else {}
