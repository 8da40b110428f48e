"""Kimi-K2 as Moonshot publishes it (`kimi_k2`: Kimi-K2-Instruct, Kimi-K2-Instruct-0905,
Kimi-K2-Base): DeepSeek-V3's architecture under its own model_type.

config.json says `"model_type": "kimi_k2"`, `"architectures": ["DeepseekV3ForCausalLM"]` and
maps the Auto classes to Moonshot's copies of DeepSeek-V3's configuration_deepseek.py /
modeling_deepseek.py (`auto_map`); its fields are DeepSeek-V3's, with other values: 384 routed
experts, 64 heads, one dense layer, no expert groups (n_group 1), routed_scaling_factor 2.827,
no MTP layers, rope_theta 50000 with YaRN factor 32 (0905: 64, max_position_embeddings 262144)
and beta_fast = beta_slow = 1.0, vocabulary 163840. The config is read as transformers'
DeepseekV3Config (models.families.deepseek_v3.kimi_k2_hf registers model_type "kimi_k2" as it), so every row of the
DeepSeek-V3 table (models.families.deepseek_v3.fields, models.families.sigmoid_routed) applies
unchanged; this family adds the two fields only the custom code reads (`architectures`,
`auto_map`: DeepSeek-V3's classes, anything else refused) and names itself in the quantization
refusal (Kimi-K2-Thinking publishes INT4 `compressed-tensors` weights: refused). Export writes the
config back as read (model_type "kimi_k2", auto_map included). The tokenizer is Moonshot's own
code (tokenization_kimi.py, tiktoken): model.trust_remote_code (models.hf.custom_code).
"""
from __future__ import annotations

from typing import Any

from models.families.base import FieldRule, field
from models.families.deepseek_v3.family import DeepseekV3
from models.formats.quantized import quant_method, quantization_problem

HF_CLASS = "DeepseekV3ForCausalLM"
# auto_map entry -> the class of DeepSeek-V3's own code it must name (any module file)
AUTO_CLASSES = {"AutoConfig": "DeepseekV3Config", "AutoModel": "DeepseekV3Model",
                "AutoModelForCausalLM": "DeepseekV3ForCausalLM"}


def _architectures(cfg: Any) -> str | None:
    archs = field(cfg, "architectures")
    if archs is None or list(archs) == [HF_CLASS]:
        return None
    return (f"architectures={list(archs)!r} is not supported for kimi_k2: the bridge reads "
            f"kimi_k2 as DeepSeek-V3; supported: [{HF_CLASS!r}] (as Kimi-K2 publishes it)")


def _auto_map(cfg: Any) -> str | None:
    auto_map = field(cfg, "auto_map", {}) or {}
    if not isinstance(auto_map, dict):
        return (f"auto_map={auto_map!r} is not supported for kimi_k2; supported: a mapping of "
                f"{', '.join(AUTO_CLASSES)} to DeepSeek-V3's classes")
    for key, ref in auto_map.items():
        want = AUTO_CLASSES.get(key)
        if want is None or not isinstance(ref, str) or ref.rsplit(".", 1)[-1] != want:
            return (f"auto_map {key}={ref!r} is not supported for kimi_k2: the bridge reads the "
                    "model as DeepSeek-V3, which that code may not be; supported: "
                    + ", ".join(f"{k} -> <module>.{v}" for k, v in AUTO_CLASSES.items()))
    return None


def _quantization(cfg: Any) -> str | None:
    method = quant_method(cfg)
    if method not in (None, "fp8"):
        return (f"quantization_config.quant_method={method!r} is not supported for kimi_k2 "
                "(Kimi-K2-Thinking's INT4 compressed-tensors weights are not dequantized "
                "here); supported: none, fp8 (Kimi-K2-Instruct's block-scaled weights)")
    return quantization_problem(cfg)


KIMI_FIELDS = (
    FieldRule("architectures", f"[{HF_CLASS!r}] or absent; refused: others",
              _architectures),
    FieldRule("auto_map (custom code)", "not executed: the config is read as transformers' "
              "DeepseekV3Config and the model built as DeepseekV3ForCausalLM (models.families.deepseek_v3.kimi_k2_hf); "
              "each entry must name DeepSeek-V3's class (AutoConfig -> DeepseekV3Config, AutoModel "
              "-> DeepseekV3Model, AutoModelForCausalLM -> DeepseekV3ForCausalLM); refused: "
              "others", _auto_map),
    FieldRule("quantization_config", "absent, or quant_method fp8 (fmt e4m3, dynamic "
              "activations, fp32 scales, any weight_block_size) -> dequantized exactly on load "
              "(models.formats.fp8); refused: compressed-tensors (Kimi-K2-Thinking) and other "
              "methods and values", _quantization),
)


class KimiK2(DeepseekV3):
    model_type = "kimi_k2"
    hf_class = HF_CLASS
    # peft 0.21 does not convert names on model_type kimi_k2 (its conversion patterns know
    # deepseek_v3 only): gate/up/down_proj and all-linear adapt the dense layers' and the
    # shared experts' MLP as modules, never the routed experts or the router
    lora_targets = DeepseekV3.lora_targets + ("gate_proj", "up_proj", "down_proj")
    lora_fused = None
    fields = tuple(r for r in DeepseekV3.fields if not r.field.startswith(
        "quantization_config")) + KIMI_FIELDS
    presets = {
        # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's values but these (the 0905
        # update: YaRN factor 64, max_position_embeddings 262144; Kimi-K2-Thinking: INT4, refused)
        "kimi-k2": {
            **DeepseekV3.presets["deepseek-v3"], "model_type": "kimi_k2", "vocab_size": 163840,
            "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
            "max_position_embeddings": 131072, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096},
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModel": "modeling_deepseek.DeepseekV3Model",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
            "bos_token_id": 163584, "eos_token_id": 163585},
    }

    def register_hf_classes(self) -> None:
        """model_type kimi_k2 in transformers' Auto classes, read as DeepSeek-V3."""
        # transformers: imported only by processes that read HF configs, not by the schema
        from models.families.deepseek_v3.kimi_k2_hf import register
        register()
