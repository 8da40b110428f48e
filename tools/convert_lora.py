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


def spec_from_peft(adapter_dir: str):
    """LoraSpec of a PEFT adapter folder; raises ValueError naming what is not implemented."""
    from models.lora.adapters import LoraSpec
    from models.lora.peft import CONFIG_FILE, adapter_config_problems, expert_order
    from models.lora.sites import TARGET_NAMES, resolve_targets

    cfg = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
    targets = cfg.get("target_modules") or []
    unknown = [t for t in ([targets] if isinstance(targets, str) else targets)
               if t not in TARGET_NAMES + ("all-linear",)]
    if unknown:
        raise ValueError(f"--adapter {adapter_dir}: target_modules {unknown} not supported; "
                         f"valid: {', '.join(TARGET_NAMES)}, all-linear")
    experts = {"experts"} if expert_order(cfg) else set()   # peft's target_parameters
    spec = LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), resolve_targets(targets) | experts,
                    float(cfg.get("lora_dropout") or 0.0), bool(cfg.get("use_rslora", False)))
    problems = adapter_config_problems(adapter_dir, spec)
    if problems:
        raise ValueError("; ".join(problems))
    return spec


def checkpoint_lora(ckpt: Path, base: str | None):
    """(LoraSpec, base folder) of a LoRA checkpoint, or None for a full-model checkpoint."""
    import yaml

    from models.lora.adapters import LoraSpec
    from models.lora.sites import resolve_targets

    if (ckpt / LORA_FILE).is_file():
        info = json.loads((ckpt / LORA_FILE).read_text())
        spec = LoraSpec(info["rank"], info["alpha"], frozenset(info["targets"]),
                        info["dropout"], info["rslora"])
        return spec, base or info["base"]
    if not (ckpt / "config.yaml").is_file():
        return None
    model = yaml.safe_load((ckpt / "config.yaml").read_text()).get("model", {})
    lora = model.get("lora") or {}
    if not lora.get("rank"):
        return None
    spec = LoraSpec(int(lora["rank"]), float(lora["alpha"]),
                    resolve_targets(lora["target_modules"]), float(lora.get("dropout", 0.0)),
                    bool(lora.get("rslora", False)))
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
    """Write the PEFT adapter (or with `merge` the merged HF model via `write_hf(tensors)`);
    returns the number of tensors written."""
    import torch

    from models.bridge.weights import export_hf_weights
    from models.hf.conditional import peft_layers
    from models.lora.peft import export_peft_tensors, write_peft_adapter
    from models.lora.sites import merged_weight

    spec, base = found
    chunks = load_lora_model(ckpt, cfg, spec, base)
    cast = (lambda t: t.to(getattr(torch, dtype))) if dtype else (lambda t: t)
    if merge:
        tensors = {n: cast(t).clone()
                   for n, t in export_hf_weights(chunks, cfg, transform=merged_weight)}
        write_hf(tensors)
        return len(tensors)
    tensors = {n: cast(t).clone() for n, t in export_peft_tensors(chunks, peft_layers(cfg))}
    write_peft_adapter(tensors, spec, str(base), out)
    return len(tensors)


def adapter_to_mcore(cfg: dict, hf_dir: str, adapter_dir: str, out: Path) -> None:
    """Collective: a Megatron checkpoint of the PEFT adapter (adapters only) plus lora.json."""
    import torch.distributed as dist

    from models.bridge.weights import load_hf_weights
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader
    from models.hf.conditional import peft_layers
    from models.lora.peft import load_peft_adapter

    spec = spec_from_peft(adapter_dir)
    chunks = build_model_chunks(cfg, lora=spec)
    load_hf_weights(chunks, SafetensorsReader(hf_dir), cfg)
    load_peft_adapter(chunks, adapter_dir, peft_layers(cfg))
    save_checkpoint(model_sharded_state_dict(chunks), out, cfg, hf_dir)
    if dist.get_rank() == 0:
        (out / LORA_FILE).write_text(json.dumps({
            "rank": spec.rank, "alpha": spec.alpha, "targets": sorted(spec.targets),
            "dropout": spec.dropout, "rslora": spec.rslora,
            "base": str(Path(hf_dir).resolve())}, indent=2))
