"""Parallel layout, process groups and the host runtime for Megatron-Core.

This package imports neither `engine` nor `models`.
"""
from parallel.layout import LayoutError, ParallelLayout

__all__ = ["LayoutError", "ParallelLayout"]
