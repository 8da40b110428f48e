"""Interleaved M-RoPE inside megatron's attention.

Megatron's GPTModel asks its `rotary_pos_emb` module for the rotation angles of the batch
(`rotary_pos_emb(seq_len, packed_seq=..., cp_group=...)` -> [S, 1, 1, rot_dim] float32) and
its attention applies them to queries and keys (megatron.core.models.common.embeddings.
rope_utils): per CP rank it picks its zigzag chunks, and for packed (thd) rows whose table
covers the whole row (S == cu_seqlens[-1]) it takes each sequence's angles from its own offset.

`MultimodalRotary` wraps the model's RotaryEmbedding (same inverse frequencies, so partial
rotation and the checkpoint's rope_theta carry over). While `positions` are set (by
models.vision.model for one forward pass) it returns per-token angles [S, b, 1, rot_dim] for
those [3, b, S] positions instead, laid out as transformers' Qwen3.5 does
(`Qwen3_5TextRotaryEmbedding.recomposition_frequencies`): frequency j rotates by the height
position when j % 3 == 1 and j < 3 * section[1], by the width position when j % 3 == 2 and
j < 3 * section[2], else by the temporal position; the angles are then repeated for the
two halves of the rotated dimensions (rotate-half convention). With all three positions
equal (text) this is 1-D RoPE exactly.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils


def interleaved_angles(positions: torch.Tensor, inv_freq: torch.Tensor,
                       section: tuple[int, int, int]) -> torch.Tensor:
    """Angles [S, b, 1, 2F] (float32) for positions [3, b, S] and inv_freq [F]."""
    freqs = positions[..., None].to(inv_freq.dtype) * inv_freq.to(positions.device)  # [3,b,S,F]
    out = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, section[axis] * 3, 3)
        out[..., idx] = freqs[axis, ..., idx]
    emb = torch.cat((out, out), dim=-1)          # [b, S, 2F]
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


class MultimodalRotary(torch.nn.Module):
    """A GPTModel's rotary embedding that follows M-RoPE positions when they are set."""

    def __init__(self, inner: torch.nn.Module, section: tuple[int, int, int]):
        super().__init__()
        self.inner = inner
        self.section = tuple(section)
        self.positions: torch.Tensor | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.inner.inv_freq

    @inv_freq.setter
    def inv_freq(self, value: torch.Tensor) -> None:   # models.layers.attention.rope
        self.inner.inv_freq = value

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len, *args, packed_seq: bool = False, cp_group=None, **kwargs):
        if self.positions is None:
            return self.inner(max_seq_len, *args, packed_seq=packed_seq, cp_group=cp_group,
                              **kwargs)
        emb = interleaved_angles(self.positions, self.inner.inv_freq.float(), self.section)
        if cp_group is None:
            cp_group = getattr(self.inner, "cp_group", None)
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            emb = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
