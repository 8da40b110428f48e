"""The vision tower of a model that takes images (models.vision), in the estimates: its
parameters and the activations a trained tower keeps. Plain arithmetic on the wrapper's
`vision_config` (the Qwen3.5 / Qwen3-VL tower: transformers' Qwen3_5VisionModel and
Qwen3VLVisionModel; tests/test_vlm.py checks the count against the modules).

Parameters (h = hidden_size, I = intermediate_size, m = spatial_merge_size, H = out_hidden_size):
- patch embedding: a Conv3d of in_channels x temporal_patch_size x patch_size^2 -> h, biased;
- learned positions: num_position_embeddings x h;
- each of `depth` blocks: two biased LayerNorms (4 h), qkv and proj (4 h^2 + 4 h), the MLP
  (2 h I + I + h);
- the merger: a LayerNorm over h (2 h), then (m^2 h)^2 + m^2 h and m^2 h x H + H;
- each deepstack merger (Qwen3-VL's deepstack_visual_indexes): the same with its LayerNorm over
  m^2 h (2 m^2 h).
The tower sits on the first pipeline stage, whole on every TP rank (models.vision.tower).

Activations (a trained tower; a frozen one runs without an autograd graph): per image patch and
block about 8 h + 2 I values (the norms' inputs, q, k, v, the attention output, the MLP's input,
hidden and activation), a bytes each, for m^2 patches per image token.
"""
from __future__ import annotations

from typing import Any

from models.families.base import field, original_config
from models.families.registry import family_of


def vision_config(hf: Any) -> dict | None:
    """The wrapper's vision_config for a model whose family takes images, else None."""
    original = original_config(hf)
    if original is None or not family_of(hf).vision_prefix:
        return None
    vision = original.get("vision_config")
    return vision if isinstance(vision, dict) else None


def tower_parameters(hf: Any) -> int:
    """The vision tower's parameter count (0 without one)."""
    v = vision_config(hf)
    if v is None:
        return 0
    h, i = int(v["hidden_size"]), int(v["intermediate_size"])
    m2 = int(field(v, "spatial_merge_size", 2)) ** 2
    out = int(v["out_hidden_size"])
    patch = (int(field(v, "in_channels", 3)) * int(field(v, "temporal_patch_size", 2))
             * int(v["patch_size"]) ** 2 * h + h)
    block = 4 * h + 4 * h * h + 4 * h + 2 * h * i + i + h
    merger = (m2 * h) ** 2 + m2 * h + m2 * h * out + out
    deepstack = len(field(v, "deepstack_visual_indexes", []) or [])
    return (patch + int(v["num_position_embeddings"]) * h + int(v["depth"]) * block
            + 2 * h + merger + deepstack * (2 * m2 * h + merger))


def tower_activation_bytes(hf: Any, image_tokens: int, a: int) -> float:
    """Bytes a trained tower keeps for the backward pass of `image_tokens` image tokens."""
    v = vision_config(hf)
    if v is None:
        return 0.0
    patches = image_tokens * int(field(v, "spatial_merge_size", 2)) ** 2
    return float(a * patches * int(v["depth"])
                 * (8 * int(v["hidden_size"]) + 2 * int(v["intermediate_size"])))
