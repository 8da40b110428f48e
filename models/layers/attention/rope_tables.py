"""RoPE's cos/sin tables computed once per angle table, not in every layer for q and for k.

Megatron-core's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`, what its attention runs
without Transformer Engine) recomputes `(cos(freqs) * mscale).to(t.dtype)` and the same for sin
on every call: twice per layer (queries, keys) per micro-batch, six kernels each time, although
the model computes `freqs` once per forward (its RotaryEmbedding even caches it across forwards
by sequence length). `apply_bshd` is megatron's function (same arguments, same result, bitwise)
that takes the two tables from `tables(freqs, dtype, mscale)`: a cache with one entry per
`freqs` tensor, keyed on its identity and version (a weak reference: the cache never keeps it
alive, an entry goes with its tensor, and an in-place change of it is a miss), the dtype and
mscale. Each model's RotaryEmbedding computes (and caches) its own `freqs`, so each model owns
its entry: a policy and a reference model (or a critic) in one process keep their tables side by
side instead of evicting each other on every alternation. Packed rows
(models.layers.attention.packed_rope) gather per-token rows of the same tables once per
micro-batch (`gathered`, keyed on the packed boundaries as well). The tables are plain tensors
(freqs never requires a gradient), read by autograd like any other saved input; they are never
written in place.

The cached tables are `cos(freqs) * mscale` and `sin(freqs) * mscale` cast to the activations'
dtype, as megatron computes them; gathering rows of them equals computing them on gathered angles
(elementwise functions), so both paths equal megatron's bitwise (tests/test_rope_tables.py).
`install()` (idempotent) puts `apply_bshd` in megatron's place; models.build.megatron_patches
applies it (entry `rope_bshd_tables`: the megatron-core versions, the probe).
"""
from __future__ import annotations

import inspect
import weakref
from typing import Callable

import torch
from megatron.core.models.common.embeddings import rope_utils

_MEGATRON_BSHD = rope_utils._apply_rotary_pos_emb_bshd
# the MLA flag's name in megatron's bshd RoPE: 0.16 multi_latent_attention, 0.17+ mla_rotary_interleaved
MLA_FLAG = ("mla_rotary_interleaved" if "mla_rotary_interleaved"
            in inspect.signature(_MEGATRON_BSHD).parameters else "multi_latent_attention")


class _OneEntry:
    """The last value computed for one key, valid while the same anchor tensors (held weakly:
    identity, never kept alive) are given again; dropped as soon as an anchor is freed, so no
    table outlives its angles (e.g. on a GPU while the model sleeps). `on_free()` runs when a
    held anchor is freed."""

    def __init__(self, on_free: Callable[[], None] = lambda: None) -> None:
        self._refs: tuple = ()
        self._key: tuple = ()
        self._value = None
        self._on_free = on_free

    def _drop(self, ref=None) -> None:
        """Forget the entry (`ref`: a freed anchor's reference; one of an older entry is
        ignored)."""
        if ref is None or any(ref is r for r in self._refs):
            self._refs, self._key, self._value = (), (), None
            if ref is not None:
                self._on_free()

    def get(self, anchors: tuple, key: tuple, compute: Callable) -> tuple:
        """(value, computed): the held value when anchors and key match, else `compute()`'s."""
        if (self._refs and len(self._refs) == len(anchors) and self._key == key
                and all(r() is a for r, a in zip(self._refs, anchors))):
            return self._value, False
        self._drop()
        value = compute()
        self._refs = tuple(weakref.ref(a, self._drop) for a in anchors)
        self._key, self._value = key, value
        return value, True


class _PerAngles:
    """One `_OneEntry` per angle table (the first anchor, a `freqs` tensor: one per model's
    RotaryEmbedding and sequence length), removed when that tensor is freed."""

    def __init__(self) -> None:
        self._entries: dict[int, _OneEntry] = {}
        self.misses = 0   # computations over all entries (tests count them)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, anchors: tuple, key: tuple, compute: Callable):
        ident = id(anchors[0])
        entry = self._entries.get(ident)
        if entry is None:
            entry = self._entries[ident] = _OneEntry(lambda: self._entries.pop(ident, None))
        value, computed = entry.get(anchors, key, compute)
        self.misses += computed
        return value


_TABLES = _PerAngles()
_GATHERED = _PerAngles()


def tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    """(cos, sin) of `freqs` [S, ..., d] times mscale, in `dtype`: megatron's per-call tables,
    computed once per freqs tensor (module docstring)."""
    def compute():
        return ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
    return _TABLES.get((freqs,), (freqs._version, dtype, float(mscale)), compute)


def gathered(freqs: torch.Tensor, dtype: torch.dtype, mscale: float, cu_seqlens: torch.Tensor,
             index_of: Callable[[], torch.Tensor], extra: tuple):
    """(cos, sin) rows for one packed micro-batch: `tables(...)` rows at `index_of()` (a
    [tokens] long index, computed on a miss only), cached per (freqs, cu_seqlens, extra)."""
    cos, sin = tables(freqs, dtype, mscale)

    def compute():
        index = index_of().to(cos.device)
        return cos.index_select(0, index), sin.index_select(0, index)
    key = (freqs._version, cu_seqlens._version, dtype, float(mscale), extra)
    return _GATHERED.get((freqs, cu_seqlens), key, compute)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_interleaved: bool,
           mla_interleaved: bool) -> torch.Tensor:
    """Megatron's bshd rotation with given tables: t [..., d_t], tables [..., rot_dim]."""
    rot_dim = cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if mla_interleaved:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    t = (t * cos) + (rope_utils._rotate_half(t, rotary_interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1)


def apply_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
               mla_rotary_interleaved: bool = False, mscale: float = 1.0,
               multi_latent_attention: bool | None = None) -> torch.Tensor:
    """Megatron's `_apply_rotary_pos_emb_bshd` (its 0.16 and 0.17+ signatures: the MLA flag is
    the fourth argument under either name; same result, bitwise) with cached tables."""
    cos, sin = tables(freqs, t.dtype, mscale)
    return rotate(t, cos, sin, rotary_interleaved,
                  bool(mla_rotary_interleaved or multi_latent_attention))


apply_bshd.megatron_original = _MEGATRON_BSHD   # what models.build.megatron_probes checks


def clear() -> None:
    """Forget every cached entry (tests count computations from a clean state)."""
    global _TABLES, _GATHERED
    _TABLES, _GATHERED = _PerAngles(), _PerAngles()


def install() -> None:
    """Make megatron's rope_utils apply bshd RoPE with `apply_bshd` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd


def megatron_bshd():
    """Megatron's own bshd RoPE (tests compare against it)."""
    return _MEGATRON_BSHD
