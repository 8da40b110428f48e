"""What `model.lora.target_modules` names adapt, as peft 0.21 reads them on transformers 5
models, and peft's per-module rank and alpha (`rank_pattern` / `alpha_pattern`).

Resolved targets (LoraSpec.targets, what models.lora.sites attaches):

- projection names (ALL_LINEAR): an HF nn.Linear of every layer that has it (gate_proj /
  up_proj / down_proj: a dense layer's MLP or a shared expert; shared_expert_gate: Qwen3.5-MoE's
  gate of the shared expert);
- "experts.gate_up_proj", "experts.down_proj" (EXPERT_TARGETS): peft's target_parameters on
  transformers' fused routed experts, one adapter per expert;
- "router" (ROUTER): peft's target_parameter `gate.weight`, the MoE router's weight.

A user may also write `experts` (both expert parameters) and `all-linear`. A family on which
peft converts names (peft's `_MOE_TARGET_MODULE_MAPPING` for the family's conversion pattern;
Family.lora_fused: {name: fused parameter}) reads those names as the fused parameters
(gate_proj / up_proj -> gate_up_proj, down_proj -> down_proj, gate -> gate.weight; Mixtral:
w1 / w3 / w2) and never as a dense or shared-expert MLP; names fused into one parameter must be
listed together (peft raises otherwise), and then that parameter gets rank n x r and alpha
n x alpha (`conversion_patterns`). `all-linear` there is the family's linear names plus every
name of the conversion (so the experts and the router).

Plain Python (no torch): engine.config reads it before any process group starts.
"""
from __future__ import annotations

import re

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")   # with q_proj and o_proj
MLP = ("gate_proj", "up_proj", "down_proj")
SHARED_GATE = "shared_expert_gate"   # Qwen3.5-MoE's sigmoid gate of the shared expert (h -> 1)
# each family has the part of it its modules carry
ALL_LINEAR = ATTENTION + GDN + MLA + MLP + (SHARED_GATE,)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")   # transformers' fused expert parameters
EXPERT_TARGETS = tuple(f"experts.{p}" for p in EXPERT_PARAMS)
ROUTER = "router"
PARAMETER_TARGETS = EXPERT_TARGETS + (ROUTER,)
# what model.lora.target_modules may hold besides all-linear and a family's fused names
TARGET_NAMES = ALL_LINEAR + ("experts",) + PARAMETER_TARGETS
# peft's fused parameter (a value of Family.lora_fused) -> the resolved target
_FUSED = {"gate_up_proj": EXPERT_TARGETS[0], "down_proj": EXPERT_TARGETS[1],
          "gate.weight": ROUTER}


def target_list(names) -> list[str]:
    """model.lora.target_modules as given, one string or a list, as a list."""
    return [names] if isinstance(names, str) else list(names)


def resolve_targets(names, linear: tuple = ALL_LINEAR, fused: dict | None = None) -> frozenset:
    """The resolved targets of model.lora.target_modules on a family whose nn.Linear names
    are `linear` (all-linear's modules) and whose peft conversion is `fused` (None / {}:
    none). Names a model has no module for adapt nothing there."""
    fused = fused or {}
    out = set()
    for name in target_list(names):
        if name == "all-linear":
            out |= set(linear) | {_FUSED[p] for p in fused.values()}
        elif name in fused:
            out.add(_FUSED[fused[name]])
        elif name == "experts":
            out |= set(EXPERT_TARGETS)
        else:
            out.add(name)
    return frozenset(out)


def _converted(names, fused: dict) -> dict[str, set]:
    """{fused parameter: the names of target_modules peft converts into it}."""
    given = set(target_list(names))
    everything = "all-linear" in given
    out: dict[str, set] = {}
    for name, param in fused.items():
        if everything or name in given:
            out.setdefault(param, set()).add(name)
    return out


def fused_problems(names, fused: dict | None) -> list[str]:
    """peft's refusal of names fused into one parameter but listed apart (gate_proj without
    up_proj), one sentence each; empty: none."""
    problems = []
    for param, present in _converted(names, fused or {}).items():
        needed = {n for n, p in (fused or {}).items() if p == param}
        if present != needed:
            problems.append(f"{sorted(present)} without {sorted(needed - present)}: peft 0.21 "
                            f"fuses them into the experts' {param} (one adapter for all of "
                            "them) and refuses one alone; list them together")
    return problems


def conversion_patterns(names, fused: dict | None, rank: int,
                        alpha: float) -> tuple[dict, dict]:
    """(rank_pattern, alpha_pattern) entries peft's conversion adds to adapter_config.json for
    these names: `.*\\.<param>` -> n x rank and n x alpha for every fused parameter that n > 1
    listed names make ({}, {}: none)."""
    ranks, alphas = {}, {}
    for param, present in _converted(names, fused or {}).items():
        needed = [n for n, p in (fused or {}).items() if p == param]
        if len(needed) > 1 and present == set(needed):
            key = rf".*\.{re.escape(param)}"
            ranks[key], alphas[key] = rank * len(needed), alpha * len(needed)
    return ranks, alphas


def merged_patterns(given: dict | None, added: dict) -> dict:
    """`given` (a user's or an adapter's pattern) with peft's conversion entries `added` set
    in it, in peft's order (a key already present keeps its place)."""
    out = dict(given or {})
    out.update(added)
    return out


def pattern_key(patterns, key: str) -> str:
    """peft's get_pattern_key: the first pattern P (in order) with `key` matching
    `(.*\\.)?(P)$` from its start, else `key` itself (looked up as a plain name)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


def pattern_problems(patterns, field: str) -> list[str]:
    """Why `patterns` (an adapter's or model.lora.*'s rank_pattern / alpha_pattern) is not a
    mapping of regular expressions to numbers > 0 (ranks: integers)."""
    if patterns is None:
        return []
    if not hasattr(patterns, "items"):
        return [f"{field}={patterns!r} must be a mapping of module patterns to values"]
    out = []
    for pattern, value in patterns.items():
        try:
            re.compile(str(pattern))
        except re.error as e:
            out.append(f"{field} key {pattern!r} is not a regular expression ({e})")
        rank = field.endswith("rank_pattern")
        if isinstance(value, bool) or not isinstance(value, int if rank else (int, float)) \
                or value <= 0:
            out.append(f"{field}[{pattern!r}]={value!r} must be "
                       f"{'an integer' if rank else 'a number'} > 0")
    return out


def parameter_target(entry: str) -> str | None:
    """The resolved target of one peft target_parameters entry (peft matches by suffix:
    "gate_up_proj", "mlp.experts.gate_up_proj", "experts.down_proj", "gate.weight",
    "mlp.gate.weight", gpt-oss's "mlp.router.weight"), else None."""
    for param, target in zip(EXPERT_PARAMS, EXPERT_TARGETS):
        if entry in (param, f"experts.{param}") or entry.endswith(f".experts.{param}"):
            return target
    if entry in ("gate.weight", "router.weight") or entry.endswith((".gate.weight",
                                                                    ".router.weight")):
        return ROUTER   # gpt-oss's router is mlp.router
    return None


def user_names(targets: frozenset) -> list[str]:
    """model.lora.target_modules names that resolve (without a family's conversion) to the
    resolved `targets`: both expert parameters as `experts`, sorted."""
    out = set(targets)
    if set(EXPERT_TARGETS) <= out:
        out = (out - set(EXPERT_TARGETS)) | {"experts"}
    return sorted(out)
