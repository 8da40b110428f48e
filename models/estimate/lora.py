"""LoRA adapter parameter counts per pipeline stage and TP rank, from an HF config (dict or
transformers object), the target names and the rank. Plain arithmetic (no torch, megatron or
transformers), for the memory estimate of `--validate` (models.estimate.lora_memory).

Per decoder layer, r the rank, h the hidden size, tp the tensor-parallel size, as
models.lora.adapters / models.lora.sites shard them:

- q_proj, k_proj, v_proj (column-parallel, linear_qkv): each slice A [r, h] replicated on every
  TP rank, B [out / tp, r] (out: heads x head_dim, twice that for the gated attention's
  q_proj, or kv heads x head_dim);
- o_proj (row-parallel): A [r, heads x head_dim / tp], B [h, r] replicated;
- Gated DeltaNet layers (Qwen3.5; they have no q/k/v/o_proj): in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a (column, in_proj) A [r, h] each, B [(2 Dk + Dv) / tp, r], [Dv / tp, r],
  [nv / tp, r] twice (Dk, Dv: key and value widths, nv value heads); out_proj (row) A
  [r, Dv / tp], B [h, r];
- MLA layers (DeepSeek-V3 family): q_a_proj and kv_a_proj_with_mqa (replicated down
  projections) A [r, h], B [q_lora_rank or kv_lora_rank + rope dim, r] whole on every rank;
  q_b_proj / kv_b_proj (column) A [r, q_lora_rank or kv_lora_rank], B [heads x (nope + rope)
  / tp or heads x (nope + v) / tp, r]; q_proj (column, q_lora_rank null) A [r, h]; o_proj
  (row) A [r, heads x v / tp], B [h, r];
- gate_proj, up_proj (column, linear_fc1 of a dense-MLP layer): A [r, h] each, B [ffn / tp, r];
- down_proj (row, linear_fc2 of a dense-MLP layer): A [r, ffn / tp], B [h, r];
  on a MoE layer gate/up/down adapt the shared expert (width Family.shared_expert_width)
  where the resolved targets hold them (peft reads them as modules there: Qwen3.5-MoE,
  Kimi-K2), else nothing;
- experts.gate_up_proj / experts.down_proj (each of the num_experts / ep local experts of a
  MoE layer, expert TP = tp), peft's target_parameters format: gate_up_proj A [r, h] and
  B [2 moe_ffn / tp, r], down_proj A [r, moe_ffn / tp] and B [h, r];
- router (a MoE layer's router weight, replicated): A [r, h], B [E, r]; shared_expert_gate
  (Qwen3.5-MoE's sigmoid gate of the shared expert, replicated): A [r, h], B [1, r].

r is the rank of each adapter's peft key (`rank`: an int, or a models.lora.slices.LoraSpec
whose rank_pattern gives per-module ranks, as peft's conversion doubles gate_up_proj's).
`total` counts the whole model unsharded: what peft's print_trainable_parameters reports for
the same adapters on the HF model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.families.base import field, head_dim, original_config
from models.families.registry import family_of, moe_family
from models.lora.targets import EXPERT_TARGETS, ROUTER, SHARED_GATE


@dataclass(frozen=True)
class AdapterParams:
    """Adapter parameters of one TP (x EP) rank of the first and the last pipeline stage."""

    total: int           # whole model, unsharded (peft's count)
    first_stage: int     # experts' adapters included
    last_stage: int
    expert_first: int    # the experts' adapters among them (0: none)
    expert_last: int


class _Ranks:
    """The rank of HF path `path` (in the layer) of decoder layer `layer`: `rank` as an int,
    or a LoraSpec's rank_of its peft key."""

    def __init__(self, hf: Any, rank):
        self.rank = rank
        # peft's decoder layers path (models.hf.conditional.peft_layers)
        self.layers = "model.language_model.layers" if original_config(hf) else "model.layers"

    def __call__(self, layer: int, path: str) -> int:
        if isinstance(self.rank, int):
            return self.rank
        return self.rank.rank_of(f"{self.layers}.{layer}.{path}")


