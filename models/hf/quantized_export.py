"""Export of a checkpoint converted from a quantized HF folder (models.formats.quantized), and the
record of that source which makes it possible.

`record_source` (models.bridge.checkpoint.write_metadata: every checkpoint written from an HF folder,
conversions and training checkpoints alike) stores in the checkpoint's own folder (`hf_source/`;
an older checkpoint's `hf/`), as `quantization.safetensors`, the stored parts of every quantized
weight besides the weight itself (FP8: the fp32 scales), as read, and the stored dtype of every
tensor of the source.

`export_tensors` (tools/convert.py mcore-to-hf): unquantized by default (the dequantized weights
in bf16, every other tensor in its source dtype, config.json without quantization_config); with
`--quantize fp8` the weights the source stored as FP8 are quantized again with the recorded
scales (models.formats.fp8.quantize: an untrained model gives back the same bytes), the other
tensors keep their source dtype and the config its quantization_config.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.hf.io import SafetensorsReader
from models.formats.quantized import (QUANT_METHODS, logical_parts, quant_method,
                              quantization_config)

SOURCE_FILE = "quantization.safetensors"  # in a checkpoint's hf_source/: scales and dtypes

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def record_source(src_hf_dir: str | os.PathLike | None, cfg: dict,
                  dst_dir: str | os.PathLike) -> int:
    """For a quantized HF folder: write `dst_dir/quantization.safetensors` holding the stored
    parts of every quantized weight besides the weight itself (FP8: the scales), as read, and
    the stored dtype of every tensor (metadata "dtypes"). Returns how many parts were written
    (0: unquantized config, or no weights in `src_hf_dir`)."""
    weights = ("model.safetensors", "model.safetensors.index.json")
    if (quant_method(cfg) is None or src_hf_dir is None
            or not any((Path(src_hf_dir) / f).is_file() for f in weights)):
        return 0
    reader = SafetensorsReader(src_hf_dir)
    parts = logical_parts(cfg, reader.keys())
    aux = {p: reader.get(p).contiguous() for stored in parts.values() for p in stored[1:]}
    dtypes = {n: reader.dtype_name(n) for n in reader.keys()}
    save_file(aux, str(Path(dst_dir) / SOURCE_FILE), metadata={"dtypes": json.dumps(dtypes)})
    return len(aux)


def read_source(hf_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(recorded parts, recorded dtypes) of a checkpoint's own folder `hf_dir`
    (models.bridge.checkpoint.source_dir; {} and {}: none)."""
    path = Path(hf_dir) / SOURCE_FILE
    if not path.is_file():
        return {}, {}
    with safe_open(str(path), framework="pt") as f:
        dtypes = json.loads((f.metadata() or {}).get("dtypes", "{}"))
    return load_file(str(path)), dtypes


def _quantize_problem(quantize: str, method: str | None) -> str:
    if method is None:
        return (f"--quantize {quantize} needs a checkpoint converted from a quantized HF "
                "checkpoint (its scales are recorded then); this one's source is unquantized")
    return (f"--quantize {quantize}: the checkpoint's HF source is quant_method {method!r}; "
            f"re-quantizing uses the source's own layout and scales (supported: --quantize "
            f"{method})")


def export_tensors(tensors: dict[str, torch.Tensor], cfg: dict, hf_dir: str | os.PathLike,
                   quantize: str | None = None, dtype: torch.dtype | None = None,
                   carried: Iterable[str] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config.json) of an HF export of a checkpoint whose `hf/` folder is `hf_dir`.

    `tensors`: the bridge's export (full precision) plus the pass-through tensors as stored
    (`carried`: their names). Unquantized config: returned as given (`quantize` refused).
    Quantized source, `quantize` None: every quantized weight (carried ones too) dequantized
    and cast to `dtype` (default bf16), every other exported tensor in `dtype` if given, else
    its recorded source dtype, carried tensors as stored; the config loses
    quantization_config. `quantize` = the source's quant_method: the weights the source stored
    quantized are quantized again with the recorded parts (scales), the others cast to their
    source dtype, carried tensors kept as stored; the config is kept.
    """
    method = quant_method(cfg)
    if quantize is not None and quantize != method:
        raise ValueError(_quantize_problem(quantize, method))
    if method is None:
        return tensors, cfg
    recorded, dtypes = read_source(hf_dir)
    qcfg, impl, carried = quantization_config(cfg), QUANT_METHODS[method], set(carried)
    source_quantized = logical_parts(cfg, dtypes)
    stored = logical_parts(cfg, carried)   # carried weights still quantized
    hidden = {n for parts in stored.values() for n in parts[1:]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in hidden:
            continue  # a carried weight's scale: written with its weight below
        if name in stored:
            parts = [tensors[n] for n in stored[name]]
            if quantize:
                out.update(zip(stored[name], parts))
            else:
                out[name] = impl.dequantize(name, parts, qcfg).to(dtype or torch.bfloat16)
        elif name in carried:
            out[name] = tensor
        elif name in source_quantized and quantize:
            source = {n: recorded[n] for n in source_quantized[name][1:] if n in recorded}
            out.update(impl.quantize(name, tensor, source, qcfg))
        elif name in source_quantized:
            out[name] = tensor.to(dtype or torch.bfloat16)
        else:
            out[name] = tensor.to(dtype or _DTYPES.get(dtypes.get(name, ""), tensor.dtype))
    config = dict(cfg) if quantize else {k: v for k, v in cfg.items()
                                         if k != "quantization_config"}
    return out, config
