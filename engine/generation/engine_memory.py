"""What one rollout engine's weights weigh, for `--validate` (engine.rl.recipe_check): the
bytes one weight sync moves into each engine, what the engine holds of a GPU
(`engine_budget`) and, for SGLang and vLLM, whether the engine's share of the weights fits its
rollout.sglang.mem_fraction / rollout.vllm.gpu_memory_utilization of the GPU and what is left
for its KV cache.

- rollout.sync_quantization null: every parameter in model.dtype (HF count, unpadded vocab);
- fp8: the weights the published FP8 checkpoint stores in FP8 at 1 byte per parameter plus one
  fp32 scale per weight_block_size block (ragged edge blocks counted whole), every other
  parameter (embeddings, lm_head, norms, routers) in model.dtype. Which weights those are is
  the family's published layout: DeepSeek-V3 / Kimi-K2 (MLA;
  models.layers.mla.costs.fp8_weight_shapes); other families are refused by name.

The KV cache for MLA models: one (kv_lora_rank + qk_rope_head_dim)-wide latent per token
and layer in bf16, held whole by every GPU of a tensor-parallel engine (the latent has no heads
to split), so the tokens it can hold are (budget - weights share) / that size.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.estimate.counting import stage_parameters
from models.families.base import field
from models.layers.mla.costs import fp8_weight_shapes, uses_mla
from models.formats.quantized import quantization_config

GIB = 2 ** 30


@dataclass
class EngineWeights:
    """bytes: the whole model as one engine receives and holds it; fp8_params / scales: the
    parameters sent in FP8 and their fp32 block scales (0 without FP8); text: how."""

    bytes: int
    fp8_params: int
    scales: int
    text: str


def engine_weights_problem(cfg, hf: dict) -> str | None:
    """Why the estimate cannot count this model's FP8 engine weights (None: it can)."""
    if cfg.rollout.sync_quantization != "fp8" or uses_mla(hf):
        return None
    return ("rollout.sync_quantization=fp8: the memory estimate knows the published FP8 layout "
            f"of deepseek_v3 (MLA) checkpoints only, not model_type {hf.get('model_type')!r}")


def engine_weights(cfg, hf: dict) -> EngineWeights:
    """The module docstring's count (engine_weights_problem must be None)."""
    params = stage_parameters(hf, 1, 1).total
    a = 2 if cfg.model.dtype == "bfloat16" else 4
    if cfg.rollout.sync_quantization != "fp8":
        return EngineWeights(params * a, 0, 0, cfg.model.dtype)
    b0, b1 = (int(b) for b in (quantization_config(hf) or {})["weight_block_size"])
    shapes = fp8_weight_shapes(hf)
    fp8 = sum(o * i * n for (o, i), n in shapes)
    scales = sum(-(-o // b0) * -(-i // b1) * n for (o, i), n in shapes)
    return EngineWeights(fp8 + 4 * scales + (params - fp8) * a, fp8, scales,
                         f"FP8: {fp8 / 1e9:.2f} B parameters at 1 byte + {scales / 1e6:.1f} M "
                         f"fp32 {b0}x{b1}-block scales + {(params - fp8) / 1e9:.2f} B in "
                         f"{cfg.model.dtype}")


def kv_tokens(hf: dict, free_gib: float) -> int | None:
    """Tokens of MLA latent KV cache (bf16) that `free_gib` GiB hold on one GPU (None: not
    an MLA model)."""
    if not uses_mla(hf):
        return None
    width = int(field(hf, "kv_lora_rank")) + int(field(hf, "qk_rope_head_dim"))
    return int(max(free_gib, 0.0) * GIB // (2 * width * int(field(hf, "num_hidden_layers"))))


def engine_budget(cfg, hf: dict, gpus_per_engine: int) -> tuple[float, str]:
    """(GiB of one GPU the rollout engine holds, how that is set). SGLang: its
    rollout.sglang.mem_fraction of the GPU; vLLM: its rollout.vllm.gpu_memory_utilization of
    the GPU, or with rollout.vllm.kv_cache_gib its share of the weights plus that cache; other
    backends: the whole weights in model.dtype (one copy per engine)."""
    roll, gpu = cfg.rollout, cfg.recipe.gpu_memory_gib
    share = engine_weights(cfg, hf).bytes / GIB / gpus_per_engine
    if roll.backend == "sglang":
        return (roll.sglang.mem_fraction * gpu,
                f"SGLang {roll.sglang.mem_fraction:g} x {gpu:g}")
    if roll.backend == "vllm" and roll.vllm.kv_cache_gib is not None:
        return share + roll.vllm.kv_cache_gib, (f"vLLM weights {share:.1f} + "
                                                f"rollout.vllm.kv_cache_gib {roll.vllm.kv_cache_gib:g}")
    if roll.backend == "vllm":
        return (roll.vllm.gpu_memory_utilization * gpu,
                f"vLLM {roll.vllm.gpu_memory_utilization:g} x {gpu:g}")
    a = 2 if cfg.model.dtype == "bfloat16" else 4   # a whole copy in model.dtype
    return stage_parameters(hf, 1, 1).total * a / GIB, f"{roll.backend} engine weights"


def engine_fit(cfg, hf: dict, gpus_per_engine: int) -> tuple[list[str], list[str]]:
    """(problems, report lines) of an SGLang or vLLM engine's weights against its share of the
    GPU (rollout.sglang.mem_fraction, rollout.vllm.gpu_memory_utilization): its share of the
    weights (over its GPUs) must fit, or the engine cannot even load them (engines never span
    nodes: engine.generation.placement); the rest is its KV cache. Other backends: nothing."""
    roll = cfg.rollout
    keys = {"sglang": ("an SGLang", "rollout.sglang.mem_fraction"),
            "vllm": ("a vLLM", "rollout.vllm.gpu_memory_utilization")}
    if roll.backend not in keys or (roll.backend == "vllm" and roll.vllm.kv_cache_gib):
        return [], []
    name, key = keys[roll.backend]
    fraction = roll.sglang.mem_fraction if roll.backend == "sglang" else \
        roll.vllm.gpu_memory_utilization
    weights = engine_weights(cfg, hf)
    share = weights.bytes / GIB / gpus_per_engine
    budget = fraction * cfg.recipe.gpu_memory_gib
    if share > budget:
        return [f"{name} engine's share of the weights ({weights.text}), {share:.1f} GiB "
                f"per GPU over rollout.gpus_per_engine={gpus_per_engine}, exceeds "
                f"{key}={fraction:g} x "
                f"{cfg.recipe.gpu_memory_gib:g} GiB = {budget:.1f} GiB (engines never span "
                "nodes): the model does not fit one node's engine"], []
    tokens = kv_tokens(hf, budget - share)
    cache = (f" (about {tokens / 1e3:.0f} K tokens of MLA latents, every GPU of the engine "
             "caching each token)"
             if tokens is not None else "")
    return [], [f"{name.split()[1]} engine per GPU (estimate, GiB): weights {share:.1f} ({weights.text}, "
                f"over {gpus_per_engine} GPUs) of its {key} "
                f"{fraction:g} x {cfg.recipe.gpu_memory_gib:g} = {budget:.1f}: "
                f"{budget - share:.1f} left for the KV cache{cache}"]
