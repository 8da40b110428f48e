"""The environment a vLLM engine's processes start with (engine.generation.vllm.process),
checked without vLLM or a GPU: each engine's CUDA_VISIBLE_DEVICES follows its placement slot
(two engines at TP4 on an 8-GPU node, two nodes, disaggregated rollout ranks, a job-wide
CUDA_VISIBLE_DEVICES), the worker start method is set only inside the block and a user's value
is kept, and torchrun's variables are hidden from the engine's processes."""
from __future__ import annotations

import os

import pytest

from engine.generation.placement import (resolve_placement, rollout_procs_per_node,
                                         split_sizes)
from engine.generation.vllm.process import (DEVICES, WORKER_START, engine_devices,
                                            engine_process_env)


def _engine_envs(placement) -> list[dict]:
    """The environment each engine of `placement` is built under (GPU host)."""
    envs = []
    for engine in range(placement.num_engines):
        gpus = (placement.local_slot(engine), placement.gpus_per_engine)
        with engine_process_env(on_cpu=False, gpus=gpus):
            envs.append(dict(os.environ))
    return envs


def test_two_engines_at_tp4_on_8_gpus_get_disjoint_devices(monkeypatch):
    monkeypatch.delenv(DEVICES, raising=False)
    placement = resolve_placement(2, 4, world_size=8, procs_per_node=8)
    assert [e[DEVICES] for e in _engine_envs(placement)] == ["0,1,2,3", "4,5,6,7"]
    assert DEVICES not in os.environ   # the owner's environment is restored


def test_engines_on_two_nodes_each_use_their_nodes_devices(monkeypatch):
    monkeypatch.delenv(DEVICES, raising=False)
    # one engine per node (the default), TP8: both start at local device 0 of their node
    per_node = resolve_placement(None, None, world_size=16, procs_per_node=8)
    assert per_node.owners == (0, 8)
    assert [e[DEVICES] for e in _engine_envs(per_node)] == ["0,1,2,3,4,5,6,7"] * 2
    # four engines on two nodes at TP4: two slots per node
    four = resolve_placement(4, 4, world_size=16, procs_per_node=8)
    assert [e[DEVICES] for e in _engine_envs(four)] == ["0,1,2,3", "4,5,6,7"] * 2


def test_disaggregated_rollout_ranks_place_engines_on_their_node(monkeypatch):
    """A 16-process job whose last node (8 ranks) is the rollout world, two engines at TP4."""
    monkeypatch.delenv(DEVICES, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")

    class Rollout:
        placement, num_ranks = "disaggregated", 8

    class Cfg:
        rollout = Rollout

    n_train, n_rollout = split_sizes(Cfg, 16)
    assert (n_train, n_rollout) == (8, 8)
    placement = resolve_placement(2, 4, n_rollout, rollout_procs_per_node(16, n_rollout))
    assert [e[DEVICES] for e in _engine_envs(placement)] == ["0,1,2,3", "4,5,6,7"]


def test_a_job_wide_cuda_visible_devices_is_indexed_not_replaced(monkeypatch):
    monkeypatch.setenv(DEVICES, "8,9,10,11,12,13,14,15")
    placement = resolve_placement(2, 4, world_size=8, procs_per_node=8)
    assert [e[DEVICES] for e in _engine_envs(placement)] == ["8,9,10,11", "12,13,14,15"]
    assert os.environ[DEVICES] == "8,9,10,11,12,13,14,15"   # restored
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=0,1 shows 2"):
        engine_devices((0, 4), "0,1")


def test_worker_start_method_only_inside_the_block_and_a_users_value_kept(monkeypatch):
    monkeypatch.delenv(WORKER_START, raising=False)
    for k, v in (("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    with engine_process_env(on_cpu=True):
        assert os.environ[WORKER_START] == "spawn"
        assert not {"RANK", "LOCAL_RANK", "MASTER_PORT"} & set(os.environ)
    assert WORKER_START not in os.environ   # importing or using the module leaves none behind
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("3", "1")
    monkeypatch.setenv(WORKER_START, "forkserver")
    with engine_process_env(on_cpu=True):
        assert os.environ[WORKER_START] == "forkserver"
    assert os.environ[WORKER_START] == "forkserver"


def test_launcher_variables_set_inside_the_block_do_not_leak(monkeypatch):
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE (its TP size) in the owner's process while the
    engine is built: in a process started without torchrun it stayed set, and a later
    placement in that process read 2 processes per node (seen as "world size 1 is not a whole
    number of nodes of 2 processes" in a test after a TP 2 engine). Afterwards every launcher
    variable is as before the block: absent ones removed, torchrun's values back."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")
    with engine_process_env(on_cpu=True, gpus=(0, 2)):
        assert "RANK" not in os.environ
        os.environ["LOCAL_WORLD_SIZE"] = "2"   # what vLLM's CpuPlatform does
        os.environ["RANK"] = "0"
    assert "LOCAL_WORLD_SIZE" not in os.environ and os.environ["RANK"] == "3"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with engine_process_env(on_cpu=True, gpus=(0, 2)):
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"
