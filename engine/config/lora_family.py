"""model.lora.* read on one model family, as peft 0.21 reads the same names on the
transformers 5 model (docs/lora.md): which names the family has, what they adapt
(models.lora.targets with the family's declared `lora_linear` / `lora_fused`), the per-module
ranks they give, and whether an init_from adapter says the same.

`family_spec` builds the models.lora.slices.LoraSpec; `target_problems`, `layer_rank_problems`
and `init_from_problems` refuse, naming the key, what cannot be built exactly.
"""
from __future__ import annotations

from typing import Any

from models.families.base import Family
from models.families.registry import FAMILIES, moe_family
from models.hf.conditional import peft_layers
from models.lora.slices import LoraSpec
from models.lora.targets import (ATTENTION, EXPERT_TARGETS, GDN, MLA, MLP, PARAMETER_TARGETS,
                                 ROUTER, SHARED_GATE, conversion_patterns, fused_problems,
                                 merged_patterns, resolve_targets, target_list)

# every family's peft conversion names (w1, w3, w2, gate): valid words before the family is
# known (engine.config.lora_settings); each family then accepts its own
FUSED_NAMES = tuple(sorted({n for f in FAMILIES.values() for n in (f.lora_fused or {})}))


def family(hf_config: Any) -> Family:
    """The model's Family (a bare Family for an unknown model_type: no LoRA)."""
    return FAMILIES.get(hf_config.get("model_type"), Family())


def family_spec(hf_config: Any, rank: int, alpha: float, names, rslora: bool = False,
                rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                dropout: float = 0.0, seed: int = 0) -> LoraSpec:
    """The LoraSpec of model.lora.* names `names` on this model: targets as peft reads them
    here, and `rank_pattern` / `alpha_pattern` with the entries peft's conversion adds (its
    fused gate_up_proj: 2 x rank, 2 x alpha)."""
    fam = family(hf_config)
    ranks, alphas = conversion_patterns(names, fam.lora_fused, rank, alpha)
    return LoraSpec(rank=rank, alpha=alpha,
                    targets=resolve_targets(names, fam.lora_linear(hf_config), fam.lora_fused),
                    dropout=dropout, rslora=rslora, seed=seed,
                    rank_pattern=merged_patterns(rank_pattern, ranks),
                    alpha_pattern=merged_patterns(alpha_pattern, alphas))


def target_problems(names, dropout: float, hf_config: Any) -> list[str]:
    """Why model.lora.target_modules `names` cannot be built on this model: a name the family
    lacks or refuses, names peft fuses listed apart, experts or the router on a dense model,
    dropout on a target_parameters adapter (peft refuses it there too)."""
    fam, p = family(hf_config), []
    model_type = hf_config.get("model_type")
    fused = fam.lora_fused or {}
    words = fam.lora_targets + tuple(fused) + ("all-linear", "experts") + PARAMETER_TARGETS
    for name in target_list(names):
        if name in fam.lora_refused:
            p.append(f"model.lora.target_modules={name!r} on {model_type}: "
                     f"{fam.lora_refused[name]}")
        elif name not in words:
            p.append(f"model.lora.target_modules={name!r}: {model_type} has no such projection;"
                     f" its names: {', '.join(fam.lora_targets + tuple(fused))} "
                     "(experts, experts.gate_up_proj, experts.down_proj, router on MoE models), "
                     "all-linear")
    p += [f"model.lora.target_modules on {model_type}: {x}" for x in fused_problems(names, fused)]
    targets = resolve_targets(names, fam.lora_linear(hf_config), fused)
    moe = moe_family(hf_config) is not None
    parameters = sorted(targets & set(PARAMETER_TARGETS))
    if parameters and not moe:
        p.append(f"model.lora.target_modules adapts {parameters}, but the model has no MoE "
                 "experts or router; remove them")
    if parameters and moe and dropout:
        p.append(f"model.lora.dropout={dropout} with {parameters} in model.lora.target_modules: "
                 "adapters of parameters (the experts, the router) take no dropout (peft's "
                 "target_parameters refuse it too); set model.lora.dropout=0")
    return p


