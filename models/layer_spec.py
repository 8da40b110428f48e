"""Transformer layer spec choice: Transformer Engine's when it imports, else the local spec with
the project's SDPA core attention."""
from __future__ import annotations

import importlib.util

from models.core_attention import SDPACoreAttention


def transformer_engine_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install (e.g. no CUDA) must not break the local path
        return False
    import torch
    return torch.cuda.is_available()


def layer_spec(config, use_te: bool | None = None):
    """The GPT layer spec for `config`; `use_te=None` picks TE when available."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = transformer_engine_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                          normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
