"""DeepSeek-V3 / V3.1 and the checkpoints built on it: Kimi-K2, Moonlight (`deepseek_v3`,
DeepseekV3ForCausalLM).

Attention: multi-latent attention (models.layers.mla.module on megatron's MLASelfAttention; weight mapping
models.layers.mla.mapping): queries through q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj when
`q_lora_rank` is null), keys and values from one compressed latent (kv_a_proj_with_mqa ->
kv_a_layernorm -> kv_b_proj) plus one shared RoPE key, RoPE on qk_rope_head_dim dims with
transformers' own frequencies and YaRN factor, HF's softmax scale (mscale_all_dim).
MLP: `first_k_dense_replace` dense SwiGLU layers, then sigmoid-routed MoE layers with shared
experts (models.families.sigmoid_routed: routing, mapping and refusals shared with GLM-4.5).

MTP (`num_nextn_predict_layers` > 0): the multi-token-prediction layers
`model.layers.{N}.*` .. (N = num_hidden_layers), which transformers drops on load, pass through
unchanged (models.hf.passthrough; FP8 ones with their scales, bitwise).
Published FP8 weights (`quantization_config` fp8, 128x128 blocks) are dequantized on load
(models.formats.quantized, models.formats.fp8). Field rows: models.families.deepseek_v3.fields.
"""
from __future__ import annotations

from typing import Any

from models.families.base import field
from models.families.deepseek_v3.fields import DEEPSEEK_FIELDS
from models.families.moe import PEFT_QWEN2_MOE
from models.families.sigmoid_routed import ROUTING_FIELDS, SigmoidRoutedMoe

_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_KV = ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
       "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
_Q_LORA = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
           "self_attn.q_b_proj.weight")


def _deepseek_v3(**values) -> dict:
    """A published config.json (deepseek-ai/DeepSeek-V3, moonshotai/Moonlight-16B-A3B)."""
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                moe_layer_freq=1, tie_word_embeddings=False, initializer_range=0.02,
                **values)


class DeepseekV3(SigmoidRoutedMoe):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    # LoRA on the MLA projections by peft's names (models.lora.sites; the down projections
    # are replicated linears, the up projections column-parallel, o_proj row-parallel);
    # q_proj is the query projection of checkpoints with q_lora_rank null
    lora = True
    lora_targets = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                    "o_proj")
    # gate/up/down_proj and all-linear as peft converts them on deepseek_v3: the routed
    # experts and the router, never the dense layers' or the shared experts' MLP
    lora_fused = PEFT_QWEN2_MOE
    fields = DEEPSEEK_FIELDS + ROUTING_FIELDS
    multi_latent_attention = True

    def lora_linear(self, cfg: Any) -> tuple:
        """The MLA projections the model has (q_proj or q_a_proj / q_b_proj by q_lora_rank),
        plus the MLP names where peft reads them as modules (Kimi-K2)."""
        drop = {"q_proj"} if field(cfg, "q_lora_rank") is not None else {"q_a_proj", "q_b_proj"}
        return tuple(n for n in self.lora_targets if n not in drop)

    def vllm_problems(self, cfg: Any) -> list[str]:
        """vLLM reads scoring_func and topk_method, and when they are absent scores the experts
        with softmax and builds no e_score_correction_bias (its loader then fails on the
        checkpoint's bias); transformers and the trainer always use sigmoid scores with the
        bias (the field rules take an absent field as that)."""
        return [f"config.json has no {name} (vLLM then routes by its default, {fallback}, "
                f"where transformers and the trainer use {published}); add "
                f"\"{name}\": \"{published}\" as the published config.json has it"
                for name, published, fallback in (
                    ("scoring_func", "sigmoid", "softmax scores"),
                    ("topk_method", "noaux_tc", "no score-correction bias"))
                if field(cfg, name) is None]
    presets = {
        "deepseek-v3": _deepseek_v3(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
            num_key_value_heads=128, q_lora_rank=1536, n_routed_experts=256,
            n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            first_k_dense_replace=3, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
            max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
            rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                          "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096},
            quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                 "quant_method": "fp8", "weight_block_size": [128, 128]},
            bos_token_id=0, eos_token_id=1),
        "moonlight-16b-a3b": _deepseek_v3(
            vocab_size=163840, hidden_size=2048, intermediate_size=11264,
            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
            num_key_value_heads=16, q_lora_rank=None, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
            first_k_dense_replace=1, routed_scaling_factor=2.446, num_nextn_predict_layers=0,
            max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=50000.0,
            rope_scaling=None, bos_token_id=163584, eos_token_id=163585),
    }

    def attention_tensors(self, cfg: Any) -> tuple[str, ...]:
        """Norms and MLA tensors of one layer (q_proj alone when q_lora_rank is null)."""
        q = ("self_attn.q_proj.weight",) if field(cfg, "q_lora_rank") is None else _Q_LORA
        return _NORMS + q + _KV

    def has_qk_norm(self, cfg: Any) -> bool:
        return False   # the latent norms are MLA's own (models.layers.mla.module)

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        heads = int(field(cfg, "num_attention_heads"))
        q_rank = field(cfg, "q_lora_rank")
        kwargs.update(
            multi_latent_attention=True,   # models.build.transformer_config: MLATransformerConfig
            num_query_groups=heads,
            kv_channels=int(field(cfg, "v_head_dim")),
            q_lora_rank=None if q_rank is None else int(q_rank),
            kv_lora_rank=int(field(cfg, "kv_lora_rank")),
            qk_head_dim=int(field(cfg, "qk_nope_head_dim")),
            qk_pos_emb_head_dim=int(field(cfg, "qk_rope_head_dim")),
            v_head_dim=int(field(cfg, "v_head_dim")),
            rope_type="yarn",   # MLA applies models.layers.mla.module.HFRotary's factor on this path
            qk_layernorm=True,  # builds the latent norms (models.layers.mla.module.LatentRMSNorm)
        )
        return kwargs
