"""The calling thread's OpenMP team, released (CPU hosts).

libgomp (torch's OpenMP runtime on Linux) keeps a team of worker threads for every thread that
has started a parallel region, for the life of that thread. When the process holds more
OpenMP threads than it has CPUs, libgomp's barriers stop spinning (its throttled spin count)
and every parallel region, each GEMM of a forward, pays a futex wake-up of its workers: a
16 x 384 x 1,152 matmul on 2 threads took ~430 us instead of ~200 us on a 2-core host. A
process whose main thread builds a model (large parallel copies: a team) and then hands the
computing to another thread (the Tinker service's worker) holds two teams.

`release_thread_team()` ends the calling thread's team: OpenMP 5.0's
`omp_pause_resource_all(omp_pause_hard)`, which in libgomp frees the pool of the calling thread
(its workers exit). A later parallel region of that thread starts a new team. Call it on a
thread that is done computing before another thread starts to.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

OMP_PAUSE_HARD = 2      # omp_pause_resource_t (OpenMP 5.0): omp_pause_soft = 1, hard = 2
_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib")


@functools.lru_cache(maxsize=1)
def _pause():
    """omp_pause_resource_all of the OpenMP runtime torch loaded (its lib/ folder first, then
    the process's global symbols), or None where there is none."""
    for name in _RUNTIMES:
        path = Path(torch.__file__).parent / "lib" / name
        if path.is_file():
            return getattr(ctypes.CDLL(str(path)), "omp_pause_resource_all", None)
    return getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team (module docstring). True when the runtime
    released it, False where the runtime lacks omp_pause_resource_all or refused (inside a
    parallel region)."""
    pause = _pause()
    return bool(pause is not None and pause(OMP_PAUSE_HARD) == 0)
