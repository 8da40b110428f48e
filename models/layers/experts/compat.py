"""Megatron-Core's MoE code on a host without Transformer Engine, and one fix.

megatron-core 0.16's `moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not None`,
but the module defines that name only when Transformer Engine imports: without TE every router
forward raises NameError. `install()` defines it as None (megatron's own torch fallback then
runs); a no-op when the name exists (TE installed, or a megatron that defines it).

megatron-core 0.16's `TopKRouter._apply_expert_bias` (the token count of the aux-loss-free
expert-bias update) masks padding with `routing_map & ~padding_mask`, a [tokens, experts] map
against a [tokens] mask: a shape error (or, were tokens == experts, a wrong mask) whenever a
padding mask is given. `install()` replaces it with the intended count: routed (token, expert)
pairs of non-padding tokens, in grad-enabled forwards only (not in evaluation, not twice under
activation recomputation), exactly as megatron's docstring states.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
    """Add this forward's routed tokens per expert (padding excluded) to
    local_tokens_per_expert; megatron's finalize_model_grads all-reduces and applies them."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def install() -> None:
    """Idempotent: give moe_utils its missing `te_general_gemm = None` when TE is absent, and
    TopKRouter the padding-aware expert-bias count."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    TopKRouter._apply_expert_bias = _apply_expert_bias
