"""Kimi-K2's `model_type` "kimi_k2" in transformers' Auto classes, as DeepSeek-V3.

Moonshot publishes Kimi-K2 (Kimi-K2-Instruct, -0905, -Thinking) with config.json
`"model_type": "kimi_k2"`, `"architectures": ["DeepseekV3ForCausalLM"]` and an `auto_map` to its
own copies of DeepSeek-V3's configuration_deepseek.py / modeling_deepseek.py (custom code for
transformers 4.x). transformers 5.x has no `kimi_k2` model type; its own Kimi-K2.5 wrapper
(`kimi_k25`) reads a `kimi_k2` text config as `deepseek_v3`. This module does the same for the
top-level model: `KimiK2Config` is transformers' `DeepseekV3Config` with model_type "kimi_k2"
(every field and default identical), `KimiK2ForCausalLM` is `DeepseekV3ForCausalLM` with that
config class (no code of its own: the same modules, weights and forward), and transformers'
DeepSeek-V3 checkpoint conversion (one tensor per expert on disk, fused experts in memory) is
registered for model_type "kimi_k2" too (without it the routed experts would not load).

Importing this module registers them (idempotent), so `AutoConfig.for_model("kimi_k2", ...)`
(models.hf.config), `AutoModelForCausalLM.from_pretrained` of a Kimi-K2 folder (tools/convert.py
verify, the HF rollout backend) and `save_pretrained` (model_type written back as "kimi_k2")
work without running the folder's own code: transformers prefers a registered class over
`auto_map` unless `trust_remote_code=True` is passed to the model load, which the engines never
do (model.trust_remote_code reaches the tokenizer only: models.hf.custom_code). models.hf.config
imports this module, so every process that reads a config has the registration.
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                             register_checkpoint_conversion_mapping)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

MODEL_TYPE = "kimi_k2"


class KimiK2Config(DeepseekV3Config):
    """transformers' DeepseekV3Config, model_type "kimi_k2" (fields and defaults unchanged)."""

    model_type = MODEL_TYPE


class KimiK2ForCausalLM(DeepseekV3ForCausalLM):
    """transformers' DeepseekV3ForCausalLM for a KimiK2Config (no code of its own)."""

    config_class = KimiK2Config


def register() -> None:
    """Register KimiK2Config / KimiK2ForCausalLM with the Auto classes, and DeepSeek-V3's
    checkpoint conversion (the per-expert tensors on disk <-> transformers' fused experts in
    memory, keyed by model_type) for "kimi_k2"; once per process."""
    if MODEL_TYPE in CONFIG_MAPPING:
        return
    AutoConfig.register(MODEL_TYPE, KimiK2Config)
    AutoModelForCausalLM.register(KimiK2Config, KimiK2ForCausalLM)
    register_checkpoint_conversion_mapping(
        MODEL_TYPE, get_checkpoint_conversion_mapping(DeepseekV3Config.model_type))


register()
