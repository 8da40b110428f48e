"""rollout.vllm.speculative (engine.rl.config.SpeculativeConfig): the checks run before any
process group starts (`speculative_problems`, each sentence naming its key; called by
engine.generation.vllm.settings.vllm_problems) and the vllm.LLM arguments they turn into
(`speculative_engine_args`). No vLLM import.

vLLM 0.32 takes `method="mtp"` for every family whose checkpoint carries MTP layers (the
family names deepseek_mtp, glm4_moe_mtp, qwen3_5_mtp, ... are deprecated aliases: its
SpeculativeConfig rewrites the target's hf config to the family's MTP drafter), and
`"draft_model"` with `model` = a separate HF folder. The engine always sets
`draft_sample_method="probabilistic"`: vLLM's default ("greedy") drafts the argmax and treats
the draft distribution as one-hot in the acceptance test, which accepted 0.26 of the draft
tokens at T = 1 even with a perfect MTP head in a probe here; with the draft's probabilities
the test is the standard one (accept with min(1, p/q)), and the samples keep the target's
distribution either way. Stats logging is turned on (vLLM's spec-decode counters feed
rollout/spec_* metrics, engine.generation.vllm.speculative).

Exactness: with speculation the rollout log-probs stay the contract's at every position
(engine.generation.vllm.spec_sampler), at any temperature and top-p; the engine never sets
top-k, penalties or logit processors. What is refused by name: a method other than
mtp / draft_model, mtp on a checkpoint without MTP layers, draft_model without draft_path,
a LoRA policy served as vLLM adapters (vLLM's LoRA with a drafter was never run here: use
rollout.vllm.lora_sync=merged), a model with linear-attention layers (Qwen3.5 style) with
prefix caching (its drafter ran here only with enable_prefix_caching=false), and
speculative_config in
rollout.vllm.engine_kwargs.
"""
from __future__ import annotations

import os

METHODS = ("mtp", "draft_model")
# the config keys that count a checkpoint's MTP layers: DeepSeek-V3 / Kimi-K2 / GLM-4.5,
# MiMo-style, Qwen3.5 / 3.6 (also inside text_config)
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
# a hybrid model's layer kind (config.json layer_types; Qwen3.5 / Qwen3-Next style): its vLLM
# drafter ran here only without prefix caching
LINEAR_ATTENTION = "linear_attention"


def mtp_layers(hf_config: dict) -> int:
    """How many MTP layers the checkpoint's config.json (`hf_config`) declares (0: none)."""
    for config in (hf_config, hf_config.get("text_config") or {}):
        for key in MTP_LAYER_KEYS:
            if config.get(key):
                return int(config[key])
    return 0


def hybrid_attention(hf_config: dict) -> bool:
    """Whether config.json (or its text_config) declares linear-attention layers."""
    return any(LINEAR_ATTENTION in (config.get("layer_types") or ())
               for config in (hf_config, hf_config.get("text_config") or {}))


def speculative_problems(cfg, hf_config: dict, lora_mode: str | None = None) -> list[str]:
    """Why rollout.vllm.speculative cannot run with this config and checkpoint (`hf_config`:
    model.hf_path's config.json), one sentence per problem naming the key. `lora_mode`: how a
    LoRA policy reaches the engines (vllm.lora.lora_sync_mode), None without LoRA."""
    spec = cfg.rollout.vllm.speculative
    key = "rollout.vllm.speculative"
    if "speculative_config" in (cfg.rollout.vllm.engine_kwargs or {}):
        return [f"rollout.vllm.engine_kwargs: speculative_config is set by {key}.*; use "
                "those keys"]
    if spec.method is None:
        return ([f"{key}.draft_path={spec.draft_path!r} is set but {key}.method is null; set "
                 "method=draft_model or drop draft_path"] if spec.draft_path else [])
    if spec.method not in METHODS:
        return [f"{key}.method={spec.method!r} is not one of null, {', '.join(METHODS)}"]
    p = []
    if isinstance(spec.num_tokens, bool) or not isinstance(spec.num_tokens, int) \
            or spec.num_tokens < 1:
        p.append(f"{key}.num_tokens={spec.num_tokens!r} must be an integer >= 1")
    if spec.min_acceptance is not None and not 0 <= spec.min_acceptance <= 1:
        p.append(f"{key}.min_acceptance={spec.min_acceptance!r} must be in [0, 1] or null")
    if isinstance(spec.patience_steps, bool) or not isinstance(spec.patience_steps, int) \
            or spec.patience_steps < 1:
        p.append(f"{key}.patience_steps={spec.patience_steps!r} must be an integer >= 1")
    if spec.method == "mtp" and mtp_layers(hf_config) == 0:
        p.append(f"{key}.method=mtp: model.hf_path's config.json declares no MTP layers "
                 f"(none of {', '.join(MTP_LAYER_KEYS)} > 0); use method=draft_model with "
                 f"{key}.draft_path, or null")
    if spec.method == "mtp" and spec.draft_path:
        p.append(f"{key}.draft_path is only for method=draft_model (mtp drafts with the "
                 "policy's own MTP layers)")
    if spec.method == "draft_model" and not spec.draft_path:
        p.append(f"{key}.method=draft_model needs {key}.draft_path (an HF model folder)")
    elif spec.method == "draft_model" and not os.path.isfile(
            os.path.join(spec.draft_path, "config.json")):
        p.append(f"{key}.draft_path={spec.draft_path!r} has no config.json (an HF model "
                 "folder, sharing the policy's tokenizer)")
    if lora_mode == "adapter":
        p.append(f"{key}.method={spec.method} with a LoRA policy served as vLLM adapters "
                 "(rollout.vllm.lora_sync=adapter) was never run here; use "
                 "rollout.vllm.lora_sync=merged")
    if hybrid_attention(hf_config) and cfg.rollout.vllm.enable_prefix_caching:
        p.append(f"{key}.method={spec.method} on a model with linear-attention layers "
                 "(layer_types) runs only with rollout.vllm.enable_prefix_caching=false "
                 "(vLLM's drafter for hybrid attention ran here only without it)")
    return p


def speculative_engine_args(spec) -> dict:
    """vllm.LLM keyword arguments of rollout.vllm.speculative `spec` (SpeculativeConfig; None
    or method null: none). An MLA model's draft gets its CPU attention backend later
    (engine.generation.vllm.attention.cpu_attention_args)."""
    if spec is None or spec.method is None:
        return {}
    draft = {"method": spec.method, "num_speculative_tokens": int(spec.num_tokens),
             "draft_sample_method": "probabilistic"}
    if spec.method == "draft_model":
        draft["model"] = spec.draft_path
    return {"speculative_config": draft, "disable_log_stats": False}
