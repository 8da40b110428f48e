"""Parallel layout, process groups and the host runtime for Megatron-Core.

This package imports neither `engine` nor `models`.
"""
from parallel.cpu_runtime import skip_megatron_jit_on_cpu
from parallel.layout import LayoutError, ParallelLayout

skip_megatron_jit_on_cpu()  # before any megatron import of the process (see cpu_runtime)

__all__ = ["LayoutError", "ParallelLayout"]
