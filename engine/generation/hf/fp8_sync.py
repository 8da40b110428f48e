"""rollout.sync_quantization=fp8 on the hf backend (engine.generation.hf.backend): a float8
weight arrives with its `weight_scale_inv` in the same bucket and is written as fp8 x scale in
float32, with the blocks of the folder's fp8 quantization_config (models.formats.fp8: exactly
what the trainer loads from the checkpoint), so the engine holds dequant(quant(W))."""
from __future__ import annotations

import json
import os

import torch

from models.formats import fp8 as fp8_blocks
from models.formats.quantized import QUANT_METHODS, quantization_config

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantized(bucket: list[tuple[str, torch.Tensor]], device, fp8_config
                ) -> list[tuple[str, torch.Tensor]]:
    """The bucket with every float8 weight replaced by fp8 x its scale (fp32, on `device`) and
    the scales removed. A float8 weight without its scale in the bucket, or a scale without
    its weight, is refused (ValueError). `fp8_config()`: the folder's quantization config
    (`fp8_config`), called only when a float8 weight arrives."""
    suffix = fp8_blocks.SCALE_SUFFIX
    scales = {n: t for n, t in bucket if n.endswith(suffix)}
    out = []
    for name, tensor in bucket:
        if name.endswith(suffix):
            continue
        if tensor.dtype in FLOAT8:
            scale = scales.pop(name + suffix, None)
            if scale is None:
                raise ValueError(f"update_weights: {name!r} arrived as {tensor.dtype} "
                                 f"without {name + suffix!r} in the same bucket; refusing "
                                 "to cast an FP8 weight unscaled")
            tensor = QUANT_METHODS["fp8"].dequantize(
                name, [tensor.to(device), scale.to(device)], fp8_config())
        out.append((name, tensor))
    if scales:
        raise ValueError(f"update_weights: {sorted(scales)[0]!r} arrived without its float8 "
                         "weight in the same bucket")
    return out


def fp8_config(hf_path: str) -> dict:
    """The folder's fp8 quantization_config (config.json: the blocks the trainer loaded the
    checkpoint with); ValueError naming rollout.sync_quantization when it has none."""
    with open(os.path.join(hf_path, "config.json")) as f:
        qcfg = quantization_config(json.load(f)) or {}
    if qcfg.get("quant_method") != "fp8" or not qcfg.get("weight_block_size"):
        raise ValueError(f"update_weights: FP8 weights arrived, but {hf_path} is not "
                         "an FP8 checkpoint (config.json has no fp8 quantization_config with "
                         "weight_block_size); use rollout.sync_quantization=null")
    return qcfg
