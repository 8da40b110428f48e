"""The float64 scaffold of a non-linear per-sequence loss: its value and its derivatives in the
per-sequence sums, by autograd on small detached tensors (the coefficients of
engine.preference.table.coefficient_loss)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def float64_gradients(loss_of: Callable, sums: Sequence[torch.Tensor], scale: float
                      ) -> tuple[object, list[torch.Tensor]]:
    """(result, grads): `loss_of(*leaves)` returns (losses [n], result) computed from float64
    leaf copies of the detached `sums` (each [n]); grads[j] = d(scale * sum losses) / d sums[j],
    float64 [n]. Works inside torch.no_grad; with n = 0 the grads are empty."""
    with torch.enable_grad():
        leaves = [s.detach().to(torch.float64).requires_grad_(True) for s in sums]
        losses, result = loss_of(*leaves)
        if leaves[0].numel() == 0:
            return result, [leaf.detach() for leaf in leaves]
        grads = torch.autograd.grad(losses.sum() * scale, leaves)
    return result, list(grads)
