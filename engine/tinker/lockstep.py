"""The Tinker service on several ranks: rank 0 serves HTTP and runs the service's worker; every
model operation it calls on its engine.tinker.adapters.Adapters is first broadcast to the other
ranks, which run the same call on their own replica shard, in the same order
(`follow`), so every collective inside it (TP reductions, the data-parallel gradient sum,
gathers to the root) pairs up.

Sampling and releasing a sampler's adapter are the calls the root runs alone (on its
engine.tinker.sampler: ROOT_ONLY); the followers wait in the channel meanwhile.

The channel is a process group of its own (gloo, CPU objects) whose timeout is a year: an
idle server's followers wait in its broadcast without the training groups' timeout
(parallel.timeouts) ending them. A call that fails raises on the root, whose future reports
it; the followers raise the same, print it on stderr with their rank, and go on
(compute.run_losses makes a failure on any rank fail on all before gradients change). `stop()`
ends the followers' loops when the server exits."""
from __future__ import annotations

import sys
import threading
import traceback
from datetime import timedelta

import torch.distributed as dist

from parallel import cpu_runtime

STOP = "__stop__"
# what the service calls on its backend (engine.tinker.service)
CALLS = ("create", "frozen", "remove", "run_losses", "optim_step", "export")
ROOT_ONLY = ("sample", "release")   # on the root's sampler alone: not broadcast


def channel():
    """The lockstep's process group over the whole world (collective: call on every rank)."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=365))


class Lockstep:
    """The root's handle on every replica: `lockstep.<call>(...)` broadcasts the call, then
    runs it on the root's own Adapters and returns its result (a ROOT_ONLY call: only the
    latter)."""

    def __init__(self, local, group):
        self.local, self.group, self.lora = local, group, local.lora
        self.sampler = local.sampler   # the root's (its calls are not broadcast: ROOT_ONLY)
        self.lock = threading.Lock()   # the worker's calls and stop() from the main thread

    def __getattr__(self, name: str):
        if name not in CALLS + ROOT_ONLY:
            raise AttributeError(name)

        def call(*args, **kwargs):
            with self.lock, cpu_runtime.on_this_thread():   # the service's worker thread
                if name in CALLS:
                    dist.broadcast_object_list([(name, args, kwargs)], src=0,
                                               group=self.group)
                return getattr(self.local, name)(*args, **kwargs)
        return call

    def stop(self) -> None:
        with self.lock:
            dist.broadcast_object_list([(STOP, (), {})], src=0, group=self.group)


def follow(local, group) -> None:
    """A non-root rank: run the root's calls on `local` until it stops."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        name, args, kwargs = message[0]
        if name == STOP:
            return
        try:
            getattr(local, name)(*args, **kwargs)
        except Exception as error:   # the root raised the same and reports it to its caller;
            # said here too, so a failure of this rank alone is not silent
            print(f"[tinker rank {dist.get_rank()}] {name} failed: "
                  f"{''.join(traceback.format_exception_only(error)).strip()}",
                  file=sys.stderr, flush=True)
