"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (per-head q/k RMSNorm) with a sparse MoE
block in every decoder layer: a linear router `mlp.gate` (no bias) over `num_experts` SwiGLU
experts `mlp.experts.{e}.{gate,up,down}_proj`, softmax over all experts, top-k, optional
renormalisation of the k weights (`norm_topk_prob`).

Megatron mapping: `num_moe_experts`, `moe_router_topk`, `moe_ffn_hidden_size`, softmax score
function; HF's "softmax over all experts then top-k then renormalise" is megatron's
`moe_router_pre_softmax=False` (top-k of the logits, softmax over those k: the same numbers),
and without renormalisation `moe_router_pre_softmax=True` (softmax over all, then top-k).
No token dropping (HF never drops), no expert bias, no shared expert.

Config fields that only matter for HF's own training loss (`router_aux_loss_coef`,
`output_router_logits`) decide the default of the engine's `moe.aux_loss_coeff`
(engine.moe_settings); they never change the forward pass.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Biases, Family, FieldRule, field
from models.families.fields import COMMON_FIELDS, SLIDING_WINDOW

_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def num_experts(cfg: Any) -> int:
    """`num_experts` (config.json spelling of the Qwen3-MoE releases) or `num_local_experts`
    (transformers >= 5 stores it under this name)."""
    return int(field(cfg, "num_experts", field(cfg, "num_local_experts", 0)))


def is_moe(cfg: Any) -> bool:
    """True for configs of a mixture-of-experts family (experts in the decoder layers)."""
    return field(cfg, "model_type") == Qwen3Moe.model_type


def experts_per_layer(cfg: Any) -> int:
    """Experts of each MoE layer of any family's config; 0 for a dense model (the value
    parallel.layout's `num_experts` check expects)."""
    return num_experts(cfg) if is_moe(cfg) else 0


def _num_experts(cfg: Any) -> str | None:
    if num_experts(cfg) >= 1:
        return None
    return (f"num_experts={num_experts(cfg)} is not supported (no sparse layer: use model_type "
            "qwen3); supported: >= 1")


def _top_k(cfg: Any) -> str | None:
    k, e = int(field(cfg, "num_experts_per_tok", 0)), num_experts(cfg)
    if 1 <= k <= max(e, 1):
        return None
    return f"num_experts_per_tok={k} is not supported; supported: 1..num_experts={e}"


def _dense_layers(cfg: Any) -> list[int]:
    """Layers HF builds with a dense MLP instead of experts (decoder_sparse_step,
    mlp_only_layers), as Qwen3MoeDecoderLayer decides."""
    step = int(field(cfg, "decoder_sparse_step", 1))
    only = set(field(cfg, "mlp_only_layers", []) or [])
    layers = int(field(cfg, "num_hidden_layers"))
    return [i for i in range(layers) if i in only or step < 1 or (i + 1) % step != 0]


def _sparse_layers(cfg: Any) -> str | None:
    dense = _dense_layers(cfg)
    if not dense:
        return None
    return (f"decoder_sparse_step={field(cfg, 'decoder_sparse_step', 1)!r} with "
            f"mlp_only_layers={list(field(cfg, 'mlp_only_layers', []) or [])!r} gives layers "
            f"{dense} a dense MLP; the bridge maps only all-sparse models; supported: "
            "decoder_sparse_step=1 and mlp_only_layers=[]")


def _router_jitter(cfg: Any) -> str | None:
    noise = float(field(cfg, "router_jitter_noise", 0.0))
    if noise == 0.0:
        return None
    return f"router_jitter_noise={noise!r} is not supported; supported: 0.0"


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    qk_norm = True
    fields = COMMON_FIELDS + (
        SLIDING_WINDOW,
        FieldRule("attention_bias", "false; true -> q/k/v biases (megatron add_qkv_bias) and "
                  "the o_proj bias (a biased linear_proj, models.layer_spec)"),
        FieldRule("(no field) q/k norm", "always on in HF Qwen3-MoE -> megatron qk_layernorm"),
        FieldRule("num_experts (num_local_experts)", ">= 1 -> num_moe_experts", _num_experts),
        FieldRule("num_experts_per_tok", "1..num_experts -> moe_router_topk", _top_k),
        FieldRule("moe_intermediate_size", "any -> moe_ffn_hidden_size (each expert's SwiGLU)"),
        FieldRule("norm_topk_prob", "true -> moe_router_pre_softmax=false (softmax over the k "
                  "selected logits = renormalised top-k of the full softmax); false -> "
                  "moe_router_pre_softmax=true (softmax over all experts, top-k unscaled)"),
        FieldRule("decoder_sparse_step / mlp_only_layers", "every layer sparse (step 1, no "
                  "mlp_only_layers) -> an MoE layer everywhere; refused: dense layers",
                  _sparse_layers),
        FieldRule("intermediate_size", "unused when every layer is sparse (HF uses it only for "
                  "dense layers)"),
        FieldRule("router_jitter_noise", "0.0; refused: anything else", _router_jitter),
        FieldRule("router_aux_loss_coef / output_router_logits", "training only: the default "
                  "of moe.aux_loss_coeff is router_aux_loss_coef when output_router_logits is "
                  "true (HF adds the loss only then), else 0"),
    )
    presets = {
        "qwen3-30b-a3b": dict(
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
            intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            router_aux_loss_coef=0.001, output_router_logits=False),
    }

    def biases(self, cfg: Any) -> Biases:
        attention = bool(field(cfg, "attention_bias", False))
        return Biases(qkv=attention, o_proj=attention)

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        dense_mlp = {f"mlp.{p}.weight" for p in _EXPERT_PROJ}
        names = [n for n in super().layer_tensors(cfg) if n not in dense_mlp]
        names.append("mlp.gate.weight")
        names += [f"mlp.experts.{e}.{p}.weight" for e in range(num_experts(cfg))
                  for p in _EXPERT_PROJ]
        return tuple(names)

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        kwargs.update(
            num_moe_experts=num_experts(cfg),
            moe_router_topk=int(field(cfg, "num_experts_per_tok")),
            moe_ffn_hidden_size=int(field(cfg, "moe_intermediate_size")),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(field(cfg, "norm_topk_prob", False)),
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",  # engine.moe_settings: moe.token_dispatcher
        )
        return kwargs
