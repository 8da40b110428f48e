"""Model checkpoints in Megatron's distributed format, loadable at any TP/PP/VPP.

A checkpoint directory holds:
  - the `megatron.core.dist_checkpointing` files (`metadata.json`, `*.distcp`, `common.pt`);
    model weights live under the state-dict key `model` (training checkpoints add `optimizer`,
    `scheduler`, `rng`, `data`, which model-only readers ignore);
  - `hf_source/` (SOURCE_DIR): the source's HF `config.json`, tokenizer files and pass-through
    tensors, so later commands need no extra flags; checkpoints written before this folder was
    named so hold it as `hf/` (LEGACY_SOURCE_DIR), which `source_dir` still finds. A training
    checkpoint with `checkpoint.save_hf` also holds `hf/`: then the HF folder `convert
    mcore-to-hf` writes (engine.checkpoint.hf_export), never read as the source;
  - `bridge.json`: architecture, padded vocab and format version.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from models.bridge.errors import CheckpointError  # noqa: F401 (re-exported)
from models.build.transformer_config import model_shape
from models.families.mtp import trained_mtp_layers, with_trained_mtp
from models.families.registry import family_of
from models.hf.conditional import file_config, text_view
from models.hf.io import copy_tokenizer_files
from models.hf.passthrough import save_passthrough
from models.hf.quantized_export import record_source
from models.lora.sites import is_adapter_param, lora_spec_of
from parallel.wrappers import unwrap

FORMAT_VERSION = 1
SOURCE_DIR = "hf_source"       # a checkpoint's own HF config, tokenizer, pass-through tensors
LEGACY_SOURCE_DIR = "hf"       # ... as checkpoints written before SOURCE_DIR stored them


HEAD_PREFIX = "value_head."   # models.layers.heads.value.attach_value_heads's attribute


def model_sharded_state_dict(chunks: list) -> dict:
    """{"model": {"chunk0": ..., ...}}: sharded tensors with global (layout-free) keys; with
    LoRA adapters (models.lora.sites) only what trains: the adapters and a value/score head
    (models.layers.heads.value, trained in full as peft's modules_to_save); the frozen base
    comes from model.hf_path."""
    lora = lora_spec_of(chunks) is not None
    return {"model": {f"chunk{i}": {k: v for k, v in _sharded(unwrap(c)).items()
                                    if not lora or _lora_saved(k)}
                      for i, c in enumerate(chunks)}}


def _sharded(model) -> dict:
    """A chunk's sharded state dict; a stage holding a trained MTP layer and not the first
    stage ties its embedding copy to the first stage's, which megatron does over the DP x CP
    group it needs in `metadata` (models.layers.mtp.model)."""
    if getattr(model, "mtp_process", False) and not model.pre_process:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        return model.sharded_state_dict(metadata={"dp_cp_group": group})
    return model.sharded_state_dict()


def _lora_saved(name: str) -> bool:
    """Whether a LoRA checkpoint holds the state-dict entry `name`: an adapter's or the head's."""
    return is_adapter_param(name) or name.startswith(HEAD_PREFIX)


def load_model_state(chunk, state: dict) -> None:
    """Load a `model_sharded_state_dict` entry into one chunk: every key strictly, or with
    LoRA adapters every adapter key (the base is not in the checkpoint)."""
    model = unwrap(chunk)
    if lora_spec_of([model]) is None:
        model.load_state_dict(state, strict=True)
        return
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if _lora_saved(k)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"LoRA checkpoint mismatch: missing adapters {missing[:4]}, "
                              f"unexpected {result.unexpected_keys[:4]}")


def source_dir(ckpt_dir: str | os.PathLike) -> Path:
    """The folder of `ckpt_dir` holding the checkpoint's own HF config, tokenizer files and
    pass-through tensors: `hf_source/` when present, else `hf/` (a checkpoint written before
    SOURCE_DIR; a newer one's `hf/` is checkpoint.save_hf's export and `hf_source/` is there
    too). File-system only; the folder may not exist (check_checkpoint_dir says so)."""
    path = Path(ckpt_dir)
    new = path / SOURCE_DIR
    return new if new.is_dir() else path / LEGACY_SOURCE_DIR


def write_metadata(ckpt_dir: str | os.PathLike, hf_config: dict, tokenizer_dir: str | None
                   ) -> None:
    """Rank-0 writer of `hf_source/` (SOURCE_DIR: config, tokenizer files and the pass-through
    tensors of the HF folder `tokenizer_dir`: models.hf.passthrough) and `bridge.json`."""
    hf_dir = Path(ckpt_dir) / SOURCE_DIR
    hf_dir.mkdir(parents=True, exist_ok=True)
    # as stored in the source (a conditional-generation wrapper's own: models.hf.conditional)
    (hf_dir / "config.json").write_text(json.dumps(file_config(hf_config), indent=2))
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, hf_dir)
        save_passthrough(tokenizer_dir, hf_config, hf_dir)  # e.g. MTP layers, as read
        record_source(tokenizer_dir, hf_config, hf_dir)  # quantized source: scales, dtypes
    meta = {"format_version": FORMAT_VERSION, "architecture": family_of(hf_config).model_type,
            "vocab_size": hf_config["vocab_size"],
            "padded_vocab_size": model_shape(hf_config).padded_vocab_size}
    if trained_mtp_layers(hf_config):  # the model state holds the MTP layer (models.layers.mtp)
        meta["mtp_layers"] = trained_mtp_layers(hf_config)
    (Path(ckpt_dir) / "bridge.json").write_text(json.dumps(meta, indent=2))


def save_checkpoint(state: dict, ckpt_dir: str | os.PathLike, hf_config: dict,
                    tokenizer_dir: str | None) -> None:
    """Collective: save a sharded state dict (containing at least `model`) plus metadata."""
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(state, str(ckpt_dir))
    if dist.get_rank() == 0:
        write_metadata(ckpt_dir, hf_config, tokenizer_dir)
    dist.barrier()


def load_checkpoint(state: dict, ckpt_dir: str | os.PathLike) -> dict:
    """Collective: load the entries of `state` (sharded for this layout) from `ckpt_dir`."""
    check_checkpoint_dir(ckpt_dir)
    return dist_checkpointing.load(state, str(ckpt_dir))


def load_model(chunks: list, ckpt_dir: str | os.PathLike) -> None:
    """Fill `chunks` (built for the current layout) from a checkpoint's `model` entry."""
    loaded = load_checkpoint(model_sharded_state_dict(chunks), ckpt_dir)
    for i, chunk in enumerate(chunks):
        load_model_state(chunk, loaded["model"][f"chunk{i}"])


def check_checkpoint_dir(ckpt_dir: str | os.PathLike) -> None:
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is not a Megatron distributed checkpoint "
                              f"(no metadata.json)")
    if not (source_dir(path) / "config.json").is_file():
        raise CheckpointError(f"{path} has no {SOURCE_DIR}/config.json (nor "
                              f"{LEGACY_SOURCE_DIR}/config.json, as older checkpoints store it): "
                              "not written by this project")


def read_hf_config(ckpt_dir: str | os.PathLike) -> dict:
    """The HF config stored with a checkpoint, as the engines read it (as
    models.hf.io.read_config does), marked as holding a trained MTP layer when bridge.json says
    so (models.families.mtp: the model state then has it, and export writes it)."""
    check_checkpoint_dir(ckpt_dir)
    config = text_view(json.loads((source_dir(ckpt_dir) / "config.json").read_text()))
    bridge = Path(ckpt_dir) / "bridge.json"
    if bridge.is_file() and json.loads(bridge.read_text()).get("mtp_layers"):
        config = with_trained_mtp(config)
    return config
