"""Torch RMSNorm / LayerNorm for the local (non Transformer Engine) layer spec, usable with
Megatron sequence parallelism.

Megatron's own `WrappedTorchNorm` refuses `sequence_parallel`. The math of a norm does not
change with it: each TP rank normalises its own slice of the sequence. What changes is the
gradient of the norm's weight (and bias): each TP rank holds only its sequence slice's part of
it, so the parts must be summed over the tensor-parallel group. Megatron's
`finalize_model_grads` does exactly that for every parameter carrying the attribute
`sequence_parallel=True` (TE's norms set it too); `LocalNorm` sets it when the config has
sequence parallelism on. Without the attribute each TP rank would step with a partial gradient
and the replicas would drift apart.
"""
from __future__ import annotations

import torch


class LocalNorm:
    """A `torch.nn.RMSNorm` or `torch.nn.LayerNorm` (by `config.normalization`) over the last
    dimension of size `hidden_size`, with parameters in `config.params_dtype`, constructed like
    megatron's norms (spec extension point).
    With `config.sequence_parallel` its parameters are tagged `sequence_parallel=True` so their
    gradients are summed over the TP group before the optimizer step."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("LocalNorm: zero-centered gamma is not supported")
        # in the model's dtype, like megatron's and TE's own layers: with bf16 activations an
        # fp32 weight makes torch skip its fused CUDA norm kernel (a mixed-dtype warning)
        dtype = config.params_dtype
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        else:
            raise ValueError(f"LocalNorm: normalization {config.normalization!r} is not "
                             "supported (RMSNorm, LayerNorm)")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm
