"""Megatron-Core's MoE code on a host without Transformer Engine.

megatron-core 0.16's `moe_utils.RouterGatingLinearFunction` tests `te_general_gemm is not None`,
but the module defines that name only when Transformer Engine imports: without TE every router
forward raises NameError. `install()` defines it as None (megatron's own torch fallback then
runs); a no-op when the name exists (TE installed, or a megatron that defines it).
"""
from __future__ import annotations

from megatron.core.transformer.moe import moe_utils


def install() -> None:
    """Idempotent: give moe_utils its missing `te_general_gemm = None` when TE is absent."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
