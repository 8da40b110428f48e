"""RoPE on packed ("thd") rows by a gather of each token's angles: no device-to-host copy.

Megatron's unfused thd RoPE (megatron-core 0.16 `rope_utils._apply_rotary_pos_emb_thd`, what its
attention runs without Transformer Engine) reads the sequence lengths back from the device
(`.tolist()`; and per sequence `cu_seqlens[i].item()` when the angle table covers the whole row),
splits the tokens per sequence, slices each one's angles and concatenates them: a host sync for
queries and another for keys, in every layer of every micro-batch. `apply_thd` computes the same
angles for every token on the device instead (`thd_angle_index`: a searchsorted over the
boundaries) and applies them with megatron's own rotation, so the result is the same tensor,
bitwise; `install()` puts it in megatron's place (idempotent). The gathered cos/sin rows are
computed once per micro-batch and shared by every layer's queries and keys
(models.layers.attention.rope_tables).

Token t of sequence i (full length L_i, boundaries cu_seqlens of the full row; this CP rank holds
L_i / cp of its tokens, o = t's offset among them) takes the angles of position
  cp = 1: o;
  cp > 1: megatron's zigzag chunks r and 2cp-1-r of size s = L_i / (2cp):
          r*s + o for o < s, else cp*(L_i/cp) - (r+1)*s + (o - s);
plus cu_seqlens[i] when the table covers the whole row (freqs.size(0) == the row's length, the
case megatron maps by offset: M-RoPE angles per token, models.vision.rope). A prefix tree's row
(parallel.tree_attention: its cu_seqlens carries `tree_positions`) takes each token's own
position in its row (its depth in the tree), this CP rank's tokens already selected.
As in megatron, every L_i must be a multiple of cp (of 2cp for cp > 1); the row's length is the
local tokens times cp.

Megatron-core 0.17+ renamed the MLA flag (`mla_rotary_interleaved`; `multi_latent_attention`
deprecated, moved behind cp_group): `apply_thd` takes both names. models.build.megatron_patches
applies `install` (entry `rope_thd_gather`).
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from models.layers.attention import rope_tables
from parallel.tree_attention import tree_positions

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd


def thd_angle_index(cu_seqlens: torch.Tensor, tokens: int, cp_size: int, cp_rank: int,
                    whole_row: bool) -> torch.Tensor:
    """[tokens] long index into the angle table for this CP rank's tokens of a packed row whose
    full boundaries are `cu_seqlens` (module docstring); computed where cu_seqlens lives."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    local = torch.div(lengths, cp_size, rounding_mode="floor")
    local_end = torch.cumsum(local, 0)
    token = torch.arange(tokens, device=cu.device)
    seq = torch.searchsorted(local_end, token, right=True)
    offset = token - (local_end - local)[seq]
    if cp_size == 1:
        position = offset
    else:
        seg = torch.div(local[seq], 2, rounding_mode="floor")
        position = torch.where(offset < seg, cp_rank * seg + offset,
                               cp_size * local[seq] - (cp_rank + 1) * seg + (offset - seg))
    return position + cu[:-1][seq] if whole_row else position


def apply_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
              rotary_interleaved: bool = False, mla_rotary_interleaved: bool = False,
              mscale: float = 1.0, cp_group=None,
              multi_latent_attention: bool | None = None) -> torch.Tensor:
    """Megatron's `_apply_rotary_pos_emb_thd` (its 0.16 and 0.17+ signatures: the MLA flag is
    the fifth argument under either name; same result): t [tokens, h, d], freqs [S, 1, 1, d]
    -> t with RoPE, every token's angles gathered on the device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    tree = tree_positions(cu_seqlens)   # a prefix tree's row: each token's depth (its position)
    whole_row = tree is None and freqs.dim() >= 1 and freqs.size(0) == t.size(0) * cp_size
    cos, sin = rope_tables.gathered(
        freqs, t.dtype, mscale, cu_seqlens,
        (lambda: tree) if tree is not None else
        lambda: thd_angle_index(cu_seqlens, t.size(0), cp_size, cp_rank, whole_row),
        (t.size(0), cp_size, cp_rank, whole_row, tree is not None))
    return rope_tables.rotate(t.unsqueeze(1), cos, sin, rotary_interleaved,
                              bool(mla_rotary_interleaved or multi_latent_attention)).squeeze(1)


apply_thd.megatron_original = _MEGATRON_THD   # what models.build.megatron_probes checks


def install() -> None:
    """Make megatron's rope_utils apply thd RoPE with `apply_thd` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = apply_thd


def megatron_thd():
    """Megatron's own thd RoPE (tests compare against it)."""
    return _MEGATRON_THD
