"""Mixtral (MixtralForCausalLM): Llama attention (GQA, RoPE, no q/k norm, no biases) with a
sparse MoE block in every decoder layer: a linear router `block_sparse_moe.gate` (no bias)
over `num_local_experts` SwiGLU experts `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up),
`w2` (down) of width `intermediate_size`; softmax over all experts, top-`num_experts_per_tok`,
always renormalised (MixtralTopKRouter) -> megatron moe_router_pre_softmax=False. The shared
MoE mapping is models.families.moe.

transformers >= 5 names the block `mlp` in memory (fused experts) and writes the names above
on `save_pretrained` (its checkpoint conversion mapping for "mixtral"), which is what the
bridge reads and writes.
"""
from __future__ import annotations

from typing import Any

from models.families.base import FieldRule, field
from models.families.fields import COMMON_FIELDS
from models.families.moe import MOE_FIELDS, PEFT_MIXTRAL, ExpertNaming, MoeFamily


def _sliding_window(cfg: Any) -> str | None:
    """HF Mixtral masks key j for query i when i - j >= sliding_window (masking_utils
    sliding_window_overlay; flash attention's window (w - 1, w - 1) is the same), in every
    layer. Within max_position_embeddings positions that never happens when
    sliding_window >= max_position_embeddings."""
    window = field(cfg, "sliding_window")
    positions = int(field(cfg, "max_position_embeddings", 0))
    if window is None or int(window) >= positions:
        return None
    return (f"sliding_window={window} is not supported: HF Mixtral then masks keys "
            f"{window} or more positions behind each query in every layer, which the bridge "
            f"does not implement; supported: null, or >= max_position_embeddings={positions} "
            "(no position within the model's range is masked)")


class Mixtral(MoeFamily):
    model_type = "mixtral"
    lora = True
    # the attention; peft's w1 / w3 / w2 (and all-linear) are the experts, gate the router
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_fused = PEFT_MIXTRAL
    hf_class = "MixtralForCausalLM"
    experts = ExpertNaming(block="block_sparse_moe", gate="w1", up="w3", down="w2")
    expert_width_field = "intermediate_size"
    renormalise_field = None  # MixtralTopKRouter always renormalises
    fields = COMMON_FIELDS + (
        FieldRule("sliding_window", "null, or >= max_position_embeddings (HF masks a key only "
                  "sliding_window or more positions behind its query: never within the "
                  "model's positions); refused: smaller windows", _sliding_window),
        FieldRule("(no field) biases and q/k norm", "none in HF Mixtral (attention, router "
                  "and experts are bias-free; no q/k norm)"),
        FieldRule("intermediate_size", "any -> moe_ffn_hidden_size (each expert's SwiGLU; "
                  "Mixtral has no dense MLP)"),
        FieldRule("(no field) top-k renormalisation", "always in HF Mixtral -> "
                  "moe_router_pre_softmax=false (softmax over the k selected logits = "
                  "renormalised top-k of the full softmax)"),
    ) + MOE_FIELDS
    presets = {
        "mixtral-8x7b": dict(
            model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
            rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
            router_aux_loss_coef=0.02, output_router_logits=False),
    }

    def length_limit(self, cfg: Any) -> tuple[int, str] | None:
        """A window >= max_position_embeddings passes `fields`, but a train.seq_length
        beyond it would reach keys HF masks: sequences must stay within the window."""
        window = field(cfg, "sliding_window")
        return None if window is None else (int(window), f"sliding_window={window}")
