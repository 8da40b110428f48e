"""A tiny random GLM-4.5 MoE (Glm4MoeForCausalLM) built with transformers' own config class (no
downloads): 2 layers (layer 0 dense, layer 1 MoE: PP2 puts one on each stage), 4 heads, 2 KV
heads of width 16, partial RoPE 0.5, q/k/v biases, q/k norms; 8 routed experts in 2 groups
(one group kept, top-2: grouped routing is exercised), a shared expert, routed scaling 2.5, a
random score-correction bias that changes which experts are chosen, a router near
balance (so that per-rank token counts differ from the global ones, see tests/test_glm4_moe); one MTP layer
`model.layers.2.*` (a few tensors, one of them bf16) that must pass through unchanged; the
tests' word-level tokenizer."""
from __future__ import annotations

from tools.tiny_models import append_full_mtp_layer, append_mtp_layer, build_tokenizer, save_random_model

CONFIG = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
              use_qk_norm=True, rms_norm_eps=1e-6, max_position_embeddings=512,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                   partial_rotary_factor=0.5),
              num_nextn_predict_layers=1, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=3, bos_token_id=None, initializer_range=0.2)


def build_glm4_moe(out_dir: str, seed: int = 0, tokenizer: bool = True, mtp: bool | str = True,
                   **extra) -> str:
    """Save the tiny Glm4MoeForCausalLM (fp32 safetensors) to `out_dir`; return it. `mtp`:
    True: the few pass-through MTP tensors above; "full": a complete MTP layer
    (tools.tiny_models.append_full_mtp_layer: trainable, and what vLLM's drafter loads);
    False: none."""
    from transformers.models.glm4_moe import Glm4MoeConfig

    values = dict(CONFIG, **extra)
    if not mtp:
        values["num_nextn_predict_layers"] = 0
    config = Glm4MoeConfig(**values)
    config.architectures = ["Glm4MoeForCausalLM"]
    # a near-balanced router: per-rank and global token counts differ in sign
    save_random_model(out_dir, config, seed, scales={"mlp.gate.weight": 0.1, "bias": 0.1},
                      buffer_scales={"e_score_correction_bias": 0.1})
    if mtp == "full":
        append_full_mtp_layer(out_dir, config, seed)
    elif mtp:
        append_mtp_layer(out_dir, values, seed, "self_attn.q_proj.weight",
                         (values["hidden_size"], values["hidden_size"]))
    if tokenizer:
        build_tokenizer(out_dir, values["vocab_size"])
    return out_dir