def _mixer(hf: Any, layer: int, targets: frozenset, r: _Ranks, tp: int) -> int:
    """Adapter parameters of one rank in the sequence mixer of decoder layer `layer`."""
    h = field(hf, "hidden_size")
    mixer = family_of(hf).mixer_of(hf, layer)
    if mixer == "mla":
        return _mla(hf, layer, targets, r, tp)
    parent = "self_attn"
    if mixer == "gated_delta_net":
        qk = field(hf, "linear_key_head_dim") * field(hf, "linear_num_key_heads")
        nv = field(hf, "linear_num_value_heads")
        v = field(hf, "linear_value_head_dim") * nv
        column = {"in_proj_qkv": 2 * qk + v, "in_proj_z": v, "in_proj_b": nv, "in_proj_a": nv}
        rows, parent = ("out_proj", v), "linear_attn"
    else:
        heads = field(hf, "num_attention_heads")
        hd = head_dim(hf)
        q, kv = heads * hd, field(hf, "num_key_value_heads", heads) * hd
        gate = 2 if mixer == "gated_attention" else 1
        column = {"q_proj": gate * q, "k_proj": kv, "v_proj": kv}
        rows = ("o_proj", q)
    rank = {n: r(layer, f"{parent}.{n}") for n in (*column, rows[0])}
    body = sum(rank[n] * h + rank[n] * out // tp for n, out in column.items() if n in targets)
    o = rank[rows[0]]
    return body + (o * rows[1] // tp + o * h if rows[0] in targets else 0)


def _mla(hf: Any, layer: int, targets: frozenset, r: _Ranks, tp: int) -> int:
    """Adapter parameters of one rank in an MLA layer: (in, out, split over TP) per name."""
    h, heads = field(hf, "hidden_size"), field(hf, "num_attention_heads")
    q_rank, kv_rank = field(hf, "q_lora_rank"), field(hf, "kv_lora_rank")
    qk = field(hf, "qk_nope_head_dim") + field(hf, "qk_rope_head_dim")
    shapes = {"q_proj": (h, heads * qk, "column"),
              "kv_a_proj_with_mqa": (h, kv_rank + field(hf, "qk_rope_head_dim"), None),
              "kv_b_proj": (kv_rank, heads * (field(hf, "qk_nope_head_dim")
                                              + field(hf, "v_head_dim")), "column"),
              "o_proj": (heads * field(hf, "v_head_dim"), h, "row")}
    if q_rank is not None:   # q_a_proj / q_b_proj instead of q_proj
        del shapes["q_proj"]
        shapes.update(q_a_proj=(h, q_rank, None), q_b_proj=(q_rank, heads * qk, "column"))
    return sum(r(layer, f"self_attn.{name}") * ((i // tp if split == "row" else i)
                                                + (o // tp if split == "column" else o))
               for name, (i, o, split) in shapes.items() if name in targets)


def _mlp(ffn: int, h: int, targets: frozenset, rank, tp: int) -> int:
    """Adapter parameters of one rank in a gate/up/down MLP of width `ffn`; `rank(name)`."""
    body = sum(rank(n) * (h + ffn // tp) for n in ("gate_proj", "up_proj") if n in targets)
    return body + (rank("down_proj") * (ffn // tp + h) if "down_proj" in targets else 0)


def _layer(hf: Any, layer: int, targets: frozenset, r: _Ranks, tp: int,
           ep: int) -> tuple[int, int]:
    """(adapter parameters, of which the experts') of one rank in decoder layer `layer`."""
    h = field(hf, "hidden_size")
    body = _mixer(hf, layer, targets, r, tp)
    moe = moe_family(hf)
    sparse = moe is not None and moe.is_moe_layer(hf, layer)
    if not sparse:
        return body + _mlp(field(hf, "intermediate_size"), h, targets,
                           lambda n: r(layer, f"mlp.{n}"), tp), 0
    paths = family_of(hf).lora_hf_paths
    shared = paths.get("mlp.shared_expert", "mlp.shared_expert")
    width = moe.shared_expert_width(hf)
    body += _mlp(width, h, targets, lambda n: r(layer, f"{shared}.{n}"), tp) if width else 0
    if SHARED_GATE in targets and SHARED_GATE in family_of(hf).lora_targets:
        body += r(layer, f"mlp.{SHARED_GATE}") * (h + 1)   # replicated A [r, h], B [1, r]
    if ROUTER in targets:
        body += r(layer, paths.get("mlp.gate", "mlp.gate") + ".weight") * (
            h + moe.num_experts(hf))
    width = moe.expert_width(hf)
    gate_up, down = (r(layer, f"mlp.{t}") if t in targets else 0 for t in EXPERT_TARGETS)
    per_expert = gate_up * (h + 2 * width // tp) + down * (width // tp + h)
    experts = moe.num_experts(hf) // ep * per_expert
    return body + experts, experts


def _resolved(targets: frozenset) -> frozenset:
    """`targets` with the word `experts` as both expert parameters (models.lora.targets)."""
    return frozenset(targets) | (frozenset(EXPERT_TARGETS) if "experts" in targets else
                                 frozenset())


def stage_adapters(hf: Any, targets: frozenset, rank, tp: int, pp: int, ep: int,
                   stage: int) -> tuple[int, int]:
    """(adapter parameters, of which the experts') of one TP (x EP) rank of pipeline stage
    `stage` (layers // pp layers each); `rank`: an int or a LoraSpec (module docstring)."""
    per_stage = field(hf, "num_hidden_layers") // pp
    r, targets = _Ranks(hf, rank), _resolved(targets)
    rows = [_layer(hf, i, targets, r, tp, ep)
            for i in range(stage * per_stage, (stage + 1) * per_stage)]
    return sum(a for a, _ in rows), sum(e for _, e in rows)


def adapter_parameters(hf: Any, targets: frozenset, rank, tp: int, pp: int,
                       ep: int = 1) -> AdapterParams:
    """Adapter counts of `targets` (resolved targets, models.lora.targets) at rank `rank` (an
    int, or a LoraSpec for per-module ranks) for one rank of the layout tp x pp (x ep); each
    stage holds layers // pp layers."""
    whole = stage_adapters(hf, targets, rank, 1, 1, 1, 0)[0]
    first = stage_adapters(hf, targets, rank, tp, pp, ep, 0)
    last = stage_adapters(hf, targets, rank, tp, pp, ep, pp - 1)
    return AdapterParams(whole, first[0], last[0], first[1], last[1])
