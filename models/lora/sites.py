"""Where LoRA adapters go in a Megatron GPTModel, and attaching them (docs/lora.md).

`model.lora.target_modules` names HF projections (TARGET_NAMES, or "all-linear" for
ALL_LINEAR); each maps to a Megatron linear of every decoder layer and a slice of it:

    q_proj, k_proj, v_proj  -> self_attention.linear_qkv  (column-parallel, fused per group)
    o_proj                  -> self_attention.linear_proj (row-parallel)
    gate_proj, up_proj      -> mlp.linear_fc1             (column-parallel, [gate; up] per rank)
    down_proj               -> mlp.linear_fc2             (row-parallel)
    experts                 -> every local expert's linear_fc1 (gate/up) and linear_fc2 (down)

`apply_lora(chunks, spec)` freezes every base parameter (requires_grad False: no gradient, no
DDP bucket, no optimizer state), attaches the adapters (trainable) and initialises them like
peft, identically at every layout. On an MoE layer gate_proj/up_proj/down_proj adapt nothing
(as in peft, whose names there match no nn.Linear); megatron's SequentialMLP experts are needed
for `experts` (models.layers.experts.grouped computes all experts at once, past the hooks).
"""
from __future__ import annotations

from typing import Iterator

import torch

from models.lora.adapters import ADAPTER_SUFFIX, LoraAdapter, LoraSpec, Slice, init_full

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGET_NAMES = ATTENTION + MLP + ("experts",)
ALL_LINEAR = ATTENTION + MLP

# (parent path in a layer, linear name, kind, the slices' target names)
_DENSE_SITES = (("self_attention", "linear_qkv", "column", ("q_proj", "k_proj", "v_proj")),
                ("self_attention", "linear_proj", "row", ("o_proj",)),
                ("mlp", "linear_fc1", "column", ("gate_proj", "up_proj")),
                ("mlp", "linear_fc2", "row", ("down_proj",)))
_EXPERT_SITES = (("linear_fc1", "column", ("gate_proj", "up_proj")),
                 ("linear_fc2", "row", ("down_proj",)))


class LoraUnsupportedError(ValueError):
    """The model cannot carry the requested adapters exactly (message names the key)."""


def target_list(names) -> list[str]:
    """model.lora.target_modules as given, one string or a list, as a list."""
    return [names] if isinstance(names, str) else list(names)


def resolve_targets(names) -> frozenset:
    """The target names of model.lora.target_modules ("all-linear" expanded)."""
    out = set()
    for name in target_list(names):
        out |= set(ALL_LINEAR) if name == "all-linear" else {name}
    return frozenset(out)


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _slices(linear, config, names: tuple, kind: str) -> list[Slice]:
    """Full sizes of every slice of one linear (this rank's weight is a TP shard)."""
    tp = linear.tp_group.size()
    out_full, in_local = linear.weight.shape[0] * (tp if kind == "column" else 1), \
        linear.weight.shape[1]
    in_full = in_local * (tp if kind == "row" else 1)
    if names[0] == "q_proj":
        d = config.kv_channels
        sizes = {"q_proj": config.num_attention_heads * d,
                 "k_proj": config.num_query_groups * d, "v_proj": config.num_query_groups * d}
    elif len(names) == 2:
        sizes = dict.fromkeys(names, out_full // 2)
    else:
        sizes = {names[0]: out_full}
    return [Slice(n, in_full, sizes[n]) for n in names]


def _attach(parent, name: str, kind: str, fused: list[Slice], targeted: frozenset,
            spec: LoraSpec, key: str, config) -> LoraAdapter:
    linear = getattr(parent, name)
    qkv = None
    if name == "linear_qkv":
        tp = linear.tp_group.size()
        groups = config.num_query_groups // tp
        qkv = (groups, config.num_attention_heads // config.num_query_groups,
               config.kv_channels)
    adapter = LoraAdapter(linear, kind, fused, targeted, spec, qkv)
    for sl in adapter.slices:
        adapter.set_full(sl.name, *init_full(spec, f"{key}.{sl.name}", sl))
    parent.add_module(name + ADAPTER_SUFFIX, adapter)
    linear.register_forward_hook(adapter.hook)
    return adapter


def _layer_sites(layer, spec: LoraSpec) -> Iterator[tuple]:
    """(parent, linear name, kind, fused slices, targeted names, key) of every adapter of
    one decoder layer."""
    config, number = layer.config, layer.layer_number - 1
    for parent_name, name, kind, names in _DENSE_SITES:
        parent = getattr(layer, parent_name)
        if not hasattr(parent, name) or not set(names) & spec.targets:
            continue
        fused = _slices(getattr(parent, name), config, names, kind)
        yield parent, name, kind, fused, spec.targets, f"layer{number}.{parent_name}"
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None or "experts" not in spec.targets:
        return
    if not hasattr(experts, "local_experts") or type(experts).__name__ != "SequentialMLP":
        raise LoraUnsupportedError(
            f"model.lora.target_modules with experts needs megatron's SequentialMLP experts, "
            f"this model computes them with {type(experts).__name__}: set "
            "moe.grouped_experts=false")
    ep_rank = experts.ep_group.rank() if experts.ep_group is not None else 0
    for j, expert in enumerate(experts.local_experts):
        global_expert = ep_rank * experts.num_local_experts + j
        for name, kind, names in _EXPERT_SITES:
            fused = _slices(getattr(expert, name), config, names, kind)
            yield (expert, name, kind, fused, frozenset(names),
                   f"layer{number}.expert{global_expert}")


def apply_lora(chunks: list, spec: LoraSpec) -> int:
    """Freeze the base of every chunk and attach the adapters of `spec` (this rank's shards,
    initialised like peft and layout-independently). Returns the number of adapters."""
    count = 0
    for chunk in chunks:
        model = _unwrap(chunk)
        model.requires_grad_(False)
        for layer in model.decoder.layers:
            for site in list(_layer_sites(layer, spec)):
                _attach(*site[:5], spec, site[5], layer.config)
                count += 1
        model.lora_spec = spec
    return count


def lora_spec_of(chunks: list) -> LoraSpec | None:
    """The LoraSpec the chunks were built with (None: no adapters)."""
    return getattr(_unwrap(chunks[0]), "lora_spec", None) if chunks else None


def adapters(model) -> Iterator[tuple[str, LoraAdapter]]:
    """(module name, adapter) of one unwrapped GPTModel chunk."""
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter):
            yield name, module


def is_adapter_param(name: str) -> bool:
    """Whether a megatron parameter / state-dict name belongs to an adapter."""
    return any(part.endswith(ADAPTER_SUFFIX) for part in name.split("."))


def set_reduction(chunks: list, reduce: bool) -> None:
    """Negative controls only: switch the adapters' TP reductions off (models.lora.adapters)."""
    for chunk in chunks:
        for _, adapter in adapters(_unwrap(chunk)):
            adapter.reduce = reduce


def merged_weight(model, name: str, param: torch.Tensor) -> torch.Tensor:
    """`param` (megatron name `name` in the unwrapped chunk `model`) with its adapter merged
    in: base + scaling * B A in the local shard layout (other parameters as they are). A
    transform for models.bridge.weights.export_hf_weights."""
    data = param.detach()
    if not name.endswith(".weight"):
        return data
    parent_name, _, linear = name[:-len(".weight")].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    adapter = getattr(parent, linear + ADAPTER_SUFFIX, None)
    if adapter is None:
        return data
    return (data.float() + adapter.delta()).to(data.dtype)
