"""HF checkpoint tensors carried through conversion and training unchanged (bitwise), without
being mapped into megatron: the tensors a family's `passthrough(cfg, name)` claims (GLM-4.5's
MTP layers `model.layers.{N..}.*`, models.families.glm4_moe).

Every checkpoint this project writes from an HF folder (tools/convert.py hf-to-mcore and every
training checkpoint, whose `model.hf_path` is the source) stores them as read, dtype and bytes,
in `hf_source/passthrough.safetensors` next to the HF config (an older checkpoint: `hf/`;
models.bridge.checkpoint.write_metadata and source_dir);
`tools/convert.py mcore-to-hf` writes them back beside the exported weights. They are never
trained, never synced to rollout engines (transformers drops them on load) and never cast by
`--dtype`.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.families.mtp import trained_mtp_layers
from models.families.registry import family_of
from models.families.tensors import expected_tensors
from models.hf.io import SafetensorsReader

PASSTHROUGH_FILE = "passthrough.safetensors"


def passthrough_names(hf_config: dict, names) -> list[str]:
    """The names among `names` (an HF folder's tensors) that the family carries unchanged
    (none of a trained MTP layer's: models.families.mtp)."""
    fam = family_of(hf_config)
    mapped = expected_tensors(hf_config) if trained_mtp_layers(hf_config) else set()
    return sorted(n for n in names if fam.passthrough(hf_config, n) and n not in mapped)


def save_passthrough(src_hf_dir: str | os.PathLike | None, hf_config: dict,
                     dst_dir: str | os.PathLike) -> int:
    """Copy the pass-through tensors of the HF folder `src_hf_dir` into
    `dst_dir/passthrough.safetensors` (nothing when there are none or no weights there);
    returns how many were written."""
    if src_hf_dir is None or not any(
            (Path(src_hf_dir) / f).is_file()
            for f in ("model.safetensors", "model.safetensors.index.json")):
        return 0
    reader = SafetensorsReader(src_hf_dir)
    names = passthrough_names(hf_config, reader.keys())
    if not names:
        return 0
    save_file({n: reader.get(n).contiguous() for n in names},
              str(Path(dst_dir) / PASSTHROUGH_FILE), metadata={"format": "pt"})
    return len(names)


def read_passthrough(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The pass-through tensors stored in a checkpoint's own folder `hf_dir`
    (models.bridge.checkpoint.source_dir; {} when none)."""
    path = Path(hf_dir) / PASSTHROUGH_FILE
    return load_file(str(path)) if path.is_file() else {}
