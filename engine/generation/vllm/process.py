"""How the vLLM backend (engine.generation.vllm.backend) starts an engine's processes and keeps
its side effects out of the owner's process.

- `engine_process_env`: the environment while an engine is built (its processes inherit it;
  the owner's environment is restored after): without torchrun's variables; the model in
  vLLM's worker process started with spawn (VLLM_WORKER_MULTIPROC_METHOD, unless the user set
  it: the owner is a trainer rank whose torch.distributed world a forked worker would inherit
  and hang in); the engine core in the owner's process on CPU (in its own on GPUs); on GPUs
  the engine's devices as CUDA_VISIBLE_DEVICES (`engine_devices`), on CPU the worker's OpenMP
  binding (`cpu_bind`) unless the user set one.
- `trainer_groups_kept`: vLLM's teardown (EngineCore.shutdown -> cleanup_dist_env_and_memory)
  destroys the default torch.distributed process group of the process that hosts its engine
  core: on CPU that is the owner, a trainer rank, whose peers then lost their connection in
  the final barrier (every colocated multi-rank run exited 1). Within the block the default
  group is left to its owner (parallel.process_groups.shutdown).
- `preserved_global_rng`: building and sampling leave the global RNG states as they were.
- `without_chat_warmup_warning`: vLLM's LLM warms its chat template up at start and, with no
  tokenizer (skip_tokenizer_init: the engine takes and returns token ids, never chat), logs a
  traceback as a warning; that one record is dropped while the engine is built.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist


@contextlib.contextmanager
def preserved_global_rng():
    """Leave the global torch (CPU and CUDA), random and numpy RNG states as they were."""
    cpu, py, npy = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npy)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
WORKER_START = "VLLM_WORKER_MULTIPROC_METHOD"
DEVICES = "CUDA_VISIBLE_DEVICES"
# torchrun's variables: the spawned engine processes must not read them as their own world
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@contextlib.contextmanager
def engine_process_env(on_cpu: bool, gpus: tuple[int, int] = (0, 1),
                       bind_all_cpus: bool = True):
    """os.environ while an engine is built (its processes started), then restored: without
    LAUNCHER_ENV (afterwards exactly as before, whatever vLLM set meanwhile);
    VLLM_WORKER_MULTIPROC_METHOD spawn unless the user set one;
    VLLM_ENABLE_V1_MULTIPROCESSING 0 on CPU (the engine core in this process, the model in the
    spawned worker: vllm.settings.engine_args picks the multiprocess executor) and 1 on GPUs;
    on GPUs CUDA_VISIBLE_DEVICES = `engine_devices(gpus)` (the engine's devices of this node:
    `gpus` = (first local device, count), the placement's slot), on CPU `cpu_bind(gpus[1])`'s
    binding (gpus[1]: the engine's worker count) unless the user set one or `bind_all_cpus` is
    False (then vLLM's own "auto": what a latency-bound server wants, `cpu_bind`)."""
    saved = {k: os.environ.pop(k) for k in (*LAUNCHER_ENV, MULTIPROCESSING) if k in os.environ}
    added = {k: v for k, v in (cpu_bind(gpus[1]) if on_cpu and bind_all_cpus else {}).items()
             if k not in os.environ}
    added[MULTIPROCESSING] = "0" if on_cpu else "1"
    if WORKER_START not in os.environ:
        added[WORKER_START] = "spawn"
    if not on_cpu:
        if DEVICES in os.environ:
            saved[DEVICES] = os.environ[DEVICES]
        added[DEVICES] = engine_devices(gpus, os.environ.get(DEVICES))
    os.environ.update(added)
    try:
        yield
    finally:
        # vLLM's CPU platform sets LOCAL_WORLD_SIZE (its TP size) in this process while the
        # engine is built: a launcher variable this process did not have is removed again
        for k in (*added, *LAUNCHER_ENV):
            if k not in saved:
                os.environ.pop(k, None)
        os.environ.update(saved)


def engine_devices(gpus: tuple[int, int], visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES of an engine on the node's devices [gpus[0], gpus[0] + gpus[1]):
    indices into `visible` (the job's CUDA_VISIBLE_DEVICES, when set), else the devices
    themselves. An engine beyond the visible devices is refused by name."""
    first, count = gpus
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if devices is None:
        return ",".join(str(d) for d in range(first, first + count))
    if first + count > len(devices):
        raise ValueError(f"a vLLM engine on local devices {first}..{first + count - 1} "
                         f"(rollout.gpus_per_engine={count}) but CUDA_VISIBLE_DEVICES={visible} "
                         f"shows {len(devices)}")
    return ",".join(devices[first:first + count])


@contextlib.contextmanager
def trainer_groups_kept():
    """Within the block torch.distributed.destroy_process_group leaves the default group (and
    with it every group) alive: a call without a group, or with the default group, does
    nothing; a call for another group (vLLM's own) goes through. The default group belongs to
    the trainer, which destroys it at exit (parallel.process_groups.shutdown)."""
    original = dist.destroy_process_group

    def destroy_own_groups_only(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return
        original(group)

    dist.destroy_process_group = destroy_own_groups_only
    try:
        yield
    finally:
        dist.destroy_process_group = original


def cpu_bind(workers: int = 1) -> dict[str, str]:
    """Environment for a CPU engine's start (`engine_process_env` never overrides a binding
    the user set): when this process is the only rank on its machine (LOCAL_WORLD_SIZE 1 or
    unset), the engine's OpenMP threads are bound to every CPU the process may use, split into
    `workers` contiguous groups ("0|1": one per worker of a tensor-parallel engine). vLLM's own
    "auto" binds its worker to one core per NUMA node and reserves the rest for its scheduler
    (on 2 cores: one computes); measured on the ~100M-parameter benchmark model, 2 cores: auto
    185 tokens/s, "0-1" 294 tokens/s: rollout's throughput. A server's decode steps are short
    and latency-bound, and there the core "auto" leaves to the scheduler (this process, which
    waits on the worker by spinning) pays: a decode step of 8 requests on a tiny Llama (hidden
    512, compiled, 2 cores at load 5) took 1.9 ms with "auto" and 17-19 ms with "0-1", so
    `serve` keeps vLLM's "auto" (engine_process_env's bind_all_cpus=False; docs/benchmarks.md,
    "serve under load against vLLM's server"). With several ranks per machine each engine
    keeps "auto" (binding each to every CPU would oversubscribe them); a non-contiguous CPU
    set, or fewer CPUs than workers, gets "nobind"."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if cpus != list(range(cpus[0], cpus[-1] + 1)) or len(cpus) < workers:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    per = len(cpus) // workers
    groups = [cpus[i * per:(i + 1) * per] for i in range(workers)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)}


CHAT_WARMUP_LOGGER = "vllm.renderers.base"   # vLLM 0.32's renderer warm-up
CHAT_WARMUP_MESSAGE = "Chat template warmup failed"


class _DropChatWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != CHAT_WARMUP_MESSAGE


@contextlib.contextmanager
def without_chat_warmup_warning():
    """Within the block vLLM's "Chat template warmup failed" warning (with its traceback) is
    not logged; every other record of that logger, and every other logger, as before."""
    logger, dropped = logging.getLogger(CHAT_WARMUP_LOGGER), _DropChatWarmup()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)
