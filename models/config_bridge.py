"""HF config -> Megatron `TransformerConfig` and `GPTModel` constructor arguments."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.architectures import architecture_of

# Vocab rows are padded to a multiple of this (and of tp). For power-of-two tp <= 128 the padded
# size does not depend on the layout, so one distributed checkpoint loads at any TP.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Smallest multiple of lcm(VOCAB_PAD_MULTIPLE, tp) that holds `vocab_size` rows."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


@dataclass
class ModelShape:
    """What megatron needs besides the TransformerConfig."""

    vocab_size: int          # real vocabulary (HF)
    padded_vocab_size: int   # rows in the Megatron embedding / output layer
    max_sequence_length: int
    rotary_base: float
    tie_word_embeddings: bool


def _get(hf_config, key, default=None):
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def rope_theta(hf_config) -> float:
    theta = _get(hf_config, "rope_theta")
    if theta is None:
        params = _get(hf_config, "rope_parameters") or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def transformer_config(hf_config, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                       cp: int = 1, params_dtype: torch.dtype = torch.float32,
                       **overrides):
    """A TransformerConfig for this HF config at the given layout.

    `calculate_per_token_loss=True` is set: the engine's loss function returns sums and the
    schedule/DDP must neither average over micro-batches nor over DP (see engine.loss).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = architecture_of(hf_config)
    heads = _get(hf_config, "num_attention_heads")
    hidden = _get(hf_config, "hidden_size")
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    bf16 = params_dtype == torch.bfloat16
    kwargs = dict(
        num_layers=_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_get(hf_config, "num_key_value_heads") or heads,
        kv_channels=head_dim,
        ffn_hidden_size=_get(hf_config, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=_get(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def model_shape(hf_config, tp: int = 1) -> ModelShape:
    vocab = _get(hf_config, "vocab_size")
    return ModelShape(
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, tp),
        max_sequence_length=_get(hf_config, "max_position_embeddings", 4096),
        rotary_base=rope_theta(hf_config),
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )
