"""Parallel layout, process groups and the host runtime for Megatron-Core.

This package imports neither `engine` nor `models`.
"""
import warnings

from parallel.cpu_runtime import skip_megatron_jit_on_cpu
from parallel.layout import LayoutError, ParallelLayout

skip_megatron_jit_on_cpu()  # before any megatron import of the process (see cpu_runtime)


def quiet_megatron_import_warnings() -> None:
    """megatron-core warns six times at import that Transformer Engine or Apex is missing; the
    entry points say it once, with what it means (engine.cli.kernel_notice)."""
    warnings.filterwarnings("ignore", category=UserWarning,
                            message="(Transformer Engine and Apex are|Apex is) not installed")


quiet_megatron_import_warnings()  # before any megatron import of the process

__all__ = ["LayoutError", "ParallelLayout", "quiet_megatron_import_warnings"]
