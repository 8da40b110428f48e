"""The environment a vLLM engine's processes start with (engine.generation.vllm.process),
checked without vLLM or a GPU: each engine's CUDA_VISIBLE_DEVICES follows its placement slot
(two engines at TP4 on an 8-GPU node, two nodes, disaggregated rollout ranks, a job-wide
CUDA_VISIBLE_DEVICES), the worker start method is set only inside the block and a user's value
is kept, and torchrun's variables are hidden from the engine's processes. The worker's exit
without the interpreter's teardown (engine.generation.vllm.worker_exit) in a plain process: its
atexit callbacks and C exit handlers run, its final collection does not."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.generation.placement import (resolve_placement, rollout_procs_per_node,
                                         split_sizes)
from engine.generation.vllm.process import (DEVICES, WORKER_START, engine_devices,
                                            engine_process_env)
from tests.launch import REPO_ROOT


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


# A process shaped as a vLLM worker at its exit (engine.generation.vllm.worker_exit): atexit
# callbacks registered before and after the install, a C-level exit handler (as vLLM's C++
# shared-memory communicator, which unlinks its segments at exit), unflushed stdout, and an
# object in a reference cycle that only the interpreter's final collection frees.
_WORKER_EXIT = """
import atexit, ctypes, gc, sys
from pathlib import Path
out, install = Path(sys.argv[1]), sys.argv[2] == "install"
def mark(name):
    (out / name).write_text(name)
atexit.register(mark, "atexit_before")
class Cycle:
    def __del__(self):
        mark("teardown")
mark("c_exit")   # a C exit handler unlinks it (its path in memory no teardown frees)
libc = ctypes.CDLL(None)
libc.strdup.restype = ctypes.c_void_p
path = ctypes.c_void_p(libc.strdup(str(out / "c_exit").encode()))
libc.__cxa_atexit(ctypes.cast(libc.unlink, ctypes.c_void_p), path, None)
if install:   # the module alone, by its path (the package would import torch: seconds)
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "worker_exit", "engine/generation/vllm/worker_exit.py")
    worker_exit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker_exit)
    assert worker_exit.install(int(sys.argv[3])) and not worker_exit.install(0)   # once
atexit.register(mark, "atexit_after")
gc.disable()   # the cycle is left to the final collection
cycle = Cycle()
cycle.me = cycle
del cycle
print("unflushed", end="")
if sys.argv[2] == "os_exit":
    import os
    os._exit(0)
"""


def test_a_worker_exits_without_the_interpreters_teardown(tmp_path):
    """With worker_exit installed the process exits with the given status after every atexit
    callback (registered before and after it) and every C-level exit handler, its stdout
    flushed, and the interpreter's final collection never runs (the cycle's __del__ does not).
    Negative controls: the same process without it runs that collection (its __del__ marks);
    one ending in os._exit leaves the C handler's file (and its stdout) behind."""
    def run(*argv: str) -> tuple[int, str, set[str]]:
        out = tmp_path / "_".join(argv)
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # buffered
        proc = subprocess.run([sys.executable, "-c", _WORKER_EXIT, str(out), *argv], env=env,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout, {p.name for p in out.iterdir()}

    kept = {"atexit_before", "atexit_after"}   # "c_exit" unlinked by the C exit handler
    assert run("install", "0") == (0, "unflushed", kept)
    assert run("install", "3") == (3, "unflushed", kept)
    assert run("plain") == (0, "unflushed", kept | {"teardown"})   # negative control
    # os._exit (the first try) skips the C exit handlers too: vLLM's segments stayed
    assert run("os_exit") == (0, "", {"c_exit"})   # nor the atexit callbacks, nor a flush


def test_vllm_module_reaches_the_backends_submodules_in_a_fresh_process():
    """vllm_module() gives `platforms` and `sampling_params` in a process that imported nothing
    of vLLM before (a bare `import vllm` loads neither: `serve --backend vllm` died in
    VLLMRolloutEngine.from_config's _on_cpu on the previous library.py)."""
    pytest.importorskip("vllm")
    code = ("from engine.generation.vllm.library import vllm_module\n"
            "v = vllm_module()\n"
            "print(v.platforms.current_platform.is_cpu() in (True, False),"
            " v.sampling_params.RequestOutputKind.DELTA.name)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["True", "DELTA"]
