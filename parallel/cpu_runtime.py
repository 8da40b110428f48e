"""Megatron-Core on a host without CUDA.

Megatron-Core assumes a GPU in a handful of places (docs/design/architecture.md). This module is the only
place in the project that knows the host may have none. `install()` is idempotent and a no-op
when CUDA is available; it must run before megatron builds models, optimizers or schedules.

What it provides on a CPU host:
- `torch.cuda` stand-ins: current_device, synchronize, Stream/Event/stream, nvtx, empty_cache,
  and an RNG (a dedicated CPU `torch.Generator`) behind get/set_rng_state and manual_seed, which
  megatron's model-parallel RNG tracker forks;
- a `TorchFunctionMode` (`CudaToCpuMode`) that maps `device="cuda"` arguments, `.cuda()`,
  `.to("cuda")` and `pin_memory=True` to the CPU, and reports CUDA type names from
  `Tensor.type()` (megatron's optimizer checks them); `mode_suspended()` takes it off where
  its handler around every torch call is pure cost (the hf rollout backend's generation);
- `torch.distributed` calls as megatron makes them on a GPU host, routed by the mode to
  parallel.cpu_collectives: the "into tensor" variants gloo lacks, all_to_all_single split
  sizes given as tensors, gathers and reduce-scatters of uneven sizes, and a synchronous
  all-gather over one rank done on the calling thread (not on gloo's, whose parallel copy
  started a second OpenMP team that slowed every later parallel region);
- megatron's jit fuser switched off as its module loads (`skip_megatron_jit_on_cpu`, installed
  by `import parallel`): megatron decorates its fused kernels with `torch.compile` at import,
  which loads TorchDynamo and Inductor (1.5 to 3 s per process); the engine runs with every
  fusion disabled (models.build.transformer_config), so on a CPU host those kernels are never called.
- the same device mapping inside the backward of Python autograd Functions (megatron's
  sequence-parallel linears allocate `device=torch.cuda.current_device()` buffers there, and
  its activation checkpointing replays the forward there): a TorchFunctionMode is popped while
  its handler runs, so inside `torch.autograd.backward` (called through the mode) it would be
  inactive; `_mode_in_custom_backward` pushes it again around every custom backward.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import types

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from parallel.cpu_collectives import (gather_on_one_rank, one_rank, split_sizes_as_lists, uneven,
                                     uneven_all_gather, uneven_reduce_scatter)

_INSTALLED = False
_MODE: "CudaToCpuMode | None" = None
_FAKE_GENERATOR = torch.Generator()

_CPU_TYPE_TO_CUDA = {f"torch.{kind}Tensor": f"torch.cuda.{kind}Tensor"
                     for kind in ("Float", "Half", "BFloat16", "Double", "Long", "Int")}


def cuda_available() -> bool:
    """True when real CUDA devices exist (the runtime then does nothing)."""
    return torch.cuda.is_available() and not _INSTALLED


def _to_cpu_device(device):
    cuda = isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) \
        or (isinstance(device, torch.device) and device.type == "cuda")
    return torch.device("cpu") if cuda else device


# functions whose calls the mode changes (by __name__); every other call without a `device` or
# `pin_memory` keyword goes straight through (the mode sees every torch call of a training step,
# so the common case must cost one dict lookup)
_SPECIAL_NAMES = frozenset({"cuda", "pin_memory", "is_pinned", "type", "to", "record_stream",
                            "all_to_all_single", "all_gather", "reduce_scatter",
                            "all_gather_into_tensor", "all_gather_single", "_all_gather_base"})
# the gathers into one tensor (torch 2.13 names all_gather_into_tensor all_gather_single)
_GATHERS_INTO_TENSOR = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base")


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU for every torch function call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _SPECIAL_NAMES and (not kwargs or ("device" not in kwargs
                                                          and "pin_memory" not in kwargs)):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if name == "cuda":
            return args[0]
        if name == "pin_memory":
            return args[0]
        if name == "is_pinned":
            return False
        if name == "type" and len(args) == 1 and not kwargs:
            cpu_name = func(*args)
            return _CPU_TYPE_TO_CUDA.get(cpu_name, cpu_name)
        if name == "to":
            args = tuple(_to_cpu_device(a) if isinstance(a, (str, torch.device)) else a
                         for a in args)
        if name == "record_stream":
            return None
        if name == "all_to_all_single":
            args, kwargs = split_sizes_as_lists(args, kwargs)
        if name in _GATHERS_INTO_TENSOR and one_rank(*args, **kwargs):
            return gather_on_one_rank(*args, **kwargs)
        if name == "all_gather" and uneven(args[0] if args else kwargs["tensor_list"]):
            return uneven_all_gather(*args, **kwargs)
        if name == "reduce_scatter" and uneven(args[1] if len(args) > 1
                                                else kwargs["input_list"]):
            return uneven_reduce_scatter(*args, **kwargs)
        return func(*args, **kwargs)


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _get_rng_state(device=None):
    return _FAKE_GENERATOR.get_state()


def _set_rng_state(state, device=None, graph_safe=False):
    _FAKE_GENERATOR.set_state(state)


def _manual_seed(seed):
    _FAKE_GENERATOR.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _FakeStream
    cuda.Event = _FakeEvent
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = _get_rng_state
    cuda.set_rng_state = _set_rng_state
    cuda.manual_seed = _manual_seed
    cuda.manual_seed_all = _manual_seed
    cuda.random.get_rng_state = _get_rng_state
    cuda.random.set_rng_state = _set_rng_state
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
        mark=lambda *a, **k: None,
    )
    cuda.nvtx = nvtx


def _cpu_mode_active() -> bool:
    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


@contextlib.contextmanager
def mode_suspended():
    """CudaToCpuMode off for the block (or decorated function), back after it: for code that
    never asks for CUDA, nor calls megatron-core (docs/benchmarks.md: 0.44 s -> 0.33 s for a
    16 x 32-token hf rollout). A no-op unless the mode is installed and innermost."""
    stack = _get_current_function_mode_stack()
    innermost = _MODE is not None and stack and stack[-1] is _MODE
    with torch.overrides._pop_mode_temporarily() if innermost else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def on_this_thread():
    """CudaToCpuMode on this thread too for the block (a mode belongs to the thread that
    entered it: a server's worker calling megatron-core); a no-op if not installed or on."""
    needed = _MODE is not None and not _cpu_mode_active()
    with CudaToCpuMode() if needed else contextlib.nullcontext():
        yield


def _mode_in_custom_backward() -> None:
    """Run the backward (or vjp) of every Python autograd Function under a CudaToCpuMode."""
    original = BackwardCFunction._get_user_fn

    def get_user_fn(self):
        user_fn = original(self)

        def run(*args, **kwargs):
            if _cpu_mode_active():
                return user_fn(*args, **kwargs)
            with CudaToCpuMode():
                return user_fn(*args, **kwargs)

        return run

    BackwardCFunction._get_user_fn = get_user_fn


def _patch_megatron_rng() -> None:
    # megatron only after skip_megatron_jit_on_cpu's import hook (this module installs it)
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: _FAKE_GENERATOR.get_state()
    mrandom._set_cuda_rng_state = _set_rng_state


class _MegatronJitOff(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads `megatron.core.jit` as usual, then calls its `disable_jit_fuser()` when the host
    has no CUDA, before any megatron module decorates a function with the fuser. One use: it
    leaves `sys.meta_path` as soon as it has found the module."""

    _NAME = "megatron.core.jit"

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname, path, target=None):
        if fullname != self._NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if not torch.cuda.is_available() and hasattr(module, "disable_jit_fuser"):
            module.disable_jit_fuser()


def skip_megatron_jit_on_cpu() -> None:
    """Before megatron-core is imported: on a host without CUDA, make megatron's `jit_fuser`
    the identity (its own `disable_jit_fuser`), so importing megatron does not load
    TorchDynamo/Inductor. Exact: the fused kernels are plain eager functions of the same math,
    and the engine's model config turns every fusion off anyway. No-op once megatron.core.jit
    is loaded, or when the hook is already installed."""
    if "megatron.core.jit" in sys.modules or any(
            isinstance(f, _MegatronJitOff) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronJitOff())


def install() -> None:
    """Make megatron-core usable on this host. No-op when CUDA is present; idempotent."""
    global _INSTALLED, _MODE
    if _INSTALLED or torch.cuda.is_available():
        return
    _patch_torch_cuda()
    _patch_megatron_rng()
    _mode_in_custom_backward()
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    _INSTALLED = True


def is_cpu_host() -> bool:
    """True when the CPU runtime is active (no CUDA device on this host)."""
    return _INSTALLED


def device() -> torch.device:
    """The device that tensors of this process should live on."""
    return torch.device("cpu") if _INSTALLED or not torch.cuda.is_available() else torch.device(
        "cuda", torch.cuda.current_device())
