"""The HF rollout backend with a vision tower (docs/vlm.md): the model transformers builds for
a conditional-generation checkpoint, the trainer's weight names on it, and the prefill of a
batch whose prompts may hold images.

- `load_model`: a checkpoint with a vision tower (models.vision.spec) loads as
  `AutoModelForImageTextToText` (Qwen3_5ForConditionalGeneration, ...), which takes
  `pixel_values`; any other as `AutoModelForCausalLM`, whose grouped KV heads are then read in
  place on a CPU (engine.generation.hf.gqa_attention).
- `view_aliases`: such a model names its text weights as stored (`model.language_model.X`,
  models.hf.conditional) while the weight sync streams the names the trainer's view uses
  (`model.X`); both are accepted.
- `prefill`: M-RoPE positions [3, b, s] for the left-padded prompts (an ImagePrompt's own,
  0, 1, ... in all three for a text prompt, 0 on padding), the decode steps' next positions
  (last + 1: a prompt ends in text, so the three agree) and the images of the batch in row
  order (`pixel_values`, `image_grid_thw`; a prompt's pixels produced here from its
  reference into the data cache, once per prompt of the batch): transformers places them on
  the placeholder tokens in that order, and the trainer recomputes with the same positions
  (models.vision.positions), so the reported log-probs are the trainer's.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from engine.generation.hf.gqa_attention import use_cpu_gqa
from models.hf.conditional import TEXT_PREFIX
from models.hf.io import read_config
from models.vision.inputs import ImagePrompt
from models.vision.spec import VisionSpec, vision_spec


def load_model(hf_path: str, dtype, device: torch.device
               ) -> tuple[torch.nn.Module, VisionSpec | None]:
    """(transformers model of the folder on `device`, in eval mode without gradients, its
    VisionSpec or None)."""
    spec = vision_spec(read_config(hf_path))
    cls = AutoModelForCausalLM if spec is None else AutoModelForImageTextToText
    model = cls.from_pretrained(hf_path, dtype=dtype if dtype is not None else "auto",
                                local_files_only=True)
    model.to(device).eval().requires_grad_(False)
    if spec is None:
        use_cpu_gqa(model)
    return model, spec


def view_aliases(params: dict, canonical: dict) -> None:
    """Add `model.X` for every stored `model.language_model.X` (in place, same targets)."""
    for name in [n for n in params if n.startswith(TEXT_PREFIX)]:
        alias = "model." + name[len(TEXT_PREFIX):]
        params.setdefault(alias, params[name])
        canonical.setdefault(alias, canonical[name])


def prefill(prompts: list, longest: int, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(positions [3, b, longest], next positions [3, b, 1], model kwargs with the images)."""
    positions = torch.zeros(3, len(prompts), longest, dtype=torch.long)
    pixels, grids, images = [], [], {}   # one ImageSet per prompt object (a group shares it)
    for i, prompt in enumerate(prompts):
        start = longest - len(prompt)
        if isinstance(prompt, ImagePrompt):
            positions[:, i, start:] = prompt.positions()
            if id(prompt) not in images:
                images[id(prompt)] = prompt.images
            pixels.append(images[id(prompt)].pixel_values)
            grids.append(images[id(prompt)].grid_thw)
        else:
            positions[:, i, start:] = torch.arange(len(prompt))
    extra = {} if not pixels else {"pixel_values": torch.cat(pixels).to(device),
                                   "image_grid_thw": torch.cat(grids).to(device)}
    positions = positions.to(device)
    return positions, positions[:, :, -1:] + 1, extra
