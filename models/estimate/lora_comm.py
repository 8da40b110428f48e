"""LoRA in the communication plan (models.estimate.comm, kind tp_sp): the adapters' own
tensor-parallel traffic and what the frozen base no longer moves. Plain arithmetic on an HF
config; bytes handed to collectives as models.estimate.comm defines them.

Per adapter (models.estimate.lora.Site, rank r) and micro-batch, tp > 1, t tokens per CP rank,
a bytes per activation element, as models.lora.adapters communicates:

- column (A replicated): with sequence parallelism the all-gather of the rank-r product
  A x_shard, t r a / tp (forward), and the reduce-scatter of its gradient, t r a (backward);
  without it the all-reduce of that gradient, t r a (backward);
- row (B replicated): with sequence parallelism the reduce-scatter of the partial product, t r a
  (forward), and the all-gather of its gradient, t r a / tp (backward); without it the
  all-reduce of the partial product, t r a (forward);
- expert adapters (expert TP = tp; the dispatcher moves their activations): the all-reduce of
  the replicated factor's gradient per local expert, r x in (gate_up_proj's A) or out x r
  (down_proj's B) elements x a (backward);
- replicated adapters (MLA's down projections, routers, the shared expert gate): none.

Full recomputation repeats the forward ones. Once per step with sequence parallelism megatron's
finalize_model_grads all-reduces over TP the gradients of the adapter matrices that saw only
this rank's sequence shard: the column adapters' A, the row adapters' B and the replicated
adapters (`sp_adapter_parameters`, times the gradient bytes).

The frozen base (`frozen_savings`, with sequence parallelism): a column-parallel linear whose
weight needs no gradient does not all-gather its input again in backward (megatron's
linear_with_frozen_weight), which full fine-tuning's formula counts: t x in x a / tp per linear
(linear_qkv and linear_fc1: h; the shared expert's linear_fc1: h; Gated DeltaNet's in_proj: h;
MLA's up projections: their latents, or h for q_proj). On the first pipeline stage the
embedding's output needs no gradient, so its backward all-gather (t h a / tp) does not run,
and neither does the input-gradient reduction of the first layer's column-parallel mixer
linear (t h a: its reduce-scatter, or all-reduce without sequence parallelism; MLA's first
layer reads the hidden state through replicated down projections, which reduce nothing). A
Gated DeltaNet layer's frozen output norm reduces no gradient. Measured on CPU
(tests/test_comm_plan.py): a dense model at TP2 with and without sequence parallelism.
"""
from __future__ import annotations

from typing import Any

from models.estimate.lora import Site, layer_sites
from models.families.base import field
from models.families.registry import family_of, moe_family
from models.layers.gated_delta_net import costs as gdn_costs


def _sites(hf: Any, lora, layout, stage: int, layers: int) -> list[Site]:
    span = range(stage * layers, (stage + 1) * layers)
    return [s for i in span for s in layer_sites(hf, i, lora.targets, lora, layout.ep)]


def adapter_bytes(hf: Any, lora, layout, t: float, a: int, stage: int, layers: int,
                  full_recompute: bool) -> float:
    """Bytes the adapters of pipeline stage `stage` (`layers` layers) hand to TP collectives
    in one micro-batch of `t` tokens per CP rank (module docstring); 0 at tp 1."""
    tp, sp = layout.tp, layout.sequence_parallel
    if tp == 1:
        return 0.0
    total = 0.0
    for s in _sites(hf, lora, layout, stage, layers):
        if s.expert:
            total += s.copies * s.rank * (s.inp if s.kind == "expert_column" else s.out) * a
            continue
        if s.kind == "replicated":
            continue
        forward = (t * s.rank * a / tp if s.kind == "column" else t * s.rank * a) if sp else \
            (0.0 if s.kind == "column" else t * s.rank * a)
        backward = (t * s.rank * a if s.kind == "column" else t * s.rank * a / tp) if sp else \
            (t * s.rank * a if s.kind == "column" else 0.0)
        total += forward * (2 if full_recompute else 1) + backward
    return total


def sp_adapter_parameters(hf: Any, lora, layout, stage: int, layers: int) -> int:
    """Adapter parameters of one TP rank whose gradients are summed over TP once per step
    (sequence parallelism, tp > 1; else 0): column A, row B, the replicated adapters."""
    if layout.tp == 1 or not layout.sequence_parallel:
        return 0
    matrix = {"column": lambda s: s.rank * s.inp, "row": lambda s: s.rank * s.out,
              "replicated": lambda s: s.rank * (s.inp + s.out)}
    return sum(matrix[s.kind](s) for s in _sites(hf, lora, layout, stage, layers)
               if s.kind in matrix)


def _column_inputs(hf: Any, layer: int) -> int:
    """Input width summed over the TP-sharded column-parallel linears of decoder layer
    `layer` that all-gather it under sequence parallelism (not the routed experts)."""
    h = field(hf, "hidden_size")
    if family_of(hf).mixer_of(hf, layer) == "mla":
        q_rank = field(hf, "q_lora_rank")
        mixer = (h if q_rank is None else q_rank) + field(hf, "kv_lora_rank")
    else:
        mixer = h
    moe = moe_family(hf)
    if moe is not None and moe.is_moe_layer(hf, layer):
        return mixer + (h if moe.shared_expert_width(hf) else 0)
    return mixer + h


def frozen_savings(hf: Any, layout, t: float, a: int, stage: int, layers: int) -> float:
    """Bytes per micro-batch full fine-tuning's tp_sp formula counts that the frozen base of a
    LoRA run does not move (module docstring); 0 at tp 1."""
    tp = layout.tp
    if tp == 1:
        return 0.0
    span = range(stage * layers, (stage + 1) * layers)
    saved = 0.0
    if gdn_costs.uses_gdn(hf):   # the output norm's gradient, with or without SP
        saved += sum(gdn_costs.is_gdn_layer(hf, i) for i in span) * \
            gdn_costs.gdn_norm_width(hf) * a
    h = field(hf, "hidden_size")
    if stage == 0 and family_of(hf).mixer_of(hf, 0) != "mla":   # the first layer's input
        saved += t * h * a
    if not layout.sequence_parallel:
        return saved
    saved += sum(t * _column_inputs(hf, i) * a / tp for i in span)
    return saved + (t * h * a / tp if stage == 0 else 0.0)
