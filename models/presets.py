"""Published model shapes (`model.shape` presets of the recipes) and the check that an HF
config has the same shape. Plain data: no torch, no megatron."""
from __future__ import annotations

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MODEL_SHAPES: dict[str, dict] = {  # public HF config.json values of each model
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5, rope_scaling=_LLAMA31_ROPE,
                         tie_word_embeddings=False),
    "llama-3.1-70b": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                          hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5, rope_scaling=_LLAMA31_ROPE,
                          tie_word_embeddings=False),
}
_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim",
               "tie_word_embeddings")


def shape_mismatches(preset: dict, hf_config: dict) -> list[str]:
    """Keys of _SHAPE_KEYS whose values differ between a preset and an HF config."""
    def value(cfg, key):
        if key == "head_dim":
            return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if key == "tie_word_embeddings":
            return bool(cfg.get(key, False))
        return cfg.get(key)
    return [f"{k} {value(preset, k)!r} (preset) vs {value(hf_config, k)!r}"
            for k in _SHAPE_KEYS if value(preset, k) != value(hf_config, k)]
