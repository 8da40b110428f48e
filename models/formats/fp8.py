"""Block-scaled FP8 weights as DeepSeek-V3 / Kimi-K2 publish them (quantization_config
quant_method "fp8", fmt e4m3, weight_block_size [b0, b1], typically [128, 128]).

A weight W [out, in] is stored as `X.weight` in float8_e4m3fn plus `X.weight_scale_inv` fp32
[ceil(out / b0), ceil(in / b1)]: block (i, j) covers rows i*b0 .. and columns j*b1 .., the last
row / column blocks ragged when b0 / b1 do not divide the shape, and W = fp8 * scale_inv of its
block. `dequantize` computes exactly that product in fp32 (the fp8 value is exact in fp32, so
one rounding of the product). `quantize` is its inverse for export: fp8 = W / scale rounded to
the nearest e4m3 value (saturating at +-448). Given the source's scales, a block keeps its
scale whenever its values round to finite e4m3 values with it (|W / scale| < 464: 448 is the
largest, the step below it is 32), so an untrained model re-exports the same
fp8 bytes and scales: W = fl(q * s) gives W / s = q (1 + d) with |d| < 2^-23 (2^-8 from a
bf16 copy), far below half an e4m3 step (2^-4 relative), so rounding returns q. A block that
no longer fits, or a weight without source scales, gets scale amax / 448 (DeepSeek's recipe;
an all-zero block scale 1).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# |x| below this rounds to a finite e4m3 value (448: the top step is 32, e4m3fn has no 480)
FP8_ROUNDS_FINITE = FP8_MAX + 16.0
SCALE_SUFFIX = "_scale_inv"                   # X.weight -> X.weight_scale_inv


class Fp8BlockError(ValueError):
    """A stored FP8 weight or scale that does not match the block layout."""


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out / b0), ceil(in / b1)] for a 2-D weight `shape`."""
    if len(shape) != 2:
        raise Fp8BlockError(f"block-scaled FP8 needs a 2-D weight, got shape {tuple(shape)}")
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int],
                  block: tuple[int, int]) -> torch.Tensor:
    """The fp32 scale of every element of a weight of `shape` (ragged edge blocks cropped)."""
    rows, cols = shape
    full = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[:rows, :cols]


def _check(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
           name: str) -> None:
    if weight.dtype != FP8_DTYPE:
        raise Fp8BlockError(f"{name}: stored as {weight.dtype}, expected {FP8_DTYPE} next to "
                            f"its {SCALE_SUFFIX}")
    expected = scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise Fp8BlockError(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, expected "
                            f"{expected} for weight {tuple(weight.shape)} and blocks "
                            f"{list(block)}")
    if not scale_inv.is_floating_point() or scale_inv.element_size() < 4:
        raise Fp8BlockError(f"{name}{SCALE_SUFFIX}: dtype {scale_inv.dtype}, expected float32 "
                            "(scale_fmt 'float')")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               name: str = "weight") -> torch.Tensor:
    """fp32 W = fp8 * scale_inv of its block (exact fp8 -> fp32, one rounding)."""
    _check(weight, scale_inv, block, name)
    return weight.float() * expand_scales(scale_inv, tuple(weight.shape), block)


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |w| of each block [ceil(out/b0), ceil(in/b1)] (ragged edges padded with zeros)."""
    rows, cols = scale_shape(tuple(w.shape), block)
    padded = w.new_zeros(rows * block[0], cols * block[1])
    padded[:w.shape[0], :w.shape[1]] = w.abs()
    return padded.reshape(rows, block[0], cols, block[1]).amax(dim=(1, 3))


def quantize(weight: torch.Tensor, block: tuple[int, int],
             scale_inv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv) of `weight`. `scale_inv`: the source's scales, kept for
    every block whose values fit in e4m3 with them; other blocks get amax / 448."""
    w = weight.float()
    amax = _block_amax(w, block)
    fresh = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_inv is None:
        scales = fresh
    else:
        if tuple(scale_inv.shape) != tuple(amax.shape):
            raise Fp8BlockError(f"source scales {tuple(scale_inv.shape)} do not match weight "
                                f"{tuple(weight.shape)} with blocks {list(block)}")
        kept = scale_inv.float()
        fits = (kept > 0) & (amax / kept < FP8_ROUNDS_FINITE)
        scales = torch.where(fits, kept, fresh)
    ratio = w / expand_scales(scales, tuple(w.shape), block)
    q = ratio.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales.contiguous()
