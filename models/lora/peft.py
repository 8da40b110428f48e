"""LoRA adapters <-> PEFT adapter folders (adapter_config.json + adapter_model.safetensors).

peft names a LoRA pair of an HF projection `base_model.model.<module>.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r], with <module> `model.layers.{i}.<path>`: self_attn.{q,k,v,o}_proj,
linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj} (Qwen3.5's Gated DeltaNet),
mlp.{gate,up,down}_proj or the shared expert's mlp.shared_expert(s).{gate,up,down}_proj, and the
router's target_parameter gate.weight as `mlp.gate` (lora_A [r, h], lora_B [E, r]: peft wraps
the router module). Megatron keeps the same matrices per slice of its fused linears
(models.lora.adapters), TP-sharded, each with its HF path (LoraAdapter.hf_paths);
`export_peft_tensors` gathers them, `load_peft_adapter` shards them back. Expert adapters use
peft's `target_parameters` format for transformers' fused 3-D expert parameters
(models.lora.peft_experts). Per-module ranks and alphas are peft's `rank_pattern` /
`alpha_pattern` (LoraSpec), read and written as adapter_config.json holds them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.lora.adapters import LoraAdapter, LoraSpec
from models.lora.modes import attach_reference, reference_adapters
from models.lora.peft_experts import LAYERS, PARENT, PREFIX, export_experts, load_experts
from models.lora.sites import (EXPERT_PARAMS, LoraUnsupportedError, ROUTER_PATH, adapters,
                               unwrap)
from models.lora.peft_config import (CONFIG_FILE, WEIGHTS_FILE,  # noqa: F401 (re-exported)
                                     adapter_config_problems, adapter_keys, parameter_targets)
from models.lora.targets import EXPERT_TARGETS


def peft_names(layer: int, path: str, layers: str = LAYERS) -> tuple[str, str]:
    """peft's (lora_A, lora_B) tensor names of the module at HF path `path` in global layer
    `layer` (LoraAdapter.hf_paths: self_attn.q_proj, mlp.shared_expert.gate_proj, mlp.gate),
    `layers` the decoder layers' HF path."""
    head = f"{PREFIX}{layers}.{layer}.{path}"
    return f"{head}.lora_A.weight", f"{head}.lora_B.weight"


def _sites(model) -> Iterator[tuple[int, LoraAdapter]]:
    """(global layer, adapter) of every adapter of one unwrapped chunk but the experts'
    (models.lora.peft_experts)."""
    for name, adapter in adapters(model):
        if not adapter.is_expert:
            local = int(name.split(".")[2])   # decoder.layers.{local}....
            yield model.decoder.layers[local].layer_number - 1, adapter


def export_peft_tensors(chunks: list, layers: str = LAYERS) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of every adapter matrix this pipeline stage holds, expert
    adapters in peft's target_parameters format; `layers`: the decoder layers' HF path.
    Collective over each adapter's TP group and, for experts, the EP group (every rank of the
    stage iterates it together)."""
    for chunk in chunks:
        model = unwrap(chunk)
        for layer, adapter in _sites(model):
            for sl in adapter.slices:
                a, b = adapter.full_matrices(sl.name)
                name_a, name_b = peft_names(layer, adapter.hf_paths[sl.name], layers)
                yield name_a, a.contiguous()
                yield name_b, b.contiguous()
        yield from export_experts(model, layers)


def load_peft_adapter(chunks: list, adapter_dir: str | Path, layers: str = LAYERS) -> int:
    """Copy a PEFT adapter's matrices into this rank's adapter shards; returns how many slices
    were filled. Raises LoraUnsupportedError when the folder's tensors are not exactly the
    adapters of these chunks' layers (a tensor with no adapter, or an adapter with no tensor).
    `layers`: the decoder layers' HF path."""
    path = Path(adapter_dir) / WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    used, filled = set(), 0
    for chunk in chunks:
        model = unwrap(chunk)
        for layer, adapter in _sites(model):
            for sl in adapter.slices:
                name_a, name_b = peft_names(layer, adapter.hf_paths[sl.name], layers)
                if name_a not in stored or name_b not in stored:
                    raise LoraUnsupportedError(f"model.lora.init_from={adapter_dir}: no "
                                               f"{name_a} / {name_b} for the adapter of "
                                               f"{sl.name}")
                adapter.set_full(sl.name, stored[name_a], stored[name_b])
                used |= {name_a, name_b}
                filled += 1
        try:
            names, count = load_experts(model, stored, layers)
        except KeyError as e:
            raise LoraUnsupportedError(f"model.lora.init_from={adapter_dir}: no {e.args[0]} "
                                       "for the expert adapters") from None
        used |= names
        filled += count
    held = {_layer_of(n) for n in used}   # this pipeline stage's layers
    # tensors of no decoder layer (an lm_head's, a vision tower's) have no adapter anywhere
    extra = sorted(n for n in stored if n not in used and _layer_of(n) in held | {None})
    if extra:
        raise LoraUnsupportedError(f"model.lora.init_from={adapter_dir} holds tensors this "
                                   f"model.lora.target_modules does not adapt: {extra[:4]}")
    return filled


