"""Modes of a model's LoRA adapters for one block of code (docs/lora.md): switched off (the
bare base), computing with their frozen reference matrices (the starting adapter of a run
from model.lora.init_from), without dropout (forward-only passes). Each context manager sets
a flag on every models.lora.adapters.LoraAdapter of the given model chunks (wrapped or not)
and restores it on exit, also on an exception; local to this rank: every rank of a
collective forward enters it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from models.lora.adapters import LoraAdapter


def lora_adapters(chunks: list) -> list[LoraAdapter]:
    """Every LoraAdapter of `chunks` (model chunks, wrapped or not), in module order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]


@contextmanager
def _switched(found: list[LoraAdapter], attr: str, value: bool) -> Iterator[int]:
    """Every adapter of `found` with `attr` set to `value` inside the block, its own value
    back afterwards (also on an exception); yields len(found)."""
    states = [getattr(m, attr) for m in found]
    for m in found:
        setattr(m, attr, value)
    try:
        yield len(found)
    finally:
        for m, state in zip(found, states):
            setattr(m, attr, state)


@contextmanager
def adapters_disabled(chunks: list) -> Iterator[int]:
    """Within the block every LoraAdapter of `chunks` (model chunks, wrapped or not) adds
    nothing: the chunks compute their frozen base model exactly (the base weights are the
    same tensors, untouched by training). Yields the number of adapters switched off (0: no
    LoRA, the block runs the model as it is); they are switched back on when the block exits,
    also on an exception. Local to this rank: every rank of a collective forward must enter
    it. The reference of a LoRA run from fresh adapters (DPO: engine.dpo.reference; RL's KL
    reference: engine.rl.policy.logprob_stage)."""
    with _switched(lora_adapters(chunks), "enabled", False) as n:
        yield n


def attach_reference(chunks: list) -> int:
    """Give every LoraAdapter of `chunks` frozen reference matrices: zeros of its parameters'
    shapes, dtypes and devices (this rank's shards), no gradient, outside the state dict.
    Returns the number of adapters. models.lora.peft.load_reference_adapter fills them."""
    found = lora_adapters(chunks)
    for m in found:
        m.reference = {n: torch.zeros_like(p, requires_grad=False)
                       for n, p in m.named_parameters(recurse=False)}
    return len(found)


def has_reference(chunks: list) -> bool:
    """Whether `chunks` hold adapters and every one has reference matrices."""
    found = lora_adapters(chunks)
    return bool(found) and all(m.reference is not None for m in found)


@contextmanager
def reference_adapters(chunks: list) -> Iterator[int]:
    """Within the block every LoraAdapter of `chunks` computes with its frozen reference
    matrices (attach_reference) instead of its parameters, through every path its parameters
    take (the linears' hooks, grouped experts' factors, routers, the shared expert's gate), and
    `set_full` writes into them. The trained parameters are neither read nor changed. Yields
    the number of adapters; raises RuntimeError when one has no reference. Local to this
    rank, like adapters_disabled. The reference of a LoRA run from model.lora.init_from."""
    found = lora_adapters(chunks)
    missing = sum(m.reference is None for m in found)
    if missing:
        raise RuntimeError(f"{missing} of {len(found)} LoRA adapters have no reference "
                           "matrices (models.lora.adapters.attach_reference)")
    with _switched(found, "use_reference", True) as n:
        yield n


@contextmanager
def dropout_disabled(chunks: list) -> Iterator[int]:
    """Within the block no LoraAdapter of `chunks` applies dropout (model.lora.dropout), in
    training mode too, and none draws random numbers for it: TrainEngine.forward_only (every
    forward-only pass: evaluation, the DPO reference, RL's old, reference and teacher log-probs)
    runs inside it. Yields the number of adapters; local to this rank."""
    with _switched(lora_adapters(chunks), "dropout_off", True) as n:
        yield n
