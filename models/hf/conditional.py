"""Conditional-generation HF checkpoints seen as the text model they wrap, at the HF I/O boundary.

Qwen3.5 / Qwen3.6 are published as `Qwen3_5(Moe)ForConditionalGeneration`: config.json has
model_type `qwen3_5` / `qwen3_5_moe`, the text model's fields under `text_config` and the vision
tower's under `vision_config`; the tensors are `model.language_model.*` (the text model),
`lm_head.weight`, `model.visual.*` (the vision tower) and, in the published checkpoints,
`mtp.*` (MTP layers, which transformers drops on load). This module is the one place that knows
that wrapping; everything else sees the text model (model_type `qwen3_5_text` /
`qwen3_5_moe_text`, tensors `model.*` and `lm_head.weight`):

- `text_view(config)`: the config dict the bridge, the engines and the checks read (applied by
  models.hf.io.read_config and models.bridge.checkpoint.read_hf_config): `text_config` with the
  wrapper's `tie_word_embeddings` (transformers' ForConditionalGeneration ties lm_head by the
  top-level value) and the whole original config.json under `ORIGINAL` (never written: see
  `file_config`). Any other dict is returned as is.
- `file_config(view)`: the config.json to write (the original for a view): checkpoints' `hf/`
  folder (models.bridge.checkpoint.write_metadata) and every HF export (tools/convert.py).
- `text_names(hf_dir, names)`: {name the bridge reads: stored name} for the tensors of an HF
  folder (models.hf.io.SafetensorsReader): `model.language_model.X` -> `model.X`, the rest as
  stored. `stored_names(view, tensors)`: the inverse, for an export.

The MTP layers are not mapped unless the run trains them (model.mtp.enabled: the engines'
config is marked, models.families.mtp): the qwen3_5 families' `passthrough` claims them, so
they travel as stored (models.hf.passthrough). The vision tower `model.visual.*` is the
trainer's (models.vision).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from models.families.base import original_config, wrapper_view
from models.families.mtp import MTP_TRAINED
from models.families.registry import FAMILIES

TEXT_PREFIX = "model.language_model."        # stored prefix of the text model's tensors
WRAPPER_TENSORS = ("model.visual.",)         # stored under model. but not the text model's


def text_model_type(config: Any) -> str | None:
    """The model_type of the text model a conditional-generation wrapper's config.json dict
    is read as (its family's declared `text_model_type`); None for any other config."""
    if not isinstance(config, dict):
        return None
    fam = FAMILIES.get(config.get("model_type"))
    return fam.text_model_type if fam is not None else None


def is_wrapper(config: Any) -> bool:
    """Whether `config` (a config.json dict) is a conditional-generation wrapper."""
    return text_model_type(config) is not None


def text_view(config: Any) -> Any:
    """The text model's config dict of a wrapper config.json (see the module docstring); any
    other value unchanged. Never raises: what does not map is reported by `wrapper_problem`."""
    if not is_wrapper(config):
        return config
    return wrapper_view(config, text_model_type(config))


def peft_layers(config: dict) -> str:
    """The decoder layers' path in peft's adapter tensor names for the config dict the engines
    read: the text model's under a conditional-generation wrapper (`model.language_model.
    layers`, as PeftModel names them on transformers' ForConditionalGeneration), else
    `model.layers`."""
    return TEXT_PREFIX + "layers" if original_config(config) else "model.layers"


def file_config(config: dict) -> dict:
    """The config.json to write for the config dict the engines read (without the engines'
    own marks: models.families.mtp.MTP_TRAINED)."""
    return original_config(config) or {k: v for k, v in config.items() if k != MTP_TRAINED}


def _text_name(stored: str) -> str:
    return "model." + stored[len(TEXT_PREFIX):] if stored.startswith(TEXT_PREFIX) else stored


def text_names(hf_dir: str | os.PathLike, names: list[str]) -> dict[str, str]:
    """{name the bridge reads: stored name} for the tensors `names` of the HF folder `hf_dir`:
    the identity unless its config.json is a wrapper. Raises ValueError for a wrapper's tensor
    under `model.` outside the text model and the vision tower (transformers' class has none:
    it would be dropped)."""
    path = Path(hf_dir) / "config.json"
    try:
        wrapper = is_wrapper(json.loads(path.read_text())) if path.is_file() else False
    except ValueError:
        wrapper = False  # an unreadable config.json is reported by models.hf.io.read_config
    if not wrapper:
        return {n: n for n in names}
    stray = sorted(n for n in names if n.startswith("model.") and not n.startswith(
        (TEXT_PREFIX,) + WRAPPER_TENSORS))
    if stray:
        raise ValueError(f"{hf_dir}: a conditional-generation checkpoint holds tensors outside "
                         f"{TEXT_PREFIX}* and {', '.join(w + '*' for w in WRAPPER_TENSORS)} "
                         f"(transformers would drop them): {', '.join(stray[:4])}")
    return {_text_name(n): n for n in names}


def stored_name(config: dict, name: str) -> str:
    """The stored name of tensor `name` (as the bridge exports it, or a pass-through tensor as
    stored) in an HF folder written for `config`."""
    if original_config(config) is None or not name.startswith("model.") \
            or name.startswith(WRAPPER_TENSORS):
        return name
    return TEXT_PREFIX + name[len("model."):]


def stored_names(config: dict, tensors: dict) -> dict:
    """`tensors` under the names an HF folder written for `config` stores them."""
    return {stored_name(config, n): t for n, t in tensors.items()}


def reference_class(config: dict) -> str:
    """The transformers auto class that loads the HF folder of `config` as published (what
    tools/convert.py verify compares logits with): the wrapper itself for a view."""
    return "AutoModelForImageTextToText" if original_config(config) else "AutoModelForCausalLM"
