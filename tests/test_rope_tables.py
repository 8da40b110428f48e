"""RoPE's cos/sin tables once per angle table (models.layers.attention.rope_tables): the cached
bshd RoPE and the packed (thd) RoPE equal megatron's own functions bitwise (fp32 and bf16,
interleaved, MLA's interleave, mscale, partial rotary, CP ranks), and the tables are computed
once per freqs tensor (per packed boundaries for thd), again after an in-place change. The
whole-model count (one cos per micro-batch instead of one per layer for queries and keys) is in
tests/test_step_host_syncs.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.layers.attention import packed_rope, rope_tables


def _freqs(seq: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]        # [S, 1, 1, dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved,mla,mscale", [(False, False, 1.0), (True, False, 1.0),
                                                    (False, True, 0.7), (False, False, 1.3)])
def test_bshd_equals_megatron_bitwise(dtype, interleaved, mla, mscale):
    rope_tables.clear()
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(9, 2, 4, 24, generator=gen).to(dtype)    # 16 rotated dims + 8 passed through
    freqs = _freqs(9, 16)
    flag = {rope_tables.MLA_FLAG: mla}
    ref = rope_tables.megatron_bshd()(t, freqs, rotary_interleaved=interleaved, mscale=mscale,
                                      **flag)
    for _ in range(3):   # queries, keys, the next layer: one computation
        got = rope_tables.apply_bshd(t, freqs, interleaved, mla, mscale)
        assert torch.equal(got, ref)
    assert rope_tables._TABLES.misses == 1


def test_tables_recomputed_for_new_or_changed_angles():
    rope_tables.clear()
    freqs = _freqs(6, 8)
    t = torch.randn(6, 1, 2, 8)
    rope_tables.apply_bshd(t, freqs)
    rope_tables.apply_bshd(t.double(), freqs)          # another dtype
    assert rope_tables._TABLES.misses == 2
    rope_tables.apply_bshd(t.double(), freqs)
    assert rope_tables._TABLES.misses == 2
    freqs.mul_(2.0)                                    # changed in place: its version moved
    out = rope_tables.apply_bshd(t, freqs)
    assert rope_tables._TABLES.misses == 3
    assert torch.equal(out, rope_tables.megatron_bshd()(t, freqs))
    other = freqs.clone()                              # equal values, another tensor
    rope_tables.apply_bshd(t, other)
    assert rope_tables._TABLES.misses == 4
    assert len(rope_tables._TABLES) == 2               # freqs' entry and other's
    del other                                          # freed: its tables go with it
    assert len(rope_tables._TABLES) == 1
    # negative control: a cache keyed on shape alone would have served the stale tables
    stale = rope_tables.rotate(t, *(x.to(t.dtype) for x in (torch.cos(freqs / 2),
                                                             torch.sin(freqs / 2))), False, False)
    assert not torch.equal(stale, rope_tables.megatron_bshd()(t, freqs))


@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("whole_row", [False, True])
def test_thd_equals_megatron_bitwise_and_gathers_once(cp_size, cp_rank, whole_row):
    rope_tables.clear()
    lengths = [8, 12, 4]                                   # multiples of 2 * cp
    cu = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    tokens = sum(lengths) // cp_size
    group = SimpleNamespace(size=lambda: cp_size, rank=lambda: cp_rank)
    freqs = _freqs(sum(lengths) if whole_row else max(lengths), 16)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, tokens, 4, 16, generator=gen)
    for t in (q, k):
        ref = packed_rope.megatron_thd()(t, cu, freqs, cp_group=group)
        assert torch.equal(packed_rope.apply_thd(t, cu, freqs, cp_group=group), ref)
    assert rope_tables._GATHERED.misses == 1 and rope_tables._TABLES.misses == 1
    packed_rope.apply_thd(q, cu.clone(), freqs, cp_group=group)   # the next micro-batch
    assert rope_tables._GATHERED.misses == 2 and rope_tables._TABLES.misses == 1


def test_two_models_keep_their_own_tables():
    """A policy and a reference model (two RotaryEmbeddings, two freqs tensors) alternating in
    one process: each computes its tables once (issue 82: one process-global entry made them
    evict each other on every call). Negative control: a one-entry cache (the old design)
    recomputes on every alternation."""
    rope_tables.clear()
    policy, reference = _freqs(7, 8), _freqs(7, 8) * 1.5
    t = torch.randn(7, 1, 2, 8)
    for _ in range(4):
        for freqs in (policy, reference):
            assert torch.equal(rope_tables.apply_bshd(t, freqs),
                               rope_tables.megatron_bshd()(t, freqs))
    assert rope_tables._TABLES.misses == 2 and len(rope_tables._TABLES) == 2
    one = rope_tables._OneEntry()
    computed = [one.get((f,), (), lambda: 0)[1] for _ in range(4) for f in (policy, reference)]
    assert sum(computed) == 8
    del policy
    assert len(rope_tables._TABLES) == 1
