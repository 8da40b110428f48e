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
the same adapters on the HF model. `layer_sites` lists a layer's adapters with their shapes
(`Site`), which the counts sum and the communication plan reads (models.estimate.lora_comm).
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


@dataclass(frozen=True)
class Site:
    """One adapter (an (A, B) pair of one slice) of a decoder layer: `kind` "column" (A [r,
    inp] replicated, B [out / tp, r]), "row" (A [r, inp / tp], B [out, r] replicated),
    "replicated" (both whole), "expert_column" / "expert_row" (the same per local expert,
    `copies` of them); full (unsharded) `inp` / `out` features and the rank."""

    kind: str
    inp: int
    out: int
    rank: int
    copies: int = 1

    @property
    def expert(self) -> bool:
        return self.kind.startswith("expert_")

    def params(self, tp: int) -> int:
        """Parameters one TP rank holds."""
        r, split = self.rank, self.kind.removeprefix("expert_")
        n = r * (self.inp // tp if split == "row" else self.inp) + \
            r * (self.out // tp if split == "column" else self.out)
        return n * self.copies


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


def _mixer(hf: Any, layer: int, targets: frozenset, r: _Ranks) -> list[Site]:
    """The adapters of the sequence mixer of decoder layer `layer`."""
    h = field(hf, "hidden_size")
    mixer = family_of(hf).mixer_of(hf, layer)
    if mixer == "mla":
        return _mla(hf, layer, targets, r)
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
    rank = lambda n: r(layer, f"{parent}.{n}")
    sites = [Site("column", h, out, rank(n)) for n, out in column.items() if n in targets]
    return sites + ([Site("row", rows[1], h, rank(rows[0]))] if rows[0] in targets else [])


def _mla(hf: Any, layer: int, targets: frozenset, r: _Ranks) -> list[Site]:
    """The adapters of an MLA layer: (in, out, kind) per name."""
    h, heads = field(hf, "hidden_size"), field(hf, "num_attention_heads")
    q_rank, kv_rank = field(hf, "q_lora_rank"), field(hf, "kv_lora_rank")
    qk = field(hf, "qk_nope_head_dim") + field(hf, "qk_rope_head_dim")
    shapes = {"q_proj": (h, heads * qk, "column"),
              "kv_a_proj_with_mqa": (h, kv_rank + field(hf, "qk_rope_head_dim"), "replicated"),
              "kv_b_proj": (kv_rank, heads * (field(hf, "qk_nope_head_dim")
                                              + field(hf, "v_head_dim")), "column"),
              "o_proj": (heads * field(hf, "v_head_dim"), h, "row")}
    if q_rank is not None:   # q_a_proj / q_b_proj instead of q_proj
        del shapes["q_proj"]
        shapes.update(q_a_proj=(h, q_rank, "replicated"), q_b_proj=(q_rank, heads * qk, "column"))
    return [Site(kind, i, o, r(layer, f"self_attn.{name}"))
            for name, (i, o, kind) in shapes.items() if name in targets]


def _mlp(ffn: int, h: int, targets: frozenset, rank) -> list[Site]:
    """The adapters of a gate/up/down MLP of width `ffn`; `rank(name)`."""
    sites = [Site("column", h, ffn, rank(n)) for n in ("gate_proj", "up_proj") if n in targets]
    return sites + ([Site("row", ffn, h, rank("down_proj"))] if "down_proj" in targets else [])


def layer_sites(hf: Any, layer: int, targets: frozenset, rank, ep: int = 1) -> list[Site]:
    """The adapters of decoder layer `layer` on one EP rank (module docstring; `targets`
    resolved, `rank` an int or a LoraSpec)."""
    r, targets = (rank if isinstance(rank, _Ranks) else _Ranks(hf, rank)), _resolved(targets)
    h = field(hf, "hidden_size")
    sites = _mixer(hf, layer, targets, r)
    moe = moe_family(hf)
    if moe is None or not moe.is_moe_layer(hf, layer):
        return sites + _mlp(field(hf, "intermediate_size"), h, targets,
                            lambda n: r(layer, f"mlp.{n}"))
    paths = family_of(hf).lora_hf_paths
    shared = paths.get("mlp.shared_expert", "mlp.shared_expert")
    width = moe.shared_expert_width(hf)
    sites += _mlp(width, h, targets, lambda n: r(layer, f"{shared}.{n}")) if width else []
    if SHARED_GATE in targets and SHARED_GATE in family_of(hf).lora_targets:
        sites.append(Site("replicated", h, 1, r(layer, f"mlp.{SHARED_GATE}")))
    if ROUTER in targets:
        sites.append(Site("replicated", h, moe.num_experts(hf),
                          r(layer, paths.get("mlp.gate", "mlp.gate") + ".weight")))
    width, local = moe.expert_width(hf), moe.num_experts(hf) // ep
    gate_up, down = EXPERT_TARGETS
    if gate_up in targets:
        sites.append(Site("expert_column", h, 2 * width, r(layer, f"mlp.{gate_up}"), local))
    if down in targets:
        sites.append(Site("expert_row", width, h, r(layer, f"mlp.{down}"), local))
    return sites


def _resolved(targets: frozenset) -> frozenset:
    """`targets` with the word `experts` as both expert parameters (models.lora.targets)."""
    return frozenset(targets) | (frozenset(EXPERT_TARGETS) if "experts" in targets else
                                 frozenset())


def stage_adapters(hf: Any, targets: frozenset, rank, tp: int, pp: int, ep: int,
                   stage: int) -> tuple[int, int]:
    """(adapter parameters, of which the experts') of one TP (x EP) rank of pipeline stage
    `stage` (layers // pp layers each); `rank`: an int or a LoraSpec (module docstring)."""
    per_stage = field(hf, "num_hidden_layers") // pp
    r = _Ranks(hf, rank)
    sites = [site for i in range(stage * per_stage, (stage + 1) * per_stage)
             for site in layer_sites(hf, i, targets, r, ep)]
    return (sum(s.params(tp) for s in sites),
            sum(s.params(tp) for s in sites if s.expert))


def adapter_parameters(hf: Any, targets: frozenset, rank, tp: int, pp: int,
                       ep: int = 1) -> AdapterParams:
    """Adapter counts of `targets` (resolved targets, models.lora.targets) at rank `rank` (an
    int, or a LoraSpec for per-module ranks) for one rank of the layout tp x pp (x ep); each
    stage holds layers // pp layers."""
    whole = stage_adapters(hf, targets, rank, 1, 1, 1, 0)[0]
    first = stage_adapters(hf, targets, rank, tp, pp, ep, 0)
    last = stage_adapters(hf, targets, rank, tp, pp, ep, pp - 1)
    return AdapterParams(whole, first[0], last[0], first[1], last[1])
