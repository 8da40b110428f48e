"""Zero-centred RMSNorm (Qwen3.5 / Qwen3-Next): y = rmsnorm(x) * (1 + weight), weight stored as
the offset from one (HF `Qwen3_5RMSNorm`, the same numbers as megatron's
`layernorm_zero_centered_gamma`), and the gated RMSNorm of a Gated DeltaNet layer's output.

`ZeroCenteredRMSNorm` is built like megatron's norms (spec extension point: config,
hidden_size, eps) and, like models.layers.norms.local.LocalNorm, tags its weight `sequence_parallel=True`
under Megatron sequence parallelism so its gradient is summed over the TP group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredRMSNorm(torch.nn.Module):
    """HF Qwen3_5RMSNorm: in fp32, x * rsqrt(mean(x^2) + eps) * (1 + weight), cast back to x's
    dtype. `weight` [hidden_size] starts at zero."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """HF Qwen3NextRMSNormGated over the last dimension: weight * rmsnorm(x) (normalised in
    fp32, cast to x's dtype) times silu(gate) in fp32, returned in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)
