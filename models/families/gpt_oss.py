"""gpt-oss (GptOssForCausalLM, model_type gpt_oss): OpenAI's open-weight MoE (20b, 120b).

Attention: GQA with q/k/v/o biases (`attention_bias`), YaRN RoPE, one learned sink logit per
head (`self_attn.sinks`: an extra softmax column whose value is dropped; megatron
`softmax_type="learnable"`, the parameter `core_attention.softmax_offset`), and per
`layer_types` either full causal attention or a sliding window of `sliding_window` keys (HF
masks key j for query i when i - j >= sliding_window: megatron `window_size=(w - 1, 0)` on
the layers `window_attn_skip_freq` marks). Both live in models.layers.attention.core.

MoE in every layer: a linear router with a bias (`mlp.router.weight`/`.bias`), top-k of its
logits, softmax over those k (megatron moe_router_pre_softmax=False); experts with biases
computing the clamped SwiGLU: gate clamped above at `swiglu_limit`, the linear half clamped
to +-swiglu_limit, out = gate * sigmoid(swiglu_alpha * gate) * (linear + 1) (megatron
activation_func_clamp_value, glu_linear_offset=1 and `SigmoidGate(alpha)` below). On disk
the experts are fused: `mlp.experts.gate_up_proj` [E, H, 2I] with gate and linear columns
interleaved (gate = [..., ::2]), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H],
`down_proj_bias` [E, H]; published checkpoints store the two matrices as MXFP4
(`*_blocks` + `*_scales`, models.formats.mxfp4). models.layers.biased_experts.fused turns that layout into
per-expert tensors for the generic expert mapping and back. The router bias and the expert
biases are held by models.layers.biased_experts.spec's modules (megatron's own add_bias_linear would refuse
expert-TP > 1).
"""
from __future__ import annotations

from typing import Any

import torch

from models.families.base import Biases, FieldRule, field
from models.families.fields import (ATTENTION_DROPOUT, HEAD_DIM, NORM, PARTIAL_ROTARY, ROPE, TIE,
                                    layer_kinds_problem)
from models.families.moe import MOE_FIELDS, ExpertNaming, MoeFamily

LAYER_KINDS = ("sliding_attention", "full_attention")
QUANT_METHODS = ("mxfp4",)
# The fused on-disk expert tensors of one layer (under model.layers.{i}.mlp.experts.); MXFP4
# checkpoints store the matrices as `{name}_blocks` + `{name}_scales`, which
# models.formats.quantized reads (and the tensor check counts) as `{name}`.
FUSED_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class SigmoidGate:
    """x * sigmoid(x * alpha): the gate half of gpt-oss's SwiGLU, written as HF writes it
    (GptOssExperts._apply_gate), so fp32 results agree bit for bit."""

    def __init__(self, alpha: float):
        self.alpha = float(alpha)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x * self.alpha)

    def __repr__(self) -> str:
        return f"SigmoidGate(alpha={self.alpha})"