def load_reference_adapter(chunks: list, adapter_dir: str | Path, layers: str = LAYERS) -> int:
    """Give every adapter of `chunks` frozen reference matrices holding the PEFT adapter in
    `adapter_dir`, sharded as `load_peft_adapter` shards it into the parameters (the same
    code: TP shards, this rank's experts, this pipeline stage's layers), so that inside
    models.lora.modes.reference_adapters the chunks compute that adapter exactly; the
    trained parameters are untouched. Read from the folder, never from a checkpoint: after a
    resume the reference is still the starting adapter. Costs one more copy of this rank's
    adapter matrices. Returns how many slices were filled; raises as load_peft_adapter."""
    attach_reference(chunks)
    with reference_adapters(chunks):
        return load_peft_adapter(chunks, adapter_dir, layers)


def _layer_of(name: str) -> int | None:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def peft_config(spec: LoraSpec, base_path: str, targets: list[str],
                parameters: list[str] | None = None, task_type: str = "CAUSAL_LM",
                modules_to_save: list[str] | None = None) -> dict:
    """adapter_config.json for PeftModel.from_pretrained (the base at `base_path`); `targets`:
    the projection names the adapter holds, `parameters`: its target_parameters (experts,
    router); spec's rank_pattern / alpha_pattern as peft writes them; `task_type` and
    `modules_to_save` as peft's LoraConfig (a reward model: "SEQ_CLS", ["score"])."""
    return {"peft_type": "LORA", "task_type": task_type, "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": targets, "target_parameters": parameters,
            "use_rslora": spec.rslora,
            "use_dora": False, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "base_model_name_or_path": base_path,
            "modules_to_save": modules_to_save, "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": dict(spec.rank_pattern), "alpha_pattern": dict(spec.alpha_pattern),
            "inference_mode": True}


def write_peft_adapter(tensors: dict, spec: LoraSpec, base_path: str, out: str | Path,
                       router: str = ROUTER_PATH, task_type: str = "CAUSAL_LM",
                       saved_modules: dict[str, torch.Tensor] | None = None) -> None:
    """Write a PEFT adapter folder from `export_peft_tensors`' full tensors (rank 0). Its
    target_modules are the projections the tensors adapt (all-linear: this family's), its
    target_parameters the expert parameters (mlp.experts.gate_up_proj / down_proj) and the
    router's weight (`router`: its HF path, `<router>.weight`) they hold. `saved_modules`:
    {HF module path: its full weight} trained in full beside the adapters, written as peft
    0.21 saves its modules_to_save (`base_model.model.<path>.weight`) and listed in
    modules_to_save (a reward model's {"score": [1, h]}, with task_type "SEQ_CLS")."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    saved_modules = saved_modules or {}
    stored = {k: v.contiguous() for k, v in tensors.items()}
    stored.update({f"{PREFIX}{path}.weight": w.contiguous() for path, w in saved_modules.items()})
    save_file(stored, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    parameters = [f"{PARENT}.{p}" for p, t in zip(EXPERT_PARAMS, EXPERT_TARGETS)
                  if t in spec.targets and any(f".{PARENT}." in n for n in tensors)]
    routed = [n for n in tensors if f".{router}.lora_" in n]
    parameters += [f"{router}.weight"] if routed else []
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in tensors
                      if f".{PARENT}." not in name and name not in routed})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(
        spec, base_path, targets, parameters or None, task_type,
        sorted(saved_modules) or None), indent=2))
