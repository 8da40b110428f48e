"""Expert adapters <-> peft's `target_parameters` format (models.lora.peft handles the rest).

transformers 5 stores a MoE layer's experts fused, `model.layers.{i}.mlp.experts.gate_up_proj`
[E, 2I, H] (rows [gate; up]; gpt-oss: [E, H, 2I] with gate and up interleaved) and `down_proj`.
peft 0.21 adapts such a 3-D parameter with one `ParamWrapper` per parameter
(`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`):

- lora_A.weight [E * r, in]: expert e's A is rows e*r .. e*r + r - 1;
- lora_B.weight [out, r * E]: expert e's B is columns e, E + e, 2E + e, ... (peft reshapes
  it to [out, r, E]);
- the wrappers nest in the order peft meets the parameters, the module's registration order
  (peft's `_inject_parameters` walks `named_parameters(recurse=False)`; the order of
  target_parameters in adapter_config.json is not kept: peft saves it as a set). transformers
  registers gate_up_proj before down_proj in every fused experts module of these families, so
  with both adapted gate_up_proj is innermost: `...mlp.experts.base_layer.lora_A.weight`, and
  down_proj's is `...mlp.experts.lora_A.weight` (EXPERT_PARAMS, innermost first; an export
  writes target_parameters in the same order); with one of them adapted (peft's conversion of
  down_proj alone, or of gate_proj + up_proj alone) its wrapper is `...mlp.experts.lora_A`.

Megatron keeps one (A, B) per local expert and linear (linear_fc1: `gate_up_proj`, linear_fc2:
`down_proj`; models.lora.sites), sharded over expert TP like the expert weights and split
over EP by expert. `export_experts` gathers every expert of a layer (collective over the
expert-TP and EP groups); `load_experts` hands each rank its own experts' matrices.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterator

import torch

from models.lora.adapters import LoraAdapter, gather_cat
from models.lora.targets import EXPERT_PARAMS

PREFIX = "base_model.model."   # peft's names of every adapter tensor start with it
LAYERS = "model.layers"   # the decoder layers' HF path (a conditional-generation checkpoint's:
#                           model.language_model.layers, models.hf.conditional.peft_layers)
PARENT = "mlp.experts"


def expert_names(layer: int, param: str, layers: str = LAYERS,
                 present: tuple = EXPERT_PARAMS) -> tuple[str, str]:
    """peft's (lora_A, lora_B) names of expert parameter `param` of global layer `layer`,
    nested as EXPERT_PARAMS among the adapted parameters `present`; `layers`: the decoder
    layers' HF path."""
    nesting = sum(EXPERT_PARAMS.index(p) > EXPERT_PARAMS.index(param) for p in present)
    head = f"{PREFIX}{layers}.{layer}.{PARENT}" + ".base_layer" * nesting
    return f"{head}.lora_A.weight", f"{head}.lora_B.weight"


def pack(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's A [E, r, in] and B [E, out, r] -> peft's lora_A [E*r, in], lora_B
    [out, r*E]."""
    experts, rank, _ = a.shape
    return (a.reshape(experts * rank, -1).contiguous(),
            b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous())


def unpack(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int,
           expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s (A [r, in], B [out, r]) from peft's lora_A / lora_B of `experts`."""
    rank = lora_a.shape[0] // experts
    return (lora_a.reshape(experts, rank, -1)[expert],
            lora_b.reshape(lora_b.shape[0], rank, experts)[:, :, expert])


def _param_of(adapter: LoraAdapter) -> str:
    return adapter.slices[0].name


def layer_experts(model, layers) -> Iterator[tuple[int, str, list, object, tuple]]:
    """(global layer, expert parameter, [(global expert, adapter)] of this rank, the layer's
    experts module, the layer's adapted expert parameters) of every expert adapter of one
    unwrapped chunk, layer by layer."""
    found = defaultdict(list)
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter) and module.is_expert:
            parts = name.split(".")   # decoder.layers.{l}.mlp.experts.local_experts.{j}.X
            experts = model.get_submodule(".".join(parts[:5]))
            ep_rank = experts.ep_group.rank() if experts.ep_group is not None else 0
            expert = ep_rank * experts.num_local_experts + int(parts[6])
            found[(int(parts[2]), _param_of(module))].append((expert, module, experts))
    for (local, param), items in sorted(found.items()):
        present = tuple(p for p in EXPERT_PARAMS if (local, p) in found)
        yield (layers[local].layer_number - 1, param, [(e, a) for e, a, _ in sorted(
            items, key=lambda t: t[0])], items[0][2], present)


def _ep_gather(tensor: torch.Tensor, experts_module) -> torch.Tensor:
    """[E_local, ...] of every EP rank concatenated in EP-rank order: [E, ...]."""
    group = experts_module.ep_group
    return gather_cat(tensor, 0, group, group.size() if group is not None else 1)


def export_experts(model, layers: str = LAYERS) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of every expert adapter of one unwrapped chunk, in
    EXPERT_PARAMS' naming. Collective over each layer's expert-TP and EP groups."""
    for layer, param, items, experts, present in layer_experts(model, model.decoder.layers):
        full = [adapter.full_matrices(param) for _, adapter in items]
        a = _ep_gather(torch.stack([f[0] for f in full]), experts)
        b = _ep_gather(torch.stack([f[1] for f in full]), experts)
        lora_a, lora_b = pack(a, b)
        name_a, name_b = expert_names(layer, param, layers, present)
        yield name_a, lora_a
        yield name_b, lora_b


def load_experts(model, stored: dict, layers: str = LAYERS) -> tuple[set, int]:
    """Copy this rank's experts' matrices from peft's tensors `stored` into the expert
    adapters of one unwrapped chunk. Returns (the names used, the number of adapters filled);
    raises KeyError naming a missing tensor."""
    used, filled = set(), 0
    for layer, param, items, experts, present in layer_experts(model, model.decoder.layers):
        name_a, name_b = expert_names(layer, param, layers, present)
        for name in (name_a, name_b):
            if name not in stored:
                raise KeyError(name)
        total = experts.num_local_experts * (experts.ep_group.size()
                                             if experts.ep_group is not None else 1)
        for expert, adapter in items:
            adapter.set_full(param, *unpack(stored[name_a], stored[name_b], total, expert))
            filled += 1
        used |= {name_a, name_b}
    return used, filled