def layer_types(cfg: Any) -> list[str]:
    """One kind per layer; transformers fills the default (sliding, full, sliding, ...)."""
    kinds = list(field(cfg, "layer_types", []) or [])
    if kinds:
        return kinds
    return ["sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(int(field(cfg, "num_hidden_layers")))]


def sliding_layers(cfg: Any) -> list[int]:
    """0-based indices of the layers with a sliding window."""
    return [i for i, kind in enumerate(layer_types(cfg)) if kind == "sliding_attention"]


def quant_method(cfg: Any) -> str | None:
    """`quantization_config.quant_method` (None: unquantized)."""
    quant = field(cfg, "quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return str(getattr(method, "value", method))


def _layer_types(cfg: Any) -> str | None:
    return layer_kinds_problem(layer_types(cfg), int(field(cfg, "num_hidden_layers")),
                               LAYER_KINDS)


def _sliding_window(cfg: Any) -> str | None:
    window = field(cfg, "sliding_window")
    if not sliding_layers(cfg) or (isinstance(window, int) and window >= 1):
        return None
    return (f"sliding_window={window!r} with sliding_attention layers is not supported; "
            "supported: an integer >= 1")


def _swiglu_limit(cfg: Any) -> str | None:
    limit = field(cfg, "swiglu_limit", 7.0)
    if float(limit) > 0:
        return None
    return f"swiglu_limit={limit!r} is not supported; supported: a positive number"


def _quantization(cfg: Any) -> str | None:
    method = quant_method(cfg)
    if method is None or method in QUANT_METHODS:
        return None
    return (f"quantization_config.quant_method={method!r} is not supported for gpt_oss; "
            f"supported: none, or {', '.join(QUANT_METHODS)} (the published experts, "
            "dequantized on load)")


def _preset(layers: int, experts: int) -> dict:
    """A published config.json (openai/gpt-oss-20b, -120b)."""
    return dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True,
        attention_dropout=0.0, eos_token_id=200002, experts_per_token=4, head_dim=64,
        hidden_act="silu", hidden_size=2880, initial_context_length=4096,
        initializer_range=0.02, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=131072, num_attention_heads=64, num_experts_per_tok=4,
        num_hidden_layers=layers, num_key_value_heads=8, num_local_experts=experts,
        output_router_logits=False, pad_token_id=199999,
        quantization_config={"modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"], "quant_method": "mxfp4"},
        rms_norm_eps=1e-05, rope_scaling={
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
        tie_word_embeddings=False, use_cache=True, vocab_size=201088)


class GptOss(MoeFamily):
    model_type = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    # the attention (q/k/v/o with biases) by peft's names (models.lora.sites), and the experts'
    # weights in peft's target_parameters format (their biases stay frozen, as in peft; the
    # interleaved gate/up columns: models.layers.biased_experts.fused.lora_row_orders)
    lora = True
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")   # no MLP outside the experts
    lora_hf_paths = {"mlp.gate": "mlp.router"}   # its router (target_parameters router.weight)
    # Per-expert names the generic expert mapping (models.layers.experts.mapping) reads and writes;
    # models.layers.biased_experts.fused translates them to and from the fused on-disk tensors.
    experts = ExpertNaming(block="mlp", gate="gate_proj", up="up_proj", down="down_proj",
                           router_module="router")
    expert_width_field = "intermediate_size"
    renormalise_field = None  # softmax over the k selected logits: always renormalised
    expert_biases = True
    fused_experts_on_disk = True

    def vllm_problems(self, cfg: Any) -> list[str]:
        """vLLM 0.32's experts compute the clamped SwiGLU with the published constants
        written into the kernel (limit 7, alpha 1.702), whatever config.json says."""
        return [f"{name}={value!r}: vLLM's experts use {published} whatever config.json "
                "says; use rollout.backend=hf"
                for name, published in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702))
                if float(value := field(cfg, name, published)) != published]
    fields = (ROPE, PARTIAL_ROTARY, ATTENTION_DROPOUT, HEAD_DIM, NORM, TIE,
              FieldRule("attention_bias", "true (published) or false -> q/k/v biases (megatron "
                        "add_qkv_bias) and the o_proj bias (a biased linear_proj)"),
              FieldRule("(no field) attention sinks", "self_attn.sinks [heads] -> megatron "
                        "softmax_type=learnable, core_attention.softmax_offset (TP-sharded "
                        "by head; models.layers.attention.core)"),
              FieldRule("layer_types", "sliding_attention / full_attention per layer -> "
                        "window_attn_skip_freq (1: windowed)", _layer_types),
              FieldRule("sliding_window", "an integer w >= 1 -> window_size=(w - 1, 0) on the "
                        "sliding layers (a query sees itself and the w - 1 keys before it)",
                        _sliding_window),
              FieldRule("swiglu_limit", "positive -> activation_func_clamp_value (gate "
                        "clamped above, linear half to +-limit)", _swiglu_limit),
              FieldRule("swiglu_alpha", "any -> the gate's sigmoid gain (SigmoidGate)"),
              FieldRule("(no field) +1 on the linear half", "-> glu_linear_offset=1.0"),
              FieldRule("hidden_act", "ignored, as transformers ignores it: the experts always "
                        "apply the clamped SwiGLU"),
              FieldRule("(no field) router", "a linear with a bias; top-k of the logits, softmax "
                        "over the k -> moe_router_pre_softmax=false and a biased router "
                        "(models.layers.biased_experts.spec)"),
              FieldRule("(no field) expert biases", "gate_up_proj_bias / down_proj_bias -> "
                        "each expert's linear_fc1 / linear_fc2 bias (models.layers.biased_experts.spec)"),
              FieldRule("intermediate_size", "any -> moe_ffn_hidden_size (each expert's "
                        "SwiGLU; gpt-oss has no dense MLP)"),
              FieldRule("quantization_config", "absent, or quant_method mxfp4: the experts' "
                        "*_blocks / *_scales dequantized exactly on load (models.formats.mxfp4); "
                        "exported unquantized; refused: other methods", _quantization),
              FieldRule("experts_per_token / initial_context_length / rope_ntk_* "
                        "(OpenAI's original names)", "ignored, as transformers ignores them "
                        "(num_experts_per_tok and rope_parameters carry the values)"),
              FieldRule("max_position_embeddings", "any -> max_sequence_length"),
              FieldRule("initializer_range / use_cache / pad_token_id / bos_token_id / "
                        "eos_token_id", "no effect on the forward pass"),
              ) + MOE_FIELDS
    presets = {"gpt-oss-20b": _preset(24, 32), "gpt-oss-120b": _preset(36, 128)}

    def biases(self, cfg: Any) -> Biases:
        attention = bool(field(cfg, "attention_bias", True))
        return Biases(qkv=attention, o_proj=attention)

    def layer_tensors(self, cfg: Any) -> tuple[str, ...]:
        """On-disk names: attention (+ biases, sinks), norms, router, fused experts."""
        b = self.biases(cfg)
        names = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.sinks", "mlp.router.weight", "mlp.router.bias"]
        names += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        if b.qkv:
            names += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
        return tuple(names) + tuple(f"mlp.experts.{n}" for n in FUSED_EXPERT_TENSORS)

    def expert_parameters(self, cfg: Any) -> int:
        """Parameters of one expert: the SwiGLU matrices and its gate/up/down biases."""
        h, i = int(field(cfg, "hidden_size")), self.expert_width(cfg)
        return 3 * h * i + 2 * i + h

    def extra_layer_parameters(self, cfg: Any) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters besides the generic count: the sinks (one per
        head, split with the heads) and the router bias."""
        return int(field(cfg, "num_attention_heads")), self.num_experts(cfg)

    def attention_score_elements(self, cfg: Any, seq_length: int, tp: int) -> float:
        """The sink attention (models.layers.attention.sinks) keeps each head's probabilities
        [s, s + 1] for the backward pass, in every layer (sliding ones too: the window is a
        mask): per token a row of seq_length + 1 per head of this TP rank (under Ulysses CP
        each rank holds heads / cp of whole sequences: the same count per local token)."""
        return (seq_length + 1) * int(field(cfg, "num_attention_heads")) / tp

    def transformer_kwargs(self, cfg: Any) -> dict:
        kwargs = super().transformer_kwargs(cfg)
        layers = int(field(cfg, "num_hidden_layers"))
        sliding = set(sliding_layers(cfg))
        window = int(field(cfg, "sliding_window", 0) or 0)
        kwargs.update(
            activation_func=SigmoidGate(field(cfg, "swiglu_alpha", 1.702)),
            activation_func_clamp_value=float(field(cfg, "swiglu_limit", 7.0)),
            glu_linear_offset=1.0,
            softmax_type="learnable",
            window_size=(window - 1, 0) if sliding else None,
            window_attn_skip_freq=[int(i in sliding) for i in range(layers)] if sliding
            else None,
        )
        return kwargs
