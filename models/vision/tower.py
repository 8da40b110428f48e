"""The vision tower: transformers' own module, built from the checkpoint's vision_config.

The tower (patch embedding, learned position grid, ViT blocks with 2-D RoPE, the patch
merger) is the module transformers builds for `Qwen3_5ForConditionalGeneration.model.visual`
(`AutoModel.from_config(config.vision_config)`), so its numbers are transformers' by
construction. Its parameters keep their HF names under `vision.` in the megatron chunk
(`model.visual.X` on disk <-> `vision.X`; models.bridge.weights maps them as replicated),
and a checkpoint's tower tensors must be exactly the module's parameters
(`tower_tensor_problems`).

Replicated, not TP-split: every tensor-parallel rank of the first pipeline stage runs the whole
tower on the micro-batch's images. A tower is small next to its language model (Qwen3.5's 27
blocks of width 1152: 0.46 B parameters beside 9 B to 397 B) and an image's few hundred
tokens are a fraction of a sequence, so splitting it would add a TP collective per block for
little memory; replicated, it needs no collective in the forward pass. Gradients: each TP rank
computes the tower's gradient from the image rows it holds. Without sequence parallelism those
are all rows (the first layer's input gradient is complete on every TP rank), with it they are
its sequence shard, so the parameters are tagged `sequence_parallel` and megatron sums their
gradients over TP (finalize_model_grads) exactly then. Over CP and DP megatron's DDP sums them
with every other gradient.
"""
from __future__ import annotations

import json

import torch
from transformers import AutoModel

from models.hf.config import hf_config_object
from models.families.base import field, original_config
from models.vision.spec import VisionSpec, vision_spec

VISION_PREFIX = "vision."        # the tower's parameters in a megatron chunk


_NAMES: dict[str, tuple[str, ...]] = {}


def tower_parameter_names(hf_config: dict) -> tuple[str, ...]:
    """The tower's parameter names (built on the meta device, once per vision_config)."""
    wrapper = original_config(hf_config)
    key = json.dumps(wrapper.get("vision_config"), sort_keys=True, default=str)
    if key not in _NAMES:
        with torch.device("meta"):
            tower = AutoModel.from_config(hf_config_object(wrapper).vision_config)
        _NAMES[key] = tuple(n for n, _ in tower.named_parameters())
    return _NAMES[key]


def tower_tensor_problems(hf_config: dict, names) -> list[str]:
    """Why the checkpoint tensors `names` under the tower's prefix are not exactly the
    parameters of the tower its config builds (empty: they are; also for a text model)."""
    spec = vision_spec(hf_config)
    if spec is None:
        return []
    expected = {spec.hf_prefix + n for n in tower_parameter_names(hf_config)}
    stored = {n for n in names if n.startswith(spec.hf_prefix)}
    problems = []
    if stored - expected:
        problems.append(f"the checkpoint holds vision tower tensors its vision_config does not "
                        f"build: {', '.join(sorted(stored - expected)[:6])}")
    if expected - stored:
        problems.append(f"the checkpoint lacks vision tower tensors: "
                        f"{', '.join(sorted(expected - stored)[:6])}")
    return problems


def build_tower(hf_config: dict, dtype: torch.dtype, trainable: bool) -> torch.nn.Module:
    """transformers' vision tower for the wrapper config behind the text view `hf_config`,
    uninitialised (models.bridge.weights loads it), in `dtype`, frozen unless `trainable`."""
    wrapper = hf_config_object(original_config(hf_config))
    tower = AutoModel.from_config(wrapper.vision_config, dtype=dtype)
    for p in tower.parameters():
        p.requires_grad_(trainable)
        p.sequence_parallel = True   # summed over TP with sequence parallelism (docstring)
    return tower


def zero_pass(tower: torch.nn.Module, spec: VisionSpec) -> torch.Tensor:
    """0.0 (a 0-dim tensor) that depends on every parameter of the trained `tower`: the sum of
    all its outputs (merged features and deepstack features) on one blank image of merge_size
    x merge_size patches (one image token), times 0. Added to the embeddings of a micro-batch
    without images (models.vision.model) it changes no number: the forward adds exactly 0.0,
    and the backward gives every tower parameter an all-zero gradient, which adds nothing to
    the accumulated one. What it buys is that every tower parameter gets a gradient in every
    micro-batch, as with images: megatron's overlapped gradient reduction
    (parallel.overlap_grad_reduce) launches a DDP bucket's reduction when every parameter of
    the bucket has its gradient of the last micro-batch, exactly as in the first step; a rank
    whose last micro-batch had images in one step and none in another never launched the
    tower's bucket (`finish_grad_sync`: "Communication call has not been issued for this
    bucket"). Cost: the tower's forward and backward on merge_size^2 patches per text-only
    micro-batch. A tower whose weights are already non-finite makes the product NaN (the
    step is then skipped as non-finite)."""
    v, m = spec.vision_config, spec.merge_size
    width = (int(field(v, "in_channels", 3)) * int(field(v, "temporal_patch_size", 2))
             * int(field(v, "patch_size")) ** 2)
    param = next(tower.parameters())
    pixels = torch.zeros(m * m, width, dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, m, m]], device=param.device)
    features, deepstack = image_features(tower, pixels, grid)
    return sum(f.sum() for f in (features, *deepstack)) * 0.0


def image_features(tower: torch.nn.Module, pixel_values: torch.Tensor,
                   grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(merged image features [image tokens, text hidden], deepstack features: a list of
    tensors of that shape, empty without deepstack) of `pixel_values` (patches of all images,
    in order) with grids `grid_thw` [images, 3], as transformers' `get_image_features`
    computes them (no autograd graph when the tower is frozen)."""
    param = next(tower.parameters())
    with torch.set_grad_enabled(torch.is_grad_enabled() and param.requires_grad):
        out = tower(pixel_values.to(param.dtype), grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
