"""Where LoRA adapters go in a Megatron GPTModel, and attaching them (docs/lora.md).

`LoraSpec.targets` holds resolved targets (models.lora.targets: what model.lora.target_modules
means on the family, as peft reads it); each maps to a Megatron linear of every decoder layer
that has it (_SITES) and a slice of it:

    q_proj, k_proj, v_proj  -> self_attention.linear_qkv  (column-parallel, fused per group;
                               Qwen3.5's gated q_proj rows in megatron's order)
    o_proj                  -> self_attention.linear_proj (row-parallel)
    in_proj_qkv/z/b/a       -> self_attention.in_proj     (Gated DeltaNet, column-parallel,
                               [q_r; k_r; v_r; z_r; b_r; a_r] per rank)
    out_proj                -> self_attention.out_proj    (Gated DeltaNet, row-parallel)
    q_a_proj, kv_a_proj_with_mqa -> MLA's linear_q_down_proj / linear_kv_down_proj (replicated)
    q_b_proj, q_proj, kv_b_proj  -> MLA's linear_q_up_proj / linear_q_proj / linear_kv_up_proj
    gate_proj, up_proj      -> mlp.linear_fc1 (a dense layer) or mlp.shared_experts.linear_fc1
    down_proj               -> mlp.linear_fc2 or mlp.shared_experts.linear_fc2
    shared_expert_gate      -> mlp.shared_experts.gate_weight [1, h] (replicated; the adapter
                               adds to the gate's logit before its sigmoid, _adapt_shared_gate)
    router                  -> mlp.router (replicated: its weight [E, h] is whole on every
                               rank; the adapter adds to the router's logits, peft's
                               target_parameter gate.weight)
    experts.gate_up_proj    -> every local expert's linear_fc1 (one adapter on [gate; up])
    experts.down_proj       -> every local expert's linear_fc2: peft's target_parameters

Each adapter's slices carry their peft key (`model.layers.{i}.self_attn.q_proj`,
`model.layers.{i}.mlp.experts.gate_up_proj`, `model.layers.{i}.mlp.gate.weight`), which
gives them their rank and scaling (LoraSpec.rank_pattern / alpha_pattern), and their HF path
in the layer (`LoraAdapter.hf_paths`, peft's tensor names: models.lora.peft).

`apply_lora(chunks, spec, orders)` freezes every base parameter (requires_grad False: no
gradient, no DDP bucket, no optimizer state), attaches the adapters (trainable) and
initialises them like peft, identically at every layout. A name a layer has no linear for
adapts nothing there. Expert adapters work on megatron's SequentialMLP (through the linears'
hooks) and on models.layers.experts.grouped (through each linear's `low_rank_factors`).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from models.lora.adapters import ADAPTER_SUFFIX, LoraAdapter
from models.lora.slices import LoraSpec, Slice, init_full
from models.lora.targets import (ALL_LINEAR, ATTENTION, EXPERT_PARAMS, GDN, MLP, ROUTER,
                                 SHARED_GATE, TARGET_NAMES, resolve_targets, target_list)
from parallel.wrappers import unwrap

__all__ = ["ALL_LINEAR", "EXPERT_PARAMS", "TARGET_NAMES", "resolve_targets", "target_list"]
LAYERS = "model.layers"   # the decoder layers' HF path (conditional generation: another)
# HF paths in a layer that a family may spell otherwise (apply_lora's `hf_parents`)
SHARED_EXPERT, ROUTER_PATH = "mlp.shared_expert", "mlp.gate"

# (parent path in a layer, linear name, kind, the slices' target names, HF parent module);
# a layer has the sites whose linears it has (a GDN layer has in_proj, not linear_qkv)
_SITES = (("self_attention", "linear_qkv", "column", ATTENTION[:3], "self_attn"),
          ("self_attention", "linear_proj", "row", ("o_proj",), "self_attn"),
          ("self_attention", "linear_q_down_proj", "replicated", ("q_a_proj",), "self_attn"),
          ("self_attention", "linear_q_up_proj", "column", ("q_b_proj",), "self_attn"),
          ("self_attention", "linear_q_proj", "column", ("q_proj",), "self_attn"),
          ("self_attention", "linear_kv_down_proj", "replicated", ("kv_a_proj_with_mqa",),
           "self_attn"),
          ("self_attention", "linear_kv_up_proj", "column", ("kv_b_proj",), "self_attn"),
          ("self_attention", "in_proj", "column", GDN[:4], "linear_attn"),
          ("self_attention", "out_proj", "row", ("out_proj",), "linear_attn"),
          ("mlp", "linear_fc1", "column", MLP[:2], "mlp"),
          ("mlp", "linear_fc2", "row", ("down_proj",), "mlp"),
          ("mlp.shared_experts", "linear_fc1", "column", MLP[:2], SHARED_EXPERT),
          ("mlp.shared_experts", "linear_fc2", "row", ("down_proj",), SHARED_EXPERT),
          ("mlp.shared_experts", "gate_weight", "replicated", (SHARED_GATE,), "mlp"),
          ("mlp", "router", "replicated", (ROUTER,), ROUTER_PATH))
# every expert's linears as peft's target_parameters adapt transformers' fused 3-D expert
# parameters: one (A, B) per expert on gate_up_proj ([gate; up] rows) and one on down_proj
_EXPERT_SITES = (("linear_fc1", "column", EXPERT_PARAMS[:1]),
                 ("linear_fc2", "row", EXPERT_PARAMS[1:]))


class LoraUnsupportedError(ValueError):
    """The model cannot carry the requested adapters exactly (message names the key)."""


def gated_query_order(heads: int, groups: int, d: int) -> tuple:
    """Megatron's rows of the gated attention's q_proj as HF rows: HF holds per head [query
    (d rows); gate (d rows)], Megatron per query group [queries of its heads; their gates]."""
    per = heads // groups
    return tuple(j * 2 * d + c * d + t for g in range(groups) for c in (0, 1)
                 for j in range(g * per, (g + 1) * per) for t in range(d))


class _SharedGate:
    """SharedExpertMLP's sigmoid gate (megatron's gate_weight [1, h]; Qwen3.5-MoE's
    mlp.shared_expert_gate) as the linear a LoraAdapter reads (weight, tp_group)."""

    def __init__(self, shared):
        self.weight, self.tp_group = shared.gate_weight, shared.tp_group


def _linear(parent, name: str):
    """The linear `name` of `parent` an adapter sits beside (None: the parent has none)."""
    if name == "gate_weight":
        return _SharedGate(parent) if getattr(parent, name, None) is not None else None
    return getattr(parent, name, None)


def _adapt_shared_gate(shared, adapter: LoraAdapter) -> None:
    """The shared expert's output times sigmoid(x W_g^T + scaling x A^T B^T) (peft's adapter
    of shared_expert_gate) instead of megatron's inline sigmoid(x W_g^T): the module's own gate
    is off around its forward while the adapter is on."""
    def before(module, args):
        module.use_shared_expert_gate = not adapter.enabled

    def after(module, args, output):
        if module.use_shared_expert_gate:   # adapter off: megatron's own gate ran
            return output
        module.use_shared_expert_gate = True
        x = args[0]
        logits = F.linear(x, module.gate_weight) + adapter(x).to(x.dtype)
        return output * torch.sigmoid(logits)

    shared.register_forward_pre_hook(before)
    shared.register_forward_hook(after)


def _slices(linear_name: str, linear, config, names: tuple, kind: str,
            orders: dict) -> list[Slice]:
    """Full sizes (and row maps) of every slice of one linear (this rank's weight is a TP
    shard); `orders`: {HF projection: Megatron's row order} given by the model's builder."""
    tp = linear.tp_group.size() if kind != "replicated" else 1
    out_full, in_local = linear.weight.shape[0] * (tp if kind == "column" else 1), \
        linear.weight.shape[1]
    in_full = in_local * (tp if kind == "row" else 1)
    if linear_name == "linear_qkv":
        d, heads, groups = config.kv_channels, config.num_attention_heads, \
            config.num_query_groups
        gated = bool(getattr(config, "attention_output_gate", False))
        order = gated_query_order(heads, groups, d) if gated else None
        return [Slice("q_proj", in_full, heads * d * (2 if gated else 1), order),
                Slice("k_proj", in_full, groups * d), Slice("v_proj", in_full, groups * d)]
    if linear_name == "in_proj":
        qk = config.linear_key_head_dim * config.linear_num_key_heads
        v = config.linear_value_head_dim * config.linear_num_value_heads
        heads = config.linear_num_value_heads
        return [Slice("in_proj_qkv", in_full, 2 * qk + v, parts=(qk, qk, v)),
                Slice("in_proj_z", in_full, v), Slice("in_proj_b", in_full, heads),
                Slice("in_proj_a", in_full, heads)]
    if len(names) == 2:
        return [Slice(n, in_full, out_full // 2) for n in names]
    if names == ("gate_up_proj",):   # an expert's [gate; up] per TP rank, one adapter
        half = out_full // 2
        return [Slice("gate_up_proj", in_full, out_full, orders.get("experts.gate_up_proj"),
                      parts=(half, half))]
    return [Slice(names[0], in_full, out_full, orders.get(names[0]))]


def new_adapter(parent, name: str, kind: str, fused: list[Slice], targeted: frozenset,
                spec: LoraSpec, config, keys: dict) -> LoraAdapter:
    """A LoraAdapter for the linear `name` of `parent` (a site of `_layer_sites`), its
    matrices zero, attached to nothing (`_attach` initialises and hooks it; the Tinker
    service's per-user adapters, models.lora.tenants, route batch rows to several)."""
    linear = _linear(parent, name)
    qkv = None
    if name == "linear_qkv":
        tp = linear.tp_group.size()
        groups = config.num_query_groups // tp
        qkv = (groups, config.num_attention_heads // config.num_query_groups,
               config.kv_channels)
    return LoraAdapter(linear, kind, fused, targeted, spec, qkv, keys)


def _attach(parent, name: str, kind: str, fused: list[Slice], targeted: frozenset,
            spec: LoraSpec, key: str, config, paths: dict, keys: dict) -> LoraAdapter:
    linear = _linear(parent, name)
    adapter = new_adapter(parent, name, kind, fused, targeted, spec, config, keys)
    adapter.hf_paths = paths   # {slice: peft's module path in the layer} ({}: experts)
    if adapter.is_expert:   # models.layers.experts.grouped adds it inside its grouped matmuls
        linear.low_rank_factors = adapter.factors
    for sl in adapter.slices:
        adapter.set_full(sl.name, *init_full(spec, f"{key}.{sl.name}", sl,
                                             adapter.ranks[sl.name]))
    parent.add_module(name + ADAPTER_SUFFIX, adapter)
    if name == "router":
        adapter.wrap_gating(linear)
    elif name == "gate_weight":
        _adapt_shared_gate(parent, adapter)
    else:
        linear.register_forward_hook(adapter.hook)
    return adapter


def decoder_layer_sites(layer, spec: LoraSpec, orders: dict, layers: str,
                 hf_parents: dict) -> Iterator[tuple]:
    """(parent, linear name, kind, fused slices, targeted names, init key, {slice: HF path in
    the layer}, {slice: peft key}) of every adapter of one decoder layer."""
    config, number = layer.config, layer.layer_number - 1
    head = f"{layers}.{number}."
    for parent_name, name, kind, names, hf_parent in _SITES:
        try:
            parent = layer.get_submodule(parent_name)
        except AttributeError:
            continue
        if _linear(parent, name) is None or not set(names) & spec.targets:
            continue
        fused = _slices(name, _linear(parent, name), config, names, kind, orders)
        hf_parent = hf_parents.get(hf_parent, hf_parent)
        paths = {n: hf_parent if n == ROUTER else f"{hf_parent}.{n}" for n in names}
        keys = {n: head + path + (".weight" if n == ROUTER else "") for n, path in paths.items()}
        yield (parent, name, kind, fused, spec.targets, f"layer{number}.{parent_name}", paths,
               keys)
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    wanted = [site for site in _EXPERT_SITES if f"experts.{site[2][0]}" in spec.targets]
    if experts is None or not wanted:
        return
    if not hasattr(experts, "local_experts"):
        raise LoraUnsupportedError(
            f"model.lora.target_modules with experts needs per-expert linears (megatron's "
            f"SequentialMLP or models.layers.experts.grouped), this model computes them with "
            f"{type(experts).__name__}")
    ep_rank = experts.ep_group.rank() if experts.ep_group is not None else 0
    for j, expert in enumerate(experts.local_experts):
        global_expert = ep_rank * experts.num_local_experts + j
        for name, kind, names in wanted:
            fused = _slices(name, getattr(expert, name), config, names, kind, orders)
            yield (expert, name, kind, fused, frozenset(names),
                   f"layer{number}.expert{global_expert}", {},
                   {names[0]: f"{head}mlp.experts.{names[0]}"})


def apply_lora(chunks: list, spec: LoraSpec, orders: dict | None = None,
               layers: str = LAYERS, hf_parents: dict | None = None) -> int:
    """Freeze the base of every chunk and attach the adapters of `spec` (this rank's shards,
    initialised like peft and layout-independently). `orders`: {HF projection: tuple} where
    Megatron's rows of a projection are a permutation of HF's (Slice.order; MLA's rope rows
    with rope_interleave false, models.layers.mla.mapping.lora_row_orders). `layers`: the
    decoder layers' HF path, `hf_parents`: {SHARED_EXPERT or ROUTER_PATH: the family's HF
    path} where it differs (DeepSeek-V3's mlp.shared_experts), both for the adapters' peft
    keys and names. Returns the number of adapters."""
    count = 0
    for chunk in chunks:
        model = unwrap(chunk)
        model.requires_grad_(False)
        for layer in model.decoder.layers:
            for site in list(decoder_layer_sites(layer, spec, orders or {}, layers,
                                          hf_parents or {})):
                _attach(*site[:5], spec, site[5], layer.config, site[6], site[7])
                count += 1
        model.lora_spec = spec
    return count


def lora_spec_of(chunks: list) -> LoraSpec | None:
    """The LoraSpec the chunks were built with (None: no adapters)."""
    return getattr(unwrap(chunks[0]), "lora_spec", None) if chunks else None


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
        for _, adapter in adapters(unwrap(chunk)):
            adapter.reduce = reduce


def merged_weight(model, name: str, param: torch.Tensor) -> torch.Tensor:
    """`param` (megatron name `name` in the unwrapped chunk `model`) with its adapter merged
    in: base + scaling * B A in the local shard layout (other parameters as they are). A
    transform for models.bridge.weights.export_hf_weights. The shared expert's gate_weight
    has its adapter beside it (`gate_weight_lora`), a linear's beside the linear."""
    data = param.detach()
    if name.endswith(".gate_weight"):
        name = name[:-len(".gate_weight")] + ".gate_weight.weight"
    if not name.endswith(".weight"):
        return data
    parent_name, _, linear = name[:-len(".weight")].rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    adapter = getattr(parent, linear + ADAPTER_SUFFIX, None)
    if adapter is None:
        return data
    return (data.float() + adapter.delta()).to(data.dtype)
