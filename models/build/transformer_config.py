"""HF config -> Megatron `TransformerConfig` and the other `GPTModel` arguments.

The model's math comes from its family (models.families: `transformer_kwargs`, checked against
the family's field table first); this module adds RoPE scaling (models.layers.attention.rope), the layout, the
dtype and the engine's fixed settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                          TransformerConfig)

from models.families.registry import family_of
from models.families.base import field
from models.estimate.counting import padded_vocab_size
from models.estimate.counting import VOCAB_PAD_MULTIPLE
from models.hf.config import check_config, hf_config_object
from models.layers.attention.rope import rope_theta, softmax_scale

__all__ = ["ModelShape", "VOCAB_PAD_MULTIPLE", "model_shape", "padded_vocab_size",
           "rope_theta", "transformer_config"]


@dataclass
class ModelShape:
    """What megatron needs besides the TransformerConfig."""

    vocab_size: int          # real vocabulary (HF)
    padded_vocab_size: int   # rows in the Megatron embedding / output layer
    max_sequence_length: int
    rotary_base: float
    tie_word_embeddings: bool


def transformer_config(hf_config: Any, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
                       cp: int = 1, params_dtype: torch.dtype = torch.float32,
                       **overrides) -> TransformerConfig:
    """A TransformerConfig for this HF config at the given layout. Raises
    UnsupportedConfigError when a field does not map exactly (models.hf.config).

    `calculate_per_token_loss=True` is set: the engine's loss function returns sums and the
    schedule/DDP must neither average over micro-batches nor over DP (see engine.training.loss).
    """
    check_config(hf_config)
    kwargs = family_of(hf_config).transformer_kwargs(hf_config_object(hf_config))
    kwargs.update(
        softmax_scale=softmax_scale(hf_config),
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
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    kwargs.update(overrides)
    if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__:
        # megatron-core 0.16's default "full" is deprecated by megatron itself (a UserWarning
        # on every build); the empty list is what it maps "full" to
        kwargs.setdefault("cuda_graph_scope", [])
    if kwargs.get("multi_latent_attention"):  # DeepSeek-V3 MLA: models.layers.mla.module
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def model_shape(hf_config: Any, tp: int = 1) -> ModelShape:
    vocab = field(hf_config, "vocab_size")
    return ModelShape(
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, tp),
        max_sequence_length=field(hf_config, "max_position_embeddings", 4096),
        rotary_base=rope_theta(hf_config),
        tie_word_embeddings=bool(field(hf_config, "tie_word_embeddings", False)),
    )
