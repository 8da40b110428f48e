"""Per-rank RNG states of a training checkpoint (engine.checkpoint.checkpointing stores them
under `rng`, one element per global rank, and restores them only at the same layout)."""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import tensor_parallel


def capture_rng() -> dict:
    """This rank's RNG states: python, numpy, torch CPU, torch CUDA (the CPU host's stand-in
    on a CPU host) and megatron's model-parallel tracker."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def restore_rng(states: dict) -> None:
    """Inverse of capture_rng on the same rank and layout."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
