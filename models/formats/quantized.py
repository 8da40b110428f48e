"""Quantized HF checkpoints as published: `quantization_config.quant_method` dispatch.

A method (`QuantMethod`, one entry of QUANT_METHODS per quant_method) says which config values
it reproduces exactly, which stored tensors make up one logical weight (e.g. FP8: `X.weight` in
float8_e4m3fn plus `X.weight_scale_inv`), how to dequantize them on load and how to quantize
them again on export. Every other quant_method is refused by name (`quantization_problem`).

`DequantizingReader` wraps a models.hf.io.SafetensorsReader: its names are the logical weights
(scales hidden), `get` returns them dequantized (fp32), and a float8 tensor that no scale
accompanies is refused instead of being cast silently. models.bridge.weights.load_hf_weights reads
every checkpoint through it, so unquantized checkpoints read exactly as before.

Export (unquantized by default, or quantized again with the source's scales) and the record
of the source's scales and dtypes: models.hf.quantized_export.

Plain torch (no megatron, no transformers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from models.formats import fp8 as fp8_blocks
from models.formats import mxfp4
from models.families.base import UnmappedTensorsError, field


def quantization_config(cfg: Any) -> dict | None:
    """The config's quantization_config as a dict (None: unquantized)."""
    quant = field(cfg, "quantization_config")
    if quant is None:
        return None
    return dict(quant) if isinstance(quant, dict) else dict(quant.to_dict())


def quant_method(cfg: Any) -> str | None:
    quant = quantization_config(cfg)
    if quant is None:
        return None
    method = quant.get("quant_method")
    return str(getattr(method, "value", method))


@dataclass(frozen=True)
class QuantMethod:
    """One quant_method (the gpt-oss MXFP4 experts would be another entry). `problems(qcfg)`:
    config values not reproduced exactly; `parts(names)`: logical weight -> the stored names it
    is made of (the weight's own name first); `dequantize(name, tensors, qcfg)`: the fp32
    weight from its stored tensors (in `parts` order); `quantize(name, tensor, source, qcfg)`:
    {stored name: tensor} of one weight, `source` the source's recorded parts of it (its
    scales; {} when none were recorded)."""

    problems: Callable[[dict], list[str]]
    parts: Callable[[Iterable[str]], dict[str, tuple[str, ...]]]
    dequantize: Callable[[str, list[torch.Tensor], dict], torch.Tensor]
    quantize: Callable[[str, torch.Tensor, dict[str, torch.Tensor], dict],
                       dict[str, torch.Tensor]]


def _block(qcfg: dict) -> tuple[int, int]:
    b0, b1 = qcfg.get("weight_block_size") or (0, 0)
    return int(b0), int(b1)


def _fp8_problems(qcfg: dict) -> list[str]:
    wrong = []
    checks = (("activation_scheme", "dynamic"), ("fmt", "e4m3"), ("scale_fmt", "float"),
              ("expert_dtype", "fp8"))
    for key, allowed in checks:
        value = qcfg.get(key, allowed)
        if str(value).lower() != allowed:
            wrong.append(f"quantization_config.{key}={value!r} is not supported for "
                         f"quant_method fp8; supported: {allowed}")
    block = qcfg.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        wrong.append(f"quantization_config.weight_block_size={block!r} is not supported; "
                     "supported: two positive integers (block-scaled weights, e.g. [128, 128])")
    return wrong


