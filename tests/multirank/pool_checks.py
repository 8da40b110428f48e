"""Functions the tests of the rank pool itself (tests/test_pool.py) run on its ranks."""
from __future__ import annotations

import os
import sys
import time


def whoami(tag: str) -> dict:
    """This rank's view of the job: torch.distributed's rank and world, torchrun's variables,
    the CPU-host runtime, and an all-reduce over the default group."""
    import torch
    import torch.distributed as dist

    from parallel import cpu_runtime

    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says {tag}")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(total),
            "env_rank": os.environ["RANK"], "local_world": os.environ["LOCAL_WORLD_SIZE"],
            "pid": os.getpid(), "cpu_runtime": cpu_runtime.is_cpu_host(),
            "case_var": os.environ.get("POOL_CASE_VAR"), "tag": tag,
            "cuda_device": str(torch.ones(1, device="cuda").device)}


def raise_on_rank(bad: int, wait_in_barrier: bool = False) -> int:
    """Raise ValueError on rank `bad`; the other ranks return (or, with `wait_in_barrier`,
    wait in a barrier the failed rank never joins)."""
    import torch.distributed as dist

    if dist.get_rank() == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    if wait_in_barrier:
        dist.barrier()
    return dist.get_rank()


def hang(seconds: float = 3600.0) -> None:
    """Sleep far beyond any test timeout."""
    print("about to hang", flush=True)
    time.sleep(seconds)


def megatron_layout(tp: int, pp: int) -> dict:
    """Build megatron's groups for (tp, pp) and report them (a layout left over from an
    earlier case would show here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    before = ps.model_parallel_is_initialized()
    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))
    return {"initialized_before": before, "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "groups": len(dist.distributed_c10d._world.pg_map)}


def write_and_exit(code: int) -> None:
    """A script-like end: output on both streams, then engine.cli.exit_process(code)."""
    from engine.cli import exit_process

    print("to stdout")
    print("to stderr", file=sys.stderr)
    exit_process(code)


def seeds_and_pid() -> dict:
    """This rank's process id, parent's process id and the seeds a fresh interpreter draws
    (random, numpy, torch): ranks forked from the zygote must not share them."""
    import random

    import numpy as np
    import torch

    return {"pid": os.getpid(), "ppid": os.getppid(), "random": random.random(),
            "numpy": float(np.random.random()), "torch": torch.initial_seed()}


def exit_now(code: int, rank: int) -> None:
    """Rank `rank` ends its process with `code` in the middle of the case (no Python cleanup)."""
    import torch.distributed as dist

    if dist.get_rank() == rank:
        os._exit(code)