def layer_paths(hf_config: Any, layer: int) -> dict[str, str]:
    """{HF path in decoder layer `layer`: its target} of every adapter site the layer has."""
    fam = family(hf_config)
    mixer = fam.mixer_of(hf_config, layer)
    names = {"mla": MLA + ("q_proj", "o_proj"), "gated_delta_net": GDN}.get(mixer, ATTENTION)
    parent = "linear_attn" if mixer == "gated_delta_net" else "self_attn"
    paths = {f"{parent}.{n}": n for n in names}
    moe = moe_family(hf_config)
    if moe is None or not moe.is_moe_layer(hf_config, layer):
        return {**paths, **{f"mlp.{n}": n for n in MLP}}
    shared = fam.lora_hf_paths.get("mlp.shared_expert", "mlp.shared_expert")
    router = fam.lora_hf_paths.get("mlp.gate", "mlp.gate")
    paths.update({f"{shared}.{n}": n for n in MLP})
    paths.update({f"mlp.{t}": t for t in EXPERT_TARGETS})
    return {**paths, f"{router}.weight": ROUTER, f"mlp.{SHARED_GATE}": SHARED_GATE}


def layer_rank_problems(spec: LoraSpec, hf_config: Any) -> list[str]:
    """A rank_pattern that gives one projection different ranks in different layers: megatron's
    checkpoint stacks a projection's adapters of every layer into one tensor, so each needs
    one rank everywhere (alpha_pattern may differ per layer)."""
    if not spec.rank_pattern:
        return []
    layers = peft_layers(hf_config)
    ranks: dict[str, dict[int, list[int]]] = {}
    for i in range(int(hf_config.get("num_hidden_layers", 0))):
        for path, target in layer_paths(hf_config, i).items():
            if target in spec.targets:
                rank = spec.rank_of(f"{layers}.{i}.{path}")
                ranks.setdefault(path, {}).setdefault(rank, []).append(i)
    return [f"model.lora.rank_pattern gives {path} rank "
            + ", ".join(f"{r} in layers {v}" for r, v in by.items())
            + ": megatron's checkpoint stacks one projection's adapters of every layer into one "
            "tensor, so a projection needs the same rank in every layer (alpha_pattern may "
            "differ per layer)" for path, by in sorted(ranks.items()) if len(by) > 1]


def init_from_problems(lora, spec: LoraSpec, found: dict, hf_config: Any) -> list[str]:
    """Where model.lora.* (`lora`, built as `spec`) differs from the init_from adapter's
    values `found` (models.lora.peft.adapter_keys): r, lora_alpha, use_rslora, what its
    targets adapt on this model, and its effective rank / alpha patterns."""
    key, p = f"model.lora.init_from={lora.init_from}", []
    for field, mine, theirs, name in (("r", spec.rank, found["rank"], "rank"),
                                      ("lora_alpha", spec.alpha, found["alpha"], "alpha"),
                                      ("use_rslora", spec.rslora, found["rslora"], "rslora")):
        if mine != theirs:
            p.append(f"{key}: adapter_config.json has {field}={theirs!r}, "
                     f"model.lora.{name}={mine!r}; make them equal")
    if found["target_modules"] is None or not isinstance(found["rank"], int):
        return p
    theirs = family_spec(hf_config, found["rank"], found["alpha"] or 0.0,
                         found["target_modules"], found["rslora"], found["rank_pattern"],
                         found["alpha_pattern"])
    if theirs.targets != spec.targets:
        p.append(f"{key}: adapter_config.json adapts {sorted(theirs.targets)} on this model, "
                 f"model.lora.target_modules {target_list(lora.target_modules)} adapts "
                 f"{sorted(spec.targets)}; make them equal")
    for field in ("rank_pattern", "alpha_pattern"):
        if getattr(theirs, field) != getattr(spec, field):
            p.append(f"{key}: adapter_config.json gives {field} {getattr(theirs, field)}, "
                     f"model.lora.* gives {getattr(spec, field)}; make them equal")
    return p
