"""Megatron-Core's MoE code on a host without Transformer Engine, and one fix.

megatron-core 0.16's `moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not None`,
but the module defines that name only when Transformer Engine imports: without TE every router
forward raises NameError. `install_te_general_gemm()` defines it as None (megatron's own torch
fallback then runs); a no-op when the name exists (TE installed, or megatron-core >= 0.17,
which defines it as None itself).

megatron-core 0.16's `TopKRouter._apply_expert_bias` (the token count of the aux-loss-free
expert-bias update) masks padding with `routing_map & ~padding_mask`, a [tokens, experts] map
against a [tokens] mask: a shape error (or, were tokens == experts, a wrong mask) whenever a
padding mask is given (still so in 0.19). `install_expert_bias()` replaces it with the
intended count: routed (token, expert) pairs of non-padding tokens, in grad-enabled forwards
only (not in evaluation, not twice under activation recomputation), exactly as megatron's
docstring states.

models.build.megatron_patches applies both (entries `moe_te_general_gemm`,
`moe_expert_bias_padding`: the megatron-core versions, the probes).
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


_apply_expert_bias.megatron_original = TopKRouter._apply_expert_bias   # megatron_probes checks it


def install_te_general_gemm() -> None:
    """Idempotent: give moe_utils its missing `te_general_gemm = None` when TE is absent."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install_expert_bias() -> None:
    """Idempotent: TopKRouter counts tokens for the expert bias with `_apply_expert_bias`."""
    TopKRouter._apply_expert_bias = _apply_expert_bias
