"""models/layers/transforms.py against layouts built by hand, row by row.

Megatron's fused QKV: for each KV group g, the rows of g's query heads, then g's key head, then
g's value head. linear_fc1 at TP=t: rank r holds [gate rows of block r; up rows of block r].
Every source row carries a unique value, so a misplaced row cannot go unnoticed.
"""
from __future__ import annotations

import pytest
import torch

from models.layers import transforms as wm
from models.build.transformer_config import padded_vocab_size


def _labelled(rows: int, cols: int | None, base: float) -> torch.Tensor:
    """Rows whose every entry encodes (base, row, col): base + row + col/1000 (1-D: no col)."""
    r = torch.arange(rows, dtype=torch.float64).unsqueeze(1)
    if cols is None:
        return (base + r).squeeze(1)
    return base + r + torch.arange(cols, dtype=torch.float64) / 1000


def _expected_qkv(q, k, v, heads: int, groups: int) -> torch.Tensor:
    """Fused QKV built one row at a time from the documented Megatron layout."""
    d = q.shape[0] // heads
    per_group = heads // groups
    rows = []
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows += [q[h * d + i] for i in range(d)]
        rows += [k[g * d + i] for i in range(d)]
        rows += [v[g * d + i] for i in range(d)]
    return torch.stack(rows)


QKV_CASES = [  # (heads, kv_heads, head_dim, hidden or None for a bias)
    (8, 2, 4, 16),   # GQA weight
    (8, 2, 4, None),  # GQA bias
    (4, 4, 3, 12),   # MHA weight
    (4, 4, 3, None),  # MHA bias
]


@pytest.mark.parametrize("heads,groups,d,hidden", QKV_CASES)
def test_merge_qkv_matches_hand_built_layout(heads, groups, d, hidden):
    q = _labelled(heads * d, hidden, 1000.0)
    k = _labelled(groups * d, hidden, 2000.0)
    v = _labelled(groups * d, hidden, 3000.0)
    fused = wm.merge_qkv(q, k, v, heads, groups)
    expected = _expected_qkv(q, k, v, heads, groups)
    assert fused.shape == expected.shape == ((heads + 2 * groups) * d, *q.shape[1:])
    assert torch.equal(fused, expected)


def test_merge_qkv_literal_small_case():
    """4 heads, 2 groups, head_dim 1: [q0 q1 k0 v0 q2 q3 k1 v1]."""
    q = torch.tensor([10.0, 11.0, 12.0, 13.0])
    k = torch.tensor([20.0, 21.0])
    v = torch.tensor([30.0, 31.0])
    fused = wm.merge_qkv(q, k, v, num_heads=4, num_kv_heads=2)
    assert fused.tolist() == [10.0, 11.0, 20.0, 30.0, 12.0, 13.0, 21.0, 31.0]


@pytest.mark.parametrize("heads,groups,d,hidden", QKV_CASES)
def test_split_qkv_inverts_merge(heads, groups, d, hidden):
    q = _labelled(heads * d, hidden, 1000.0)
    k = _labelled(groups * d, hidden, 2000.0)
    v = _labelled(groups * d, hidden, 3000.0)
    q2, k2, v2 = wm.split_qkv(wm.merge_qkv(q, k, v, heads, groups), heads, groups)
    for got, want in ((q2, q), (k2, k), (v2, v)):
        assert torch.equal(got, want)
        assert got.is_contiguous()


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_qkv_tp_shards_hold_whole_groups(tp):
    """Chunking the fused tensor into `tp` row blocks gives each rank whole query groups."""
    heads, groups, d, hidden = 8, 2, 4, 16
    q = _labelled(heads * d, hidden, 1000.0)
    k = _labelled(groups * d, hidden, 2000.0)
    v = _labelled(groups * d, hidden, 3000.0)
    shards = wm.merge_qkv(q, k, v, heads, groups).chunk(tp, dim=0)
    per_rank = groups // tp
    heads_per_group = heads // groups
    for r, shard in enumerate(shards):
        gs = range(r * per_rank, (r + 1) * per_rank)
        hs = [h for g in gs for h in range(g * heads_per_group, (g + 1) * heads_per_group)]
        q_r = q.reshape(heads, d, hidden)[hs].reshape(-1, hidden)
        k_r = k.reshape(groups, d, hidden)[list(gs)].reshape(-1, hidden)
        v_r = v.reshape(groups, d, hidden)[list(gs)].reshape(-1, hidden)
        assert torch.equal(shard, _expected_qkv(q_r, k_r, v_r, len(hs), per_rank))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merge_gate_up_per_rank_layout(tp):
    f, hidden = 8, 6
    gate = _labelled(f, hidden, 1000.0)
    up = _labelled(f, hidden, 2000.0)
    shards = wm.merge_gate_up(gate, up, tp)
    assert len(shards) == tp
    block = f // tp
    for r, shard in enumerate(shards):
        rows = [gate[i] for i in range(r * block, (r + 1) * block)]
        rows += [up[i] for i in range(r * block, (r + 1) * block)]
        assert torch.equal(shard, torch.stack(rows))


def test_merge_gate_up_literal_tp2():
    """f=4, tp=2: rank0 = [g0 g1 u0 u1], rank1 = [g2 g3 u2 u3]."""
    gate = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    up = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    s0, s1 = wm.merge_gate_up(gate, up, 2)
    assert s0.flatten().tolist() == [0.0, 1.0, 10.0, 11.0]
    assert s1.flatten().tolist() == [2.0, 3.0, 12.0, 13.0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_gate_up_inverts_merge(tp):
    gate = _labelled(8, 6, 1000.0)
    up = _labelled(8, 6, 2000.0)
    g2, u2 = wm.split_gate_up(wm.merge_gate_up(gate, up, tp))
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_pad_vocab_appends_zero_rows():
    w = _labelled(1001, 4, 1.0)
    padded = wm.pad_vocab(w, 1024)
    assert padded.shape == (1024, 4)
    assert torch.equal(padded[:1001], w)
    assert torch.count_nonzero(padded[1001:]) == 0


def test_pad_vocab_noop_and_refuses_to_shrink():
    w = _labelled(256, 4, 1.0)
    assert torch.equal(wm.pad_vocab(w, 256), w)
    with pytest.raises(ValueError):
        wm.pad_vocab(w, 128)


def test_unpad_vocab_inverts_pad():
    w = _labelled(1001, 4, 1.0)
    back = wm.unpad_vocab(wm.pad_vocab(w, 1024), 1001)
    assert back.shape == (1001, 4) and back.is_contiguous()
    assert torch.equal(back, w)


@pytest.mark.parametrize("vocab,tp,expected", [
    (1001, 1, 1024), (1001, 2, 1024), (1001, 8, 1024), (200, 4, 256), (128, 1, 128),
    (129, 1, 256), (1001, 3, 1152),
])
def test_padded_vocab_size(vocab, tp, expected):
    """Multiple of lcm(128, tp): layout-independent for power-of-two TP."""
    assert padded_vocab_size(vocab, tp) == expected
