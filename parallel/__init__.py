"""Parallel layout, process groups and the host runtime for Megatron-Core.

This package imports neither `engine` nor `models`.
"""
import os
import warnings

import torch

from parallel.cpu_runtime import skip_megatron_jit_on_cpu
from parallel.layout import LayoutError, ParallelLayout

skip_megatron_jit_on_cpu()  # before any megatron import of the process (see cpu_runtime)


# Warnings raised inside megatron-core and torch that a user can do nothing about, by message
# (a regular expression matched at the message's start): (category, message, why it is noise).
LIBRARY_WARNINGS = (
    (UserWarning, "(Transformer Engine and Apex are|Apex is) not installed",
     "megatron-core says it six times at import; the entry points say it once, with what it "
     "means (engine.run.launch.kernel_notice)"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf",
     "megatron's distributed optimizer zero_grad reads .grad of its fp32 shard views; the "
     "gradients live in main_grad"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
     "deprecated", "megatron-core's gradient reduce-scatter and parameter all-gather"),
    (FutureWarning, "`load_state_dict` is deprecated", "megatron's checkpoint loading"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor",
     "megatron's checkpoint loading"),
)
# Only on hosts without CUDA, where the advice means nothing (on GPUs it is a real hint)
CPU_ONLY_WARNINGS = (
    (UserWarning, "When using sequence parallelism it is recommended to set the environment "
     "variable CUDA_DEVICE_MAX_CONNECTIONS", "megatron's advice for CUDA streams"),
)
SHOW_ENV = "ENGINE_LIBRARY_WARNINGS"   # =1: show them all (debugging megatron or torch)


def quiet_library_warnings() -> None:
    """Filter LIBRARY_WARNINGS (and CPU_ONLY_WARNINGS without CUDA) for this process, unless
    ENGINE_LIBRARY_WARNINGS=1. Any other warning still shows."""
    if os.environ.get(SHOW_ENV) == "1":
        return
    cpu = CPU_ONLY_WARNINGS if not torch.cuda.is_available() else ()
    for category, message, _ in LIBRARY_WARNINGS + cpu:
        warnings.filterwarnings("ignore", category=category, message=message)


quiet_library_warnings()  # before any megatron import of the process

__all__ = ["LayoutError", "ParallelLayout", "quiet_library_warnings"]