def _fp8_parts(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    names = set(names)
    suffix = fp8_blocks.SCALE_SUFFIX
    return {n[:-len(suffix)]: (n[:-len(suffix)], n) for n in names
            if n.endswith(suffix) and n[:-len(suffix)] in names}


def _fp8_dequantize(name: str, tensors: list[torch.Tensor], qcfg: dict) -> torch.Tensor:
    return fp8_blocks.dequantize(tensors[0], tensors[1], _block(qcfg), name)


def _fp8_quantize(name: str, tensor: torch.Tensor, source: dict[str, torch.Tensor],
                  qcfg: dict) -> dict[str, torch.Tensor]:
    scale_name = name + fp8_blocks.SCALE_SUFFIX
    q, scales = fp8_blocks.quantize(tensor, _block(qcfg), source.get(scale_name))
    return {name: q, scale_name: scales}


def _mxfp4_problems(qcfg: dict) -> list[str]:
    return []  # which tensors are quantized shows in the names (X_blocks + X_scales)


def _mxfp4_parts(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    names = set(names)
    blocks, scales = mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX
    return {n[:-len(blocks)]: (n, n[:-len(blocks)] + scales) for n in names
            if n.endswith(blocks) and n[:-len(blocks)] + scales in names}


def _mxfp4_dequantize(name: str, tensors: list[torch.Tensor], qcfg: dict) -> torch.Tensor:
    return mxfp4.dequantize(tensors[0], tensors[1])


def _mxfp4_quantize(name: str, tensor: torch.Tensor, source: dict[str, torch.Tensor],
                    qcfg: dict) -> dict[str, torch.Tensor]:
    blocks, scales = mxfp4.quantize(tensor, source.get(name + mxfp4.SCALES_SUFFIX))
    return {name + mxfp4.BLOCKS_SUFFIX: blocks, name + mxfp4.SCALES_SUFFIX: scales}


QUANT_METHODS: dict[str, QuantMethod] = {
    "fp8": QuantMethod(_fp8_problems, _fp8_parts, _fp8_dequantize, _fp8_quantize),
    # gpt-oss experts (models.formats.mxfp4): X_blocks + X_scales stand for X
    "mxfp4": QuantMethod(_mxfp4_problems, _mxfp4_parts, _mxfp4_dequantize, _mxfp4_quantize),
}


def quantization_problem(cfg: Any) -> str | None:
    """None when the config is unquantized or its quantization loads exactly, else one
    sentence naming the field and what is supported."""
    method = quant_method(cfg)
    if method is None:
        return None
    if method not in QUANT_METHODS:
        return (f"quantization_config.quant_method={method!r} is not supported; supported: "
                f"none, {', '.join(QUANT_METHODS)} (dequantized exactly on load)")
    problems = QUANT_METHODS[method].problems(quantization_config(cfg))
    return "; ".join(problems) or None


def logical_parts(cfg: Any, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Logical weight -> stored names, for the config's quant method ({} unquantized)."""
    method = quant_method(cfg)
    return QUANT_METHODS[method].parts(names) if method in QUANT_METHODS else {}


def logical_names(cfg: Any, names: Iterable[str]) -> list[str]:
    """A checkpoint's tensor names as the bridge sees them: each quantized weight once, under
    its weight name, its other stored parts (scales; MXFP4's X_blocks too) hidden."""
    names = list(names)
    parts = logical_parts(cfg, names)
    hidden = {p for logical, stored in parts.items() for p in stored if p != logical}
    return [n for n in names if n not in hidden] + [n for n in parts if n not in names]


class DequantizingReader:
    """A reader (keys / __contains__ / get) whose quantized weights read dequantized (fp32)."""

    def __init__(self, reader, cfg: Any):
        self.reader, self.cfg = reader, cfg
        self.qcfg = quantization_config(cfg) or {}
        self.method = QUANT_METHODS.get(quant_method(cfg) or "")
        self.parts = logical_parts(cfg, reader.keys())
        self._names = logical_names(cfg, reader.keys())

    def keys(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> torch.Tensor:
        if name in self.parts:
            stored = [self.reader.get(n) for n in self.parts[name]]
            return self.method.dequantize(name, stored, self.qcfg)
        tensor = self.reader.get(name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UnmappedTensorsError(
                f"tensor {name!r} is stored as {tensor.dtype} without a scale the config's "
                f"quantization_config ({quant_method(self.cfg)!r}) explains; refusing to "
                "cast it unscaled")
        return tensor

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """get(name)[start:stop], reading only those rows of the stored parts when the method
        keeps rows apart (MXFP4: dim 0 is the expert; models.layers.biased_experts.fused)."""
        if name in self.parts and quant_method(self.cfg) == "mxfp4":
            stored = [_read_rows(self.reader, n, start, stop) for n in self.parts[name]]
            return self.method.dequantize(name, stored, self.qcfg)
        if name in self.parts:
            return self.get(name)[start:stop]
        return _read_rows(self.reader, name, start, stop)


def _read_rows(reader, name: str, start: int, stop: int) -> torch.Tensor:
    """tensor[start:stop] of a reader (a slice read where it offers `get_rows`)."""
    if hasattr(reader, "get_rows"):
        return reader.get_rows(name, start, stop)
    return reader.get(name)[start:stop]
