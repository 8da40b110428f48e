"""MXFP4 weights as gpt-oss publishes them (quantization_config quant_method "mxfp4"): the
experts' `X_blocks` + `X_scales` stand for `X` (X = mlp.experts.gate_up_proj / down_proj).

Layout (transformers integrations/mxfp4.py, `convert_moe_packed_tensors`, which this module
reproduces exactly): `X_blocks` uint8 [..., R, G, 16] holds 32 e2m1 (FP4) codes per group of
the last dimension, two per byte, the low nibble first; `X_scales` uint8 [..., R, G] holds one
power-of-two exponent per group, biased by 127. A code c is the value FP4_VALUES[c] (sign bit
8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6), times 2^(scale - 127). Each row r of a group's prefix
expands to G x 32 values; transformers then swaps the two dimensions after the first, so
blocks [E, R, G, 16] give X [E, G x 32, R] (gate_up_proj: blocks [E, 2I, H/32, 16] ->
[E, H, 2I]; down_proj: [E, H, I/32, 16] -> [E, I, H]). Every value is exact in fp32 (and in
bf16: a 2-bit mantissa times a power of two), so dequantizing in fp32 is exact.

models.formats.quantized registers the method ("mxfp4": `X_blocks` + `X_scales` read as the
dequantized `X`; its DequantizingReader.get_rows dequantizes only the experts a rank holds).
`quantize` is the encoder for `--quantize mxfp4` exports and test checkpoints: per group the
source's scale where the values fit it (so an untrained model re-exports the same bytes: its
values are codes times that scale), else 2^ceil(log2(amax / 6)); each value the nearest code
(ties to the even code; the sign bit kept, so -0.0 stays code 8).
"""
from __future__ import annotations

import torch

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32            # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


class Mxfp4Error(ValueError):
    """Stored MXFP4 blocks / scales that do not match the layout."""


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> values [..., G * 32] (no swap)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4Error(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype} / "
                         f"{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != GROUP // 2:
        raise Mxfp4Error(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} ([..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).reshape(*blocks.shape[:-1], GROUP)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype)
    return values.reshape(*blocks.shape[:-2], -1)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, R, G, 16], scales [E, R, G] -> X [E, G * 32, R], as transformers."""
    return dequantize_rows(blocks, scales, dtype).transpose(1, 2).contiguous()


def quantize_rows(values: torch.Tensor, scales: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8
    [..., K/32]); `scales`: the source's, kept for every group whose values fit (module
    docstring)."""
    if values.shape[-1] % GROUP:
        raise Mxfp4Error(f"MXFP4 groups of {GROUP}: last dimension {values.shape[-1]}")
    x = values.float().reshape(*values.shape[:-1], -1, GROUP)
    amax = x.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    exponent = exponent.clamp(-127, 128).to(torch.int32)
    if scales is not None:
        given = scales.to(torch.int32) - 127
        fits = amax <= torch.ldexp(torch.full_like(amax, 6.0), given)
        exponent = torch.where(fits, given, exponent)
    scaled = torch.ldexp(x, -exponent.unsqueeze(-1))
    magnitudes = torch.tensor(FP4_VALUES[:8])
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    distance = distance + torch.arange(8) % 2 * 1e-6   # ties -> the even code
    codes = distance.argmin(dim=-1) + torch.signbit(scaled).long() * 8
    codes = codes.to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def quantize(x: torch.Tensor, scales: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """X [E, K, R] -> (blocks [E, R, K/32, 16], scales [E, R, K/32]): inverse layout of
    `dequantize` (values rounded to the format; `scales` as in quantize_rows)."""
    return quantize_rows(x.transpose(1, 2), scales)
