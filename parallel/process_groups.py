"""Process-group setup and teardown over megatron `parallel_state`.

`init_distributed()` starts torch.distributed once per process (gloo on a CPU host; on GPUs
NCCL for CUDA tensors plus gloo for CPU tensors: GPU_BACKEND) from torchrun's environment, or
as a single process when no launcher set it.
`setup_model_parallel(layout)` (re)builds megatron's TP/PP/CP/DP groups (and the expert
groups: EP, expert-TP = TP, expert-DP = dp x cp / ep); it may be called many
times in one process (tests try many layouts in one launch); `teardown_model_parallel()` undoes it.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel import random as mrandom

from parallel import cpu_runtime
from parallel.layout import ParallelLayout
from parallel.timeouts import PROCESS_GROUP_TIMEOUT_S


# On GPUs every process group gets NCCL for CUDA tensors and gloo for CPU tensors: the engine
# reduces small host-side tensors (loss-normaliser counts, report sums, router-loss metrics)
# over megatron's groups, which inherit the default group's backends; with NCCL alone a CPU
# tensor fails ("No backend type associated with device type cpu") whenever the group has
# more than one rank.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = PROCESS_GROUP_TIMEOUT_S) -> tuple[int, int]:
    """Initialise torch.distributed from env (RANK, WORLD_SIZE, MASTER_ADDR/PORT); return
    (rank, world_size). Without a launcher it starts a 1-process group."""
    cpu_runtime.install()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "gloo" if cpu_runtime.is_cpu_host() else GPU_BACKEND
    if backend != "gloo":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def setup_model_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """(Re)build megatron parallel_state for `layout` and seed its model-parallel RNG tracker."""
    if layout.world_size != dist.get_world_size():
        raise ValueError(f"layout world size {layout.world_size} != launched world size "
                         f"{dist.get_world_size()}")
    layout.validate()
    teardown_model_parallel()
    before = set(dist.distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if (layout.vpp or 1) > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
    )
    _MODEL_PARALLEL_GROUPS.extend(g for g in dist.distributed_c10d._world.pg_map
                                  if g not in before)
    model_parallel_cuda_manual_seed(seed)


# The process groups the last setup_model_parallel created (teardown destroys them).
_MODEL_PARALLEL_GROUPS: list = []


def teardown_model_parallel() -> None:
    """Destroy megatron's groups (if any), keeping the default process group alive (and any
    group setup_model_parallel did not create). Megatron's destroy_model_parallel only forgets
    its groups: without destroying them, torch.distributed keeps every group of every layout
    registered, with its gloo threads, until the process exits."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    for group in _MODEL_PARALLEL_GROUPS:
        if group in registered:
            dist.destroy_process_group(group)
    _MODEL_PARALLEL_GROUPS.clear()
    mrandom.initialize_rng_tracker(force_reset=True)


def shutdown(barrier: bool = True) -> None:
    """Tear everything down at process exit. `barrier=False` on error paths, where the other
    ranks may be inside another collective (a barrier would pair with it or wait forever)."""
    teardown_model_parallel()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
