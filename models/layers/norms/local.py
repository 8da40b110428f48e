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

`LocalNorm(..., fused=True)` (key `model.fusions.rmsnorm`, engine.config.fusion_settings) builds
a `FusedRMSNorm` instead of torch.nn.RMSNorm: the same math (`rms_norm`, torch's own order of
operations: the reciprocal RMS in fp32, the normalised input cast back to the input dtype, then
times the weight) run through `torch.compile`, whose generated backward computes the weight
gradient as one fused reduction kernel instead of eager autograd's chain of element-wise
kernels and a slow strided sum over the tokens.
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
                normalization: str = "LayerNorm", fused: bool = False):
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("LocalNorm: zero-centered gamma is not supported")
        # in the model's dtype, like megatron's and TE's own layers: with bf16 activations an
        # fp32 weight makes torch skip its fused CUDA norm kernel (a mixed-dtype warning)
        dtype = config.params_dtype
        if config.normalization == "RMSNorm" and fused:
            norm = FusedRMSNorm(hidden_size, eps=eps, dtype=dtype)
        elif config.normalization == "RMSNorm":
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in torch.nn.RMSNorm's (and HF's) order: x times the
    reciprocal RMS computed in fp32, cast to x's dtype, times `weight`."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x * rstd).to(x.dtype) * weight


_COMPILED = None


def compiled_rms_norm():
    """`rms_norm` under torch.compile (dynamic shapes: one graph for every sequence length),
    compiled on first use. Not fullgraph: an RL run meets more variants than dynamo's
    recompile limit (grad and no-grad, bf16 and the fp32 weight-sync probe, the QK norms'
    widths); with fullgraph=True the ninth one stopped the run on an H100 (2026-11-24), now
    such a variant runs the same function eagerly (same numbers; GRPO with every fusion on
    finished on the H100 after this change)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(rms_norm, dynamic=True)
    return _COMPILED


class FusedRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's parameters (`weight` [hidden_size], ones) and state-dict names,
    forward `compiled_rms_norm()(x, weight, eps)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_rms_norm()(x, self.weight, self.eps)
