"""parallel.openmp.release_thread_team: the calling thread's OpenMP workers exit, so a thread
that builds a model and hands the computing to another (the Tinker service) leaves one team,
not two (docs/benchmarks.md: two teams on 2 cores throttle libgomp's barriers). Checked by
events in a fresh 2-thread process: the thread count after a parallel op in the main thread,
after the release, and after a worker thread's own parallel op; the control without the
release keeps the main thread's team beside the worker's."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.launch import python_json

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from parallel.openmp import release_thread_team
    count = lambda: len(os.listdir("/proc/self/task"))
    start = count()
    torch.randn(4_000_000).mul_(2)                 # the main thread's team: +1 worker
    built = count()
    released = release_thread_team() if sys.argv[1] == "release" else None
    after = count()
    seen = {}
    def worker():
        torch.randn(4_000_000).mul_(2)             # this thread's own team: +1 worker
        seen["during"] = count()
    t = threading.Thread(target=worker); t.start(); t.join()
    print(json.dumps({"built": built - start, "released": released, "after": after - start,
                      "worker": seen["during"] - start}))
""")


def run(mode: str) -> dict:
    return python_json(SCRIPT, mode, env={"OMP_NUM_THREADS": "2"})


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_the_released_team_leaves_one_team_for_the_computing_thread():
    got = run("release")
    # the worker thread itself (+1) and its team's worker (+1): the main thread's is gone
    assert got == {"built": 1, "released": True, "after": 0, "worker": 2}, got
    control = run("keep")
    assert control == {"built": 1, "released": None, "after": 1, "worker": 3}, control
