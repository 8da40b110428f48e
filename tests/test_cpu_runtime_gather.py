"""parallel.cpu_runtime / cpu_collectives: a synchronous all_gather_into_tensor over a group of
one rank runs on the calling thread (megatron's distributed optimizer gathers its parameter
buckets after every step over the DP group: one rank in a one-process run). Through gloo the
copy ran on gloo's worker thread, where ATen's parallel copy started a second OpenMP team for
the rest of the process; with more OpenMP threads than cores libgomp stops spinning at its
barriers and every later parallel region of the main thread paid a wake-up (docs/benchmarks.md:
a one-process GRPO step on 2 threads 1.39-1.59 s -> 0.87-0.91 s).

Checked by events in a fresh process on 2 threads (no clocks): the gathers (megatron's bucket
onto itself under `_coalescing_manager`, and a plain one) give the right output and start no
thread; the negative control, the same gathers without the runtime, starts gloo-named OpenMP
workers. An asynchronous gather, a group of more than one rank, a group given by name or a
call traced by torch.compile still goes to torch.distributed."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.launch import python_json

SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    import torch, torch.distributed as dist
    from parallel import cpu_runtime
    if sys.argv[1] == "on":
        cpu_runtime.install()
    def threads():
        return {t: open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.randn(4_000_000).mul_(2)          # the main thread's own OpenMP team, first
    before = threads()
    bucket = torch.randn(4_000_000)
    saved = bucket.clone()
    with dist._coalescing_manager(None, async_ops=False):
        dist.all_gather_into_tensor(bucket, bucket)      # megatron: the bucket is its shard
    other, out = torch.randn(4_000_000), torch.empty(4_000_000)
    dist.all_gather_into_tensor(out, other)
    new = sorted(n for t, n in threads().items() if t not in before)
    work = dist.all_gather_into_tensor(torch.empty(8), torch.ones(8), async_op=True)
    print(json.dumps({"new_threads": new, "bucket": torch.equal(bucket, saved),
                      "plain": torch.equal(out, other), "async_work": work is not None}))
""")


def gathers(mode: str) -> dict:
    return python_json(SCRIPT, mode, env={"OMP_NUM_THREADS": "2"})


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_one_rank_gathers_start_no_openmp_team_on_gloos_threads():
    on = gathers("on")
    assert on == {"new_threads": [], "bucket": True, "plain": True, "async_work": True}, on
    off = gathers("off")            # control: gloo's worker thread starts its own team
    assert off["bucket"] and off["plain"]
    assert "pt_gloo_runloop" in off["new_threads"], off


def test_only_synchronous_gathers_over_one_rank_are_taken(monkeypatch):
    from parallel import cpu_collectives
    monkeypatch.setattr(cpu_collectives.dist, "get_world_size", lambda group=None: 1)
    assert cpu_collectives.one_rank(None, None)
    assert not cpu_collectives.one_rank(None, None, async_op=True)
    assert not cpu_collectives.one_rank(None, None, group="tp")   # a traced call's group name
    monkeypatch.setattr(cpu_collectives.dist, "get_world_size", lambda group=None: 2)
    assert not cpu_collectives.one_rank(None, None)
    monkeypatch.setattr(cpu_collectives.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(cpu_collectives.torch.compiler, "is_compiling", lambda: True)
    assert not cpu_collectives.one_rank(None, None)             # dynamo traces the real call
