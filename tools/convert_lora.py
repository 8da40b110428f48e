"""LoRA parts of tools/convert.py (docs/lora.md#conversion).

A LoRA checkpoint holds only the adapters; the frozen base is an HF folder. Which adapters and
which base: a training checkpoint's config.yaml (model.lora.*, model.hf_path), or the
`lora.json` that `hf-to-mcore --adapter` writes; `--base` overrides the base folder.

- mcore-to-hf: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors, peft's
  names), or with `--merge` the merged HF model (base + scaling * B A per projection);
- hf-to-mcore --adapter A: a Megatron checkpoint of the PEFT adapter A on the base --hf-dir.
"""
from __future__ import annotations

import json
from pathlib import Path

LORA_FILE = "lora.json"


def spec_from_peft(adapter_dir: str, cfg: dict):
    """LoraSpec of a PEFT adapter folder on the model of HF config `cfg` (its names read as
    the family reads them, its rank / alpha patterns); raises ValueError naming what is not
    implemented."""
    from engine.config.lora_family import family_spec, target_problems
    from models.lora.peft import adapter_config_problems, adapter_keys

    problems = adapter_config_problems(adapter_dir)
    found = adapter_keys(adapter_dir)
    if not problems and found is not None:   # its names, as model.lora.init_from reads them
        problems = [f"--adapter {adapter_dir}: {p}"
                    for p in target_problems(found["target_modules"], 0.0, cfg)]
    if problems or found is None:
        raise ValueError("; ".join(problems) or f"--adapter {adapter_dir}: unreadable "
                         "adapter_config.json")
    cfg_json = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return family_spec(cfg, int(found["rank"]), float(found["alpha"]), found["target_modules"],
                       found["rslora"], found["rank_pattern"], found["alpha_pattern"],
                       float(cfg_json.get("lora_dropout") or 0.0))


def checkpoint_lora(ckpt: Path, base: str | None, cfg: dict):
    """(LoraSpec, base folder) of a LoRA checkpoint of the model of HF config `cfg`, or None
    for a full-model checkpoint."""
    import yaml

    from engine.config.lora_family import family_spec

    if (ckpt / LORA_FILE).is_file():
        info = json.loads((ckpt / LORA_FILE).read_text())
        spec = family_spec(cfg, info["rank"], info["alpha"], info["targets"], info["rslora"],
                           info.get("rank_pattern"), info.get("alpha_pattern"),
                           info["dropout"])
        return spec, base or info["base"]
    if not (ckpt / "config.yaml").is_file():
        return None
    model = yaml.safe_load((ckpt / "config.yaml").read_text()).get("model", {})
    lora = model.get("lora") or {}
    if not lora.get("rank"):
        return None
    spec = family_spec(cfg, int(lora["rank"]), float(lora["alpha"]), lora["target_modules"],
                       bool(lora.get("rslora", False)), lora.get("rank_pattern"),
                       lora.get("alpha_pattern"), float(lora.get("dropout", 0.0)))
    return spec, base or model.get("hf_path")


def load_lora_model(ckpt: Path, cfg: dict, spec, base: str):
    """Chunks (world 1) with the base from `base` and the adapters from `ckpt`."""
    from models.bridge.weights import load_hf_weights
    from models.bridge.checkpoint import load_model
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader

    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"the LoRA checkpoint's base model folder {base!r} is not readable; "
                         "pass --base HF_DIR")
    chunks = build_model_chunks(cfg, lora=spec)
    load_hf_weights(chunks, SafetensorsReader(base), cfg)
    load_model(chunks, ckpt)
    return chunks


def export_lora(ckpt: Path, cfg: dict, found, out: Path, merge: bool, dtype, write_hf) -> int:
    """Write the PEFT adapter (engine.checkpoint.hf_export.export_adapter_folder, which
    checkpoint.save_hf writes during training too), or with `merge` the merged HF model via
    `write_hf(tensors)`; returns the number of tensors written."""
    import torch

    from engine.checkpoint.hf_export import export_adapter_folder
    from models.bridge.weights import export_hf_weights
    from models.lora.sites import merged_weight

    spec, base = found
    chunks = load_lora_model(ckpt, cfg, spec, base)
    cast = getattr(torch, dtype) if dtype else None
    if merge:
        tensors = {n: (t if cast is None else t.to(cast)).clone()
                   for n, t in export_hf_weights(chunks, cfg, transform=merged_weight)}
        write_hf(tensors)
        return len(tensors)
    return export_adapter_folder(chunks, cfg, spec, base, out, cast)


def adapter_to_mcore(cfg: dict, hf_dir: str, adapter_dir: str, out: Path) -> None:
    """Collective: a Megatron checkpoint of the PEFT adapter (adapters only) plus lora.json."""
    import torch.distributed as dist

    from models.bridge.weights import load_hf_weights
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader
    from models.hf.conditional import peft_layers
    from models.lora.peft import load_peft_adapter

    spec = spec_from_peft(adapter_dir, cfg)
    chunks = build_model_chunks(cfg, lora=spec)
    load_hf_weights(chunks, SafetensorsReader(hf_dir), cfg)
    load_peft_adapter(chunks, adapter_dir, peft_layers(cfg))
    save_checkpoint(model_sharded_state_dict(chunks), out, cfg, hf_dir)
    if dist.get_rank() == 0:
        (out / LORA_FILE).write_text(json.dumps({
            "rank": spec.rank, "alpha": spec.alpha, "targets": sorted(spec.targets),
            "dropout": spec.dropout, "rslora": spec.rslora,
            "rank_pattern": spec.rank_pattern, "alpha_pattern": spec.alpha_pattern,
            "base": str(Path(hf_dir).resolve())}, indent=2))
