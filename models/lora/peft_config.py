"""PEFT adapter folders' adapter_config.json, read: the model.lora.* values it determines
(`adapter_keys`) and why it cannot start a run (`adapter_config_problems`).

Plain Python (json and models.lora.targets): engine.config.lora_settings checks
model.lora.init_from with it before any process group exists, without importing megatron-core
through the adapters (models.lora.peft, which loads and writes the folders, re-exports it).
"""
from __future__ import annotations

import json
from pathlib import Path

from models.lora.targets import parameter_target, pattern_problems, user_names

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def parameter_targets(cfg: dict) -> tuple[list[str], list]:
    """(resolved targets, entries no target matches) of an adapter_config.json's
    target_parameters (models.lora.targets.parameter_target)."""
    entries = list(cfg.get("target_parameters") or [])
    found = [parameter_target(str(e)) for e in entries]
    return [t for t in found if t], [e for e, t in zip(entries, found) if t is None]


# adapter_config.json fields that change the math, with the only value implemented exactly
_FIXED = {"peft_type": "LORA", "use_dora": False, "bias": "none", "fan_in_fan_out": False,
          "modules_to_save": None, "layers_to_transform": None}


def _target_names(targets) -> list[str] | None:
    """peft's `target_modules` as model.lora.target_modules names: "all-linear", a list of
    names ("q_proj") or of module paths ("model.layers.0.self_attn.q_proj": peft saves these
    for some models, tied ones among them). A path counts as its last component (peft's
    conversion reads it so too); load_peft_adapter then needs a tensor for that projection in
    every layer, so an adapter of some layers only is still refused. None: a regular
    expression (any other string), which is not supported."""
    if targets == "all-linear":
        return ["all-linear"]
    if isinstance(targets, str):
        return None
    return sorted({t.rsplit(".", 1)[-1] for t in targets or []})


def adapter_keys(adapter_dir: str | Path) -> dict | None:
    """The model.lora.* values a PEFT adapter folder determines: {"rank", "alpha",
    "target_modules" (model.lora.target_modules names: its target_modules, read as a family
    reads them, plus its target_parameters as `experts`, `experts.gate_up_proj`,
    `experts.down_proj`, `router`; None for a regular expression), "rslora", "rank_pattern",
    "alpha_pattern"}; None when its adapter_config.json cannot be read."""
    try:
        cfg = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    names = _target_names(cfg.get("target_modules"))
    parameters = user_names(frozenset(parameter_targets(cfg)[0]))
    targets = None if names is None else sorted(set(names) | set(parameters))
    return {"rank": cfg.get("r"), "alpha": cfg.get("lora_alpha"), "target_modules": targets,
            "rslora": bool(cfg.get("use_rslora", False)),
            "rank_pattern": dict(cfg.get("rank_pattern") or {}),
            "alpha_pattern": dict(cfg.get("alpha_pattern") or {})}


def adapter_config_problems(adapter_dir: str | Path) -> list[str]:
    """Why the PEFT adapter at `adapter_dir` cannot start a run whatever the keys
    (model.lora.init_from): a missing file, a field with a value this engine does not
    implement (DoRA, biases, per-layer adapters...), target_parameters other than the fused
    experts' and the router's weight, a regular expression as target_modules, or a
    rank_pattern / alpha_pattern that is not {regular expression: number > 0}. Whether it
    matches the model.lora.* keys: engine.config.lora_settings."""
    key = f"model.lora.init_from={adapter_dir}"
    folder = Path(adapter_dir)
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / f).is_file()]
    if missing:
        return [f"{key}: not a PEFT adapter folder (missing {', '.join(missing)})"]
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    problems = [f"{key}: adapter_config.json has {field}={cfg.get(field)!r}; only "
                f"{value!r} is supported" for field, value in _FIXED.items()
                if cfg.get(field, value) not in (value, [] if value is None else value)]
    unknown = parameter_targets(cfg)[1]
    if unknown:
        problems.append(f"{key}: adapter_config.json has target_parameters {unknown!r}, "
                        "which no adapter here matches; supported: the fused experts' "
                        "gate_up_proj / down_proj (mlp.experts.*) and the router's gate.weight")
    for field in ("rank_pattern", "alpha_pattern"):
        problems += [f"{key}: adapter_config.json {p}"
                     for p in pattern_problems(cfg.get(field) or {}, field)]
    if _target_names(cfg.get("target_modules")) is None:
        problems.append(f"{key}: adapter_config.json has target_modules="
                        f"{cfg.get('target_modules')!r}, a regular expression; only "
                        "'all-linear' or a list of module names is supported")
    return problems
