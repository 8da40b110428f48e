"""One training step under torch.profiler: how busy the GPU is, kernels and host syncs per step.

    torchrun --nproc_per_node 1 -m tools.bench.gpu.step_profile OUT.json STEP engine.sft ARGS...
        runs `python -m engine.sft ARGS...` (any engine module whose steps call
        TrainEngine.train_batch) with its STEP-th call (1-based) of
        engine.training.train_engine.TrainEngine.train_batch profiled; rank 0 writes that step's
        summary to OUT.json. Only that call runs under the profiler; the others are untouched.

`summarize(events, wall_s, own_syncs)` is pure (tested with made-up events); its summary:
  wall_ms       the profiled call from its start to the end of a closing device synchronize
  device_ms     the union of the intervals in which a kernel, memcpy or memset ran on the GPU
                (= the sum of kernel time when everything runs on one stream; overlapping
                streams are counted once)
  gpu_busy      device_ms / wall_ms (None without device events: a CPU run)
  kernels       GPU kernels that ran (device-side events, memcpy and memset not counted): the
                kernel launches of the step, whatever API launched them
  launch_calls  host-side launch calls seen (cudaLaunchKernel, cuLaunchKernel(Ex),
                cudaLaunchKernelExC, cudaGraphLaunch, ...)
  host_syncs    host-side calls that block until the GPU catches up (cuda*/cu*Synchronize and
                the blocking cudaMemcpy), minus `own_syncs` (the closing synchronize that ends
                the measured wall time); `.item()`, `.tolist()`, `.cpu()` of a GPU tensor each
                show up here as one cudaStreamSynchronize
  sync_calls    those calls by name (own ones removed from cudaDeviceSynchronize)
  d2h_copies    device-to-host memcpys on the GPU (each a sync unless into pinned memory with
                non_blocking)
With device events but no CUDA runtime or driver call in the trace (a profiler that did not
record them), launch_calls, host_syncs and sync_calls are None, not 0.
The profiler's own overhead (a few microseconds per recorded operator) makes wall_ms, and so
the idle share, a little larger than in an unprofiled step: gpu_busy is a lower bound.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time
from dataclasses import dataclass
from typing import Callable

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch")
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cudaMemcpy")
OWN_SYNC = "cudaDeviceSynchronize"  # what torch.cuda.synchronize() calls


@dataclass(frozen=True)
class Event:
    """What summarize reads of a profiler event: its name, whether it ran on the GPU, and its
    start and end in microseconds."""
    name: str
    on_device: bool
    start_us: float
    end_us: float


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def summarize(events: list[Event], wall_s: float, own_syncs: int = 0) -> dict:
    """The step's summary (module docstring) from its profiler events."""
    device = [e for e in events if e.on_device]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    host = [e.name for e in events if not e.on_device]
    runtime = not device or any(n.startswith("cu") for n in host)
    sync_calls = {n: host.count(n) for n in SYNC_CALLS if n in host}
    if own_syncs and sync_calls.get(OWN_SYNC):
        sync_calls[OWN_SYNC] -= min(own_syncs, sync_calls[OWN_SYNC])
    device_ms = union_us([(e.start_us, e.end_us) for e in device]) / 1e3
    wall_ms = wall_s * 1e3
    return {"wall_ms": round(wall_ms, 3), "device_ms": round(device_ms, 3),
            "gpu_busy": round(min(device_ms / wall_ms, 1.0), 4) if device and wall_ms > 0
            else None,
            "kernels": len(kernels),
            "launch_calls": sum(host.count(n) for n in LAUNCH_CALLS) if runtime else None,
            "host_syncs": sum(sync_calls.values()) if runtime else None,
            "sync_calls": {n: c for n, c in sync_calls.items() if c} if runtime else None,
            "d2h_copies": sum(e.name.startswith("Memcpy DtoH") for e in device)}


def profiler_events(prof) -> list[Event]:
    """torch.profiler's events as `Event`s (device ones: kernels, memcpy, memset)."""
    out = []
    for e in prof.events():
        on_device = getattr(e.device_type, "name", str(e.device_type)) in ("CUDA", "PrivateUse1")
        out.append(Event(e.name, on_device, float(e.time_range.start),
                         float(e.time_range.end)))
    return out


def profile_call(fn: Callable[[], object]) -> tuple[object, dict]:
    """(fn(), its summary): `fn` runs once under torch.profiler (CPU and, with CUDA, the GPU);
    with CUDA the wall time ends with a torch.cuda.synchronize() inside the profiler, so every
    kernel of the call is in the trace (that synchronize is not counted as the step's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return result, summarize(profiler_events(prof), wall, own_syncs=1 if cuda else 0)


def profile_nth_call(owner, attr: str, n: int, save: Callable[[dict], None]) -> None:
    """Replace `owner.attr` (a function or method) by a wrapper whose `n`-th call (1-based)
    runs under profile_call and hands its summary (plus "call": n) to `save`; every other
    call goes straight through."""
    original = getattr(owner, attr)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] != n:
            return original(*args, **kwargs)
        result, summary = profile_call(lambda: original(*args, **kwargs))
        save({**summary, "call": n})
        return result

    setattr(owner, attr, wrapper)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or not argv[1].isdigit() or int(argv[1]) < 1:
        raise SystemExit("usage: python -m tools.bench.gpu.step_profile OUT.json STEP MODULE "
                         "[ARGS...]  (STEP: the 1-based train_batch call to profile)")
    out, step, module = argv[0], int(argv[1]), argv[2]
    from engine.training.train_engine import TrainEngine

    def save(summary: dict) -> None:
        if os.environ.get("RANK", "0") == "0":
            with open(out, "w") as f:
                json.dump(summary, f, indent=1)

    profile_nth_call(TrainEngine, "train_batch", step, save)
    sys.argv = [module, *argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
