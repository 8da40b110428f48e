"""HF <-> Megatron mapping of multi-latent attention weights (DeepSeek-V3 family; the attention
module is models.layers.mla.module).

Megatron MLASelfAttention parameter (per layer)  <-  HF DeepseekV3Attention tensor:
  linear_q_down_proj.weight  [q_lora_rank, H]           q_a_proj.weight         (replicated)
  q_layernorm.weight         [q_lora_rank]              q_a_layernorm.weight    (replicated)
  linear_q_up_proj.weight    [n*(dn+dr), q_lora_rank]   q_b_proj.weight         (mla_q)
  linear_q_proj.weight       [n*(dn+dr), H]             q_proj.weight           (mla_q; q_lora_rank null)
  linear_kv_down_proj.weight [kv_lora_rank+dr, H]       kv_a_proj_with_mqa.weight (mla_kv_down)
  kv_layernorm.weight        [kv_lora_rank]             kv_a_layernorm.weight   (replicated)
  linear_kv_up_proj.weight   [n*(dn+dv), kv_lora_rank]  kv_b_proj.weight        (column)
  linear_proj.weight         [H, n*dv]                  o_proj.weight           (row; models.bridge.weights)
(dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, n heads). Every layout is the same as
HF's. The down projections are replicated on every TP rank (models.layers.mla.module: megatron's duplicated
linear); the up projections are column-parallel: rank r holds rows chunk(tp)[r], whole heads.

RoPE pairs: megatron's MLA rotates pairs (2i, 2i+1) of the rope dims, as HF with
`rope_interleave` true (the checkpoints' default): weights are copied as they are. With
rope_interleave false HF rotates pairs (i, i + dr/2); the rope rows are then permuted on load
(megatron row 2i = HF row i, row 2i+1 = HF row i + dr/2: megatron's de-interleaving then
restores HF's order, so every product is the same) and permuted back on export (bitwise).
"""
from __future__ import annotations

import torch

MLA_KINDS = ("column", "mla_q", "mla_kv_down")
_ATTENTION = {
    "self_attention.linear_q_down_proj.weight": ("replicated", "q_a_proj.weight"),
    "self_attention.q_layernorm.weight": ("replicated", "q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": ("mla_q", "q_b_proj.weight"),
    "self_attention.linear_q_proj.weight": ("mla_q", "q_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": ("mla_kv_down", "kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": ("replicated", "kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": ("column", "kv_b_proj.weight"),
}
HF_ATTENTION_TENSORS = tuple(f"self_attn.{n}" for _, n in _ATTENTION.values())


def mla_mapping(suffix: str, layer: int, config) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of a megatron per-layer suffix of an MLA layer, or None (generic map).
    `config`: the chunk's TransformerConfig (multi_latent_attention marks MLA)."""
    if not getattr(config, "multi_latent_attention", False) or suffix not in _ATTENTION:
        return None
    kind, name = _ATTENTION[suffix]
    return kind, (f"model.layers.{layer}.self_attn.{name}",)


def rope_order(rope_dim: int, interleaved: bool) -> torch.Tensor:
    """Megatron row j of the rope block holds HF row order[j] (identity when interleaved)."""
    if interleaved:
        return torch.arange(rope_dim)
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_rope(t: torch.Tensor, cfg: dict, inverse: bool, per_head: bool) -> torch.Tensor:
    """Rows of the rope block(s) reordered (HF -> megatron; `inverse`: back)."""
    rope = int(cfg["qk_rope_head_dim"])
    interleaved = cfg.get("rope_interleave", True) is not False
    if interleaved:
        return t
    order = rope_order(rope, False)
    if inverse:
        order = torch.argsort(order)
    if per_head:
        block = int(cfg["qk_nope_head_dim"]) + rope
        heads = t.reshape(-1, block, *t.shape[1:])
        nope, rot = heads[:, :block - rope], heads[:, block - rope:]
        return torch.cat([nope, rot[:, order]], dim=1).reshape(t.shape).contiguous()
    latent = t.shape[0] - rope
    return torch.cat([t[:latent], t[latent:][order]], dim=0).contiguous()


def lora_row_orders(cfg: dict) -> dict:
    """{HF projection: Megatron's rows as HF rows} of the MLA projections whose rows differ
    (models.lora.adapters.Slice.order): with rope_interleave false the rope rows of q_b_proj /
    q_proj (per head) and of kv_a_proj_with_mqa (after the latent), as `_permute_rope` moves
    the weights; {} when HF and Megatron agree (rope_interleave true, or not MLA)."""
    if "kv_lora_rank" not in cfg or cfg.get("rope_interleave", True) is not False:
        return {}
    rows = lambda n: torch.arange(n, dtype=torch.float64)[:, None]
    heads = int(cfg["num_attention_heads"])
    per_head = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    q = _permute_rope(rows(heads * per_head), cfg, inverse=False, per_head=True)
    kv = _permute_rope(rows(int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])), cfg,
                       inverse=False, per_head=False)
    order = lambda t: tuple(int(x) for x in t[:, 0].tolist())
    return {"q_b_proj": order(q), "q_proj": order(q), "kv_a_proj_with_mqa": order(kv)}


def mla_local_shard(kind: str, hf: list[torch.Tensor], cfg: dict, tp: int,
                    rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of the HF tensor `hf[0]` (mla_kv_down: the whole tensor)."""
    full = hf[0]
    if kind == "mla_kv_down":
        return _permute_rope(full, cfg, inverse=False, per_head=False)
    if kind == "mla_q":
        full = _permute_rope(full, cfg, inverse=False, per_head=True)
    return full.chunk(tp, dim=0)[rank]


def mla_export(kind: str, local: torch.Tensor, cfg: dict, gather) -> list[torch.Tensor]:
    """The full HF tensor from this rank's `local` tensor; `gather(local, dim)` returns every
    TP rank's shard (rank order; a collective over the TP group, not called for mla_kv_down)."""
    if kind == "mla_kv_down":
        return [_permute_rope(local, cfg, inverse=True, per_head=False)]
    full = torch.cat(gather(local, 0), dim=0)
    if kind == "mla_q":
        full = _permute_rope(full, cfg, inverse=True, per_head=True)
    return [full.contiguous()]
