"""HF <-> Megatron mapping of the Qwen3.5 weights the generic map (models.bridge.weights) lacks: the
Gated DeltaNet layer (models.layers.gated_delta_net.module), the gated full-attention q_proj and the MoE
shared expert.

Kinds (TP rank r of tp; `parts` = chunk(tp)[r] of each HF piece along dim 0):
  gdn_in     in_proj_qkv [2*Dk+Dv, H] (q; k; v rows), in_proj_z / b / a -> [q_r; k_r; v_r; z_r;
             b_r; a_r] (megatron GatedDeltaNet's in_proj layout per rank)
  gdn_conv   conv1d.weight [2*Dk+Dv, 1, K] -> [q_r; k_r; v_r]
  gdn_heads  A_log / dt_bias [nv] -> chunk r
  qkv_gated  q_proj [h*2d, H] (per head: query rows then gate rows), k_proj, v_proj -> per
             query group [queries; gates; key; value] (megatron attention_output_gate), rows
             split over TP like the plain fused qkv
"""
from __future__ import annotations

import torch

HYBRID_KINDS = ("gdn_in", "gdn_conv", "gdn_heads", "qkv_gated")
_GDN = {
    "self_attention.in_proj.weight": (
        "gdn_in", ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                   "in_proj_a.weight")),
    "self_attention.conv1d.weight": ("gdn_conv", ("conv1d.weight",)),
    "self_attention.A_log": ("gdn_heads", ("A_log",)),
    "self_attention.dt_bias": ("gdn_heads", ("dt_bias",)),
    "self_attention.out_norm.weight": ("replicated", ("norm.weight",)),
    "self_attention.out_proj.weight": ("row", ("out_proj.weight",)),
}
_SHARED = {
    "mlp.shared_experts.linear_fc1.weight": (
        "fc1", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}


def hybrid_mapping(suffix: str, layer: int, config) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a megatron per-layer suffix of a Qwen3.5 layer, or None (generic
    map). `config`: the chunk's TransformerConfig (attention_output_gate marks Qwen3.5)."""
    if not getattr(config, "attention_output_gate", False):
        return None
    head = f"model.layers.{layer}."
    if suffix in _GDN:
        kind, names = _GDN[suffix]
        return kind, tuple(f"{head}linear_attn.{n}" for n in names)
    if suffix in _SHARED:
        kind, names = _SHARED[suffix]
        return kind, tuple(head + n for n in names)
    if suffix == "self_attention.linear_qkv.weight":
        return "qkv_gated", tuple(f"{head}self_attn.{p}_proj.weight" for p in "qkv")
    return None


def _gdn_sizes(cfg: dict) -> tuple[int, int]:
    qk = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    return qk, cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]


def _merge_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: dict) -> torch.Tensor:
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = k.shape[0] // groups
    rest = q.shape[1:]
    pairs = q.reshape(heads, 2, d, *rest)
    query = pairs[:, 0].reshape(groups, heads // groups * d, *rest)
    gate = pairs[:, 1].reshape(groups, heads // groups * d, *rest)
    fused = torch.cat([query, gate, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                      dim=1)
    return fused.reshape(-1, *rest)


def _split_gated(fused: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per = heads // groups
    rest = fused.shape[1:]
    d = fused.shape[0] // (groups * (2 * per + 2))
    grouped = fused.reshape(groups, (2 * per + 2) * d, *rest)
    query, gate, k, v = torch.split(grouped, [per * d, per * d, d, d], dim=1)
    pairs = torch.stack([query.reshape(heads, d, *rest), gate.reshape(heads, d, *rest)], dim=1)
    return [pairs.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous()]


def hybrid_local_shard(kind: str, hf: list[torch.Tensor], cfg: dict, tp: int,
                       rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of the HF tensors `hf` (in the order hybrid_mapping names)."""
    if kind == "qkv_gated":
        return _merge_gated(*hf, cfg).chunk(tp, dim=0)[rank]
    if kind == "gdn_heads":
        return hf[0].chunk(tp, dim=0)[rank]
    qk, vv = _gdn_sizes(cfg)
    pieces = list(torch.split(hf[0], [qk, qk, vv], dim=0))
    if kind == "gdn_in":
        pieces += hf[1:]
    return torch.cat([p.chunk(tp, dim=0)[rank] for p in pieces], dim=0)


def hybrid_export(kind: str, shards: list[torch.Tensor], cfg: dict) -> list[torch.Tensor]:
    """Full HF tensors (in hybrid_mapping's order) from every TP rank's shard (rank order)."""
    if kind == "qkv_gated":
        return _split_gated(torch.cat(shards, dim=0), cfg)
    if kind == "gdn_heads":
        return [torch.cat(shards, dim=0)]
    tp = len(shards)
    qk, vv = _gdn_sizes(cfg)
    sizes = [qk // tp, qk // tp, vv // tp]
    if kind == "gdn_in":
        heads = cfg["linear_num_value_heads"] // tp
        sizes += [vv // tp, heads, heads]
    parts = [torch.split(s, sizes, dim=0) for s in shards]
    full = [torch.cat([p[i] for p in parts], dim=0) for i in range(len(sizes))]
    qkv = torch.cat(full[:3], dim=0).contiguous()
    return [qkv] + [t.contiguous() for t in full[3:]]

