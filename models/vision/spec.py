"""What a conditional-generation checkpoint's config.json says about its images.

A checkpoint takes images when its family declares where its vision tower is stored
(`Family.vision_prefix`: the Qwen3.5 families) and its config.json is a conditional-generation
wrapper with a `vision_config`. The engines read the text
model's view of such a config (models.hf.conditional.text_view); the wrapper's own dict rides
in it (models.families.base.original_config), and this module reads from there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.families.base import field, original_config
from models.families.fields import rope_parameters
from models.families.registry import family_of

DEFAULT_MROPE_SECTION = (11, 11, 10)   # transformers' Qwen3.5 default when the config has none


@dataclass(frozen=True)
class VisionSpec:
    """Image facts of a checkpoint.

    image_token_id: the placeholder repeated once per merged patch of an image.
    vision_start_token_id / vision_end_token_id: the tokens around each placeholder run.
    video_token_id: videos are refused (engine.data.images); kept to name it in errors.
    merge_size: spatial_merge_size; an image of grid (t, h, w) patches takes
        t * h * w / merge_size**2 placeholder tokens.
    mrope_section: the (temporal, height, width) frequency counts of interleaved M-RoPE.
    vision_config: the wrapper's `vision_config` dict (builds models.vision.tower).
    hf_prefix: where the checkpoint stores the tower's tensors (`model.visual.`).
    deepstack_layers: how many of the tower's intermediate feature sets (Qwen3-VL's
        `deepstack_visual_indexes`) are added to the outputs of decoder layers 0, 1, ...
    """

    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    merge_size: int
    mrope_section: tuple[int, int, int]
    vision_config: dict
    hf_prefix: str
    deepstack_layers: int = 0

    def tokens_per_image(self, grid_thw) -> int:
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size ** 2)


def vision_spec(hf_config: Any) -> VisionSpec | None:
    """The VisionSpec of the config dict the engines read (a text view of a wrapper), or None
    when the model has no vision tower."""
    original = original_config(hf_config) if isinstance(hf_config, dict) else None
    if original is None:
        return None
    vision = original.get("vision_config")
    if not family_of(hf_config).vision_prefix or not isinstance(vision, dict):
        return None
    text = original.get("text_config") or {}
    rope = rope_parameters(text) or field(text, "rope_scaling", {})
    section = rope.get("mrope_section") or DEFAULT_MROPE_SECTION
    return VisionSpec(
        image_token_id=int(original["image_token_id"]),
        video_token_id=field(original, "video_token_id"),
        vision_start_token_id=field(original, "vision_start_token_id"),
        vision_end_token_id=field(original, "vision_end_token_id"),
        merge_size=int(field(vision, "spatial_merge_size", 2)),
        mrope_section=tuple(int(x) for x in section),
        vision_config=vision,
        hf_prefix=family_of(hf_config).vision_prefix,
        deepstack_layers=len(vision.get("deepstack_visual_indexes") or ()))
