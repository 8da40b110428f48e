"""Zigzag sharding over context-parallel ranks (parallel/zigzag.py)."""
from __future__ import annotations

import pytest
import torch

from parallel import zigzag


def test_local_positions_by_hand():
    assert zigzag.local_positions([8], cp=2, rank=0).tolist() == [0, 1, 6, 7]
    assert zigzag.local_positions([8], cp=2, rank=1).tolist() == [2, 3, 4, 5]
    # cp=4, L=8: chunks of one token; rank r holds r and 7-r
    assert [zigzag.local_positions([8], 4, r).tolist() for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    assert zigzag.local_positions([6], cp=1, rank=0).tolist() == list(range(6))


def test_packed_row_two_sequences():
    # sequence A = positions 0..7, sequence B = positions 8..11; each cut separately
    assert zigzag.local_positions([8, 4], cp=2, rank=0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag.local_positions([8, 4], cp=2, rank=1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    # causal attention work of the token at position p is p + 1: every rank gets the same total
    lengths = [16 * cp, 4 * cp]
    totals = set()
    for r in range(cp):
        pos = torch.cat([zigzag.local_positions([n], cp, r) for n in lengths])
        totals.add(int((pos + 1).sum()))
    assert len(totals) == 1


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shard_unshard_round_trip(cp):
    gen = torch.Generator().manual_seed(cp)
    lengths = [4 * cp, 2 * cp, 6 * cp]
    total = sum(lengths)
    x1 = torch.randn(3, total, 5, generator=gen)          # token dim 1, e.g. [b, S, h]
    x0 = torch.randn(total, 2, 3, generator=gen)          # token dim 0, e.g. [T, heads, dim]
    for x, dim in ((x1, 1), (x0, 0)):
        pieces = [zigzag.shard(x, lengths, cp, r, dim=dim) for r in range(cp)]
        assert all(p.shape[dim] == total // cp for p in pieces)
        for r, piece in enumerate(pieces):
            expected = x.index_select(dim, zigzag.local_positions(lengths, cp, r))
            assert torch.equal(piece, expected)
        assert torch.equal(zigzag.unshard(pieces, lengths, cp, dim=dim), x)
    if cp > 1:  # the shards are a real permutation: naive concatenation is not the original
        naive = torch.cat([zigzag.shard(x1, lengths, cp, r) for r in range(cp)], dim=1)
        assert not torch.equal(naive, x1)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_gathered_to_natural_is_inverse(cp):
    lengths = [2 * cp, 8 * cp, 4 * cp]
    gathered = torch.cat([zigzag.local_positions(lengths, cp, r) for r in range(cp)])
    perm = zigzag.gathered_to_natural(lengths, cp)
    assert torch.equal(gathered[perm], torch.arange(sum(lengths)))
    assert sorted(perm.tolist()) == list(range(sum(lengths)))
    # every token is held by exactly one rank
    assert sorted(gathered.tolist()) == list(range(sum(lengths)))


def test_length_not_divisible_raises():
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=4"):
        zigzag.local_positions([6], cp=2, rank=0)
    with pytest.raises(ValueError):
        zigzag.local_positions([8, 5], cp=2, rank=1)
    with pytest.raises(ValueError):
        zigzag.shard(torch.zeros(1, 12), [12], cp=4, rank=0)
    with pytest.raises(ValueError):
        zigzag.gathered_to_natural([10], cp=4)
