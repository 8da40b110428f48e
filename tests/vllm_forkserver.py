"""vLLM's worker processes in the suite, forked from one preloaded process instead of spawned.

The vLLM backend builds its engine with the model in ONE worker process that vLLM's
MultiprocExecutor starts with multiprocessing "spawn" (engine.generation.vllm.process: the owner
is a trainer rank, whose threads and torch.distributed world a forked worker would inherit). A
spawned worker is a fresh interpreter that imports torch, transformers and vLLM: about 8 of an
engine start's 11 CPU-seconds on a 2-core host, paid again by each of the suite's ~45 engine
starts. In the suite's processes (the pytest process and the rank pools' ranks) the same worker
is started by Python's own forkserver machinery (multiprocessing.forkserver) from one server per
pytest process that imported SERVER_PRELOAD once.

What a worker sees is what a spawned one sees, but for what a module reads from the environment
at import time (the server's: the pytest process's, tests.launch._env()):
- the preparation data of a spawn start (sys.path, the working directory, the main module, the
  authkey): multiprocessing sends it with the process object either way;
- its owner's os.environ at `start()` (engine_process_env's VLLM_CPU_OMP_THREADS_BIND,
  torchrun's variables removed, ...): `EnvForkServerProcess` carries it and sets it before the
  target runs (a forkserver child otherwise keeps the server's);
- its owner's standard output and error (file descriptors 1 and 2: a pool rank's per-case
  files): passed as descriptors (multiprocessing's DupFd) and put in place before the target
  runs (a forkserver child otherwise writes to the server's).
Its parent process is the server, not the owner: vLLM's worker notices its owner's exit on its
death pipe as before, a kill of the owner's process tree no longer reaches it directly, and
`Process.join`, `exitcode` and `sentinel` work as for a spawned child (the server reports the
exit code).

Switch: TESTS_VLLM_FORKSERVER. tests/conftest.py sets it to the server's socket when a session
runs a file of VLLM_FILES (unless it is 0: the suite then spawns every worker). `install_client`
(the pytest process, each pool rank) makes vLLM's executor take `EnvForkServerContext` when its
context is "spawn" and the variable names a socket. Real launches (tests.launch: torchrun,
`python -m engine.rl`) do not install it: their engines start vLLM's workers with spawn, as a
user's run does (tests/test_vllm_lora_grpo.py's DP2 x TP2 LoRA launch: two torchrun nodes, one
engine each, every rank's exit code checked).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import multiprocessing.context
import multiprocessing.forkserver as forkserver
import multiprocessing.resource_tracker as resource_tracker
import os
import sys
from multiprocessing import reduction
from unittest import mock

ENV = "TESTS_VLLM_FORKSERVER"
EXECUTOR = "vllm.v1.executor.multiproc_executor"
# What the server imports once: what a worker would import at its start
SERVER_PRELOAD = ["torch", "transformers", "vllm.v1.worker.cpu_worker", EXECUTOR,
                  "engine.generation.vllm.worker"]
# The test files that start vLLM engines or test the server (a session with one of them
# starts the server)
VLLM_FILES = ("tests/test_vllm.py", "tests/test_vllm_lora_grpo.py", "tests/test_vllm_rl.py",
              "tests/test_rl_partial_vllm.py",
              "tests/test_vllm_speculative.py", "tests/test_vllm_failures.py",
              "tests/test_agent_steps_vllm.py", "tests/test_serve_sampling.py",
              "tests/test_serve_steps.py", "tests/test_reward_model_convert.py",
              "tests/test_vllm_head_dim.py", "tests/test_vllm_attention.py",
              "tests/test_vllm_forkserver.py", "tests/test_tinker_vllm.py")


def start_server(env: dict[str, str]) -> str:
    """Start this process's forkserver (multiprocessing's own) with SERVER_PRELOAD under
    `env`; return its socket's address. The server ends when this process does."""
    server = forkserver._forkserver
    server.set_forkserver_preload(SERVER_PRELOAD)
    with mock.patch.dict(os.environ, env, clear=True):
        server.ensure_running()
    return server._forkserver_address


def _restore_std(out: reduction.DupFd, err: reduction.DupFd) -> tuple[int, int]:
    return out.detach(), err.detach()


class _OwnerStdFds:
    """Pickled (in the owner, while the process object is sent): the owner's descriptors 1
    and 2 as descriptors passed to the child; unpickled (in the child): those descriptors."""

    def __reduce__(self):
        return _restore_std, (reduction.DupFd(1), reduction.DupFd(2))


class EnvForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with its owner's os.environ and standard output and
    error at `start()` (module docstring)."""

    def start(self) -> None:
        self._owner_environ, self._owner_std = dict(os.environ), _OwnerStdFds()
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._owner_environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(self._owner_std, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        super().run()


class EnvForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvForkServerProcess


CONTEXT = EnvForkServerContext()
_alive_placeholder: int | None = None


def _use_server(address: str) -> None:
    """Point this process's forkserver client at `address` (a server this process did not
    start: a pool rank's is its pytest process's). The alive descriptor the client sends each
    child is a placeholder (the server's lifetime is its starter's)."""
    global _alive_placeholder
    server = forkserver._forkserver
    if server._forkserver_address == address:
        return
    if server._forkserver_pid is not None:
        raise RuntimeError(f"this process runs its own forkserver; {ENV}={address} names another")
    if _alive_placeholder is None:
        _alive_placeholder = os.open(os.devnull, os.O_RDONLY)
    server._forkserver_address, server._forkserver_alive_fd = address, _alive_placeholder
    # no server of its own to check or start: the resource tracker only
    server.ensure_running = resource_tracker.ensure_running


def _context(original):
    def get_mp_context():
        context = original()
        address = os.environ.get(ENV)
        if context.get_start_method() != "spawn" or not address or address == "0":
            return context
        _use_server(address)
        return CONTEXT
    get_mp_context.tests_forkserver = True
    return get_mp_context


def _patch(module) -> None:
    if not getattr(module.get_mp_context, "tests_forkserver", False):
        module.get_mp_context = _context(module.get_mp_context)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches EXECUTOR's get_mp_context right after the module is executed."""

    def find_spec(self, name, path, target=None):
        if name != EXECUTOR:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


def install_client() -> None:
    """Make vLLM's executor in this process start its workers through the server named by
    TESTS_VLLM_FORKSERVER (when set) instead of spawning them: now if vLLM's executor is
    imported already, else when it is."""
    if EXECUTOR in sys.modules:
        _patch(sys.modules[EXECUTOR])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
