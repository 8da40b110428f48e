"""A stream of HF-named full tensors quantized the way its source checkpoint stores them: the RL
weight sync to rollout engines that load a published FP8 checkpoint as FP8
(rollout.sync_quantization=fp8; engine.rl.policy.weight_export applies it).

`QuantizedSource(hf_dir, cfg)` reads, once, which tensors the HF folder `hf_dir` stores
quantized (models.formats.quantized.logical_parts of its stored names: for FP8 every `X.weight` with a
`X.weight_scale_inv` beside it), and `quantize(stream)` yields, for each such weight, its
stored parts in the source's order (FP8: `X.weight` in float8_e4m3fn, then
`X.weight_scale_inv` fp32; the weight first, its scale right after it), quantized by the
method's own `quantize` with the source's scales (models.formats.fp8.quantize: a block keeps the
published scale while its values still round to finite e4m3 values with it, else amax / 448),
exactly what `tools/convert.py mcore-to-hf --quantize fp8` writes for the same tensors
(models.hf.quantized_export.export_tensors, whose recorded scales are the source's as read). Every
other tensor (embeddings, norms, router, lm_head, biases, ...) passes unchanged. The source's
scales are read lazily, one weight at a time, and moved to the weight's device (GPU exports
quantize on the GPU; IEEE division and round-to-nearest-even give the same bytes as on CPU).

Plain torch + safetensors (no megatron, no transformers).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Iterator

import torch

from models.hf.io import SafetensorsReader
from models.formats.quantized import QUANT_METHODS, logical_parts, quant_method, quantization_config

# what a sync may quantize to: the source's own method (mxfp4 export exists, but no rollout
# engine of this project takes MXFP4 updates)
SYNC_METHODS = ("fp8",)


def source_problem(hf_dir: str | os.PathLike | None, cfg: Any, method: str) -> str | None:
    """None when the model (HF config `cfg`, folder `hf_dir` when given and present) can be
    synced as `method`, else one sentence: the config must publish that quant_method, and the
    folder must store at least one weight that way."""
    if method not in SYNC_METHODS:
        return f"quantization {method!r} is not supported; supported: {', '.join(SYNC_METHODS)}"
    published = quant_method(cfg)
    if published != method:
        return (f"the model's config.json has quantization_config.quant_method={published!r}, "
                f"not {method!r}: only a checkpoint published in {method} tells which tensors an "
                f"{method} engine holds quantized (and with which blocks)")
    if hf_dir is None or not os.path.isdir(hf_dir):
        return None
    names = SafetensorsReader(hf_dir).keys()
    if not logical_parts(cfg, names):
        return (f"{hf_dir} stores no weight in {method} (no *.weight_scale_inv beside a weight) "
                "although its config says so")
    return None


class QuantizedSource:
    """The quantized layout of the HF folder `hf_dir` (config `cfg`, its quant_method one of
    SYNC_METHODS): `parts` maps each quantized weight to its stored names (weight first)."""

    def __init__(self, hf_dir: str | os.PathLike, cfg: Any):
        problem = source_problem(hf_dir, cfg, quant_method(cfg) or "none")
        if problem is not None:
            raise ValueError(problem)
        self.reader = SafetensorsReader(hf_dir)
        self.qcfg = quantization_config(cfg)
        self.method = QUANT_METHODS[quant_method(cfg)]
        self.parts = logical_parts(cfg, self.reader.keys())

    def quantize_one(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{stored name: tensor} of quantized weight `name` (its parts, weight first)."""
        source = {n: self.reader.get(n).to(tensor.device) for n in self.parts[name][1:]}
        out = self.method.quantize(name, tensor, source, self.qcfg)
        return {n: out[n] for n in self.parts[name]}

    def quantize(self, stream: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """`stream` with every weight the source stores quantized replaced by its stored
        parts (module docstring); lazy, one tensor at a time."""
        for name, tensor in stream:
            if name in self.parts:
                yield from self.quantize_one(name, tensor).items()
            else:
                yield name, tensor
