"""Published model shapes (`model.shape` presets of the recipes), gathered from the model
families (models.families.*.presets), and the check that an HF config has the same shape.
No megatron, no transformers: engine.config.schema imports this at start-up."""
from __future__ import annotations

from models.families.base import head_dim
from models.families.registry import model_presets

MODEL_SHAPES: dict[str, dict] = model_presets()  # public HF config.json values of each model
_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim",
               "tie_word_embeddings")


def shape_mismatches(preset: dict, hf_config: dict) -> list[str]:
    """Keys of _SHAPE_KEYS whose values differ between a preset and an HF config."""
    def value(cfg, key):
        if key == "head_dim":
            return head_dim(cfg)
        if key == "tie_word_embeddings":
            return bool(cfg.get(key, False))
        return cfg.get(key)
    return [f"{k} {value(preset, k)!r} (preset) vs {value(hf_config, k)!r}"
            for k in _SHAPE_KEYS if value(preset, k) != value(hf_config, k)]
