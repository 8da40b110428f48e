"""rollout.sync_delta (engine.rl.disaggregated.delta): per tensor the whole tensor or only its
changed elements cross to the engine owners, and what the receiver rebuilds is bitwise the
sent tensor. Pure units, plus the real sender and receiver (weight_send.push_weights,
inbox.receive_version) over an in-process transport. The multi-rank check is in
tests/test_rl_async.py (the runs there sync with deltas; s1 with full tensors)."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from engine.rl.disaggregated import inbox, weight_send
from engine.rl.disaggregated.delta import (FULL, INDEX, MASK, DeltaRefused, ReceiverBases,
                                           SenderBases, bits, choose, decode, encode,
                                           payload_bytes)


def _changed(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`old` with round(fraction x numel) elements given new values (bitwise different)."""
    g = torch.Generator().manual_seed(seed)
    new = old.clone().reshape(-1)
    k = round(fraction * new.numel())
    where = torch.randperm(new.numel(), generator=g)[:k]
    new[where] = (new[where].float() * 1.5 + 0.25).to(old.dtype)   # never a fixed point here
    return new.reshape(old.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction,kind", [(0.0, INDEX), (0.03, INDEX), (0.5, MASK),
                                           (1.0, FULL)])
def test_round_trip_is_bitwise_and_takes_the_smallest_encoding(dtype, fraction, kind):
    old = (torch.randn(97, 33, generator=torch.Generator().manual_seed(1)) + 3).to(dtype)
    new = _changed(old, fraction, seed=2)
    k = int((bits(new) != bits(old)).sum())
    assert k == round(fraction * new.numel())
    kept = old.clone()
    e = encode(new, old)
    assert (e.kind, e.changed) == (kind, k)
    assert e.payload.numel() == payload_bytes(kind, new.numel(), k, new.element_size())
    got = decode(e.kind, e.changed, e.payload.clone(), new.shape, dtype, old)
    assert torch.equal(bits(got), bits(new)) and torch.equal(bits(old), bits(kept))
    # negative control: the base it was made against matters
    if kind != FULL and k:
        assert not torch.equal(bits(decode(e.kind, e.changed, e.payload, new.shape, dtype,
                                           new)), bits(old))


def test_bitwise_changes_that_compare_equal_as_numbers_are_sent():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16).repeat(64)
    new = old.clone()
    new[0] = -0.0                                     # == 0.0 as a number
    new.view(torch.int16)[2] += 1                     # another NaN payload
    e = encode(new, old)
    assert e.changed == 2
    got = decode(e.kind, e.changed, e.payload, new.shape, new.dtype, old)
    assert torch.equal(bits(got), bits(new))


def test_the_size_rule():
    """index below 1/32 changed, mask above, full above 1 - 1/(8 x element size); no index
    where int32 positions cannot address the tensor."""
    n = 1 << 20
    assert choose(n, n // 40, 2) == INDEX and choose(n, n // 30, 2) == MASK
    assert choose(n, int(n * 0.93), 2) == MASK and choose(n, int(n * 0.95), 2) == FULL
    assert choose(n, int(n * 0.96), 4) == MASK and choose(n, int(n * 0.975), 4) == FULL
    assert choose(n, 0, 2) == INDEX and payload_bytes(INDEX, n, 0, 2) == 0
    assert choose(2 ** 31, 10, 2) == MASK
    with pytest.raises(ValueError, match="must be one of"):
        payload_bytes("zip", n, 1, 2)


def test_a_delta_against_a_base_the_receiver_lacks_is_refused():
    old = torch.randn(64, 64).to(torch.bfloat16)
    e = encode(_changed(old, 0.03, seed=3), old)
    with pytest.raises(DeltaRefused, match="holds as nothing: refused"):
        decode(e.kind, e.changed, e.payload, old.shape, old.dtype, None)
    with pytest.raises(DeltaRefused, match=r"holds as \(64, 32\)"):
        decode(e.kind, e.changed, e.payload, old.shape, old.dtype, old[:, :32])
    held = ReceiverBases(version=4, tensors={"w": old})
    assert held.base("w", 4, 5) is old
    with pytest.raises(DeltaRefused, match="against version 3, but this receiver holds "
                                           "version 4: refused, not applied"):
        held.base("w", 3, 5)
    with pytest.raises(DeltaRefused, match="holds no version"):
        ReceiverBases().base("w", 4, 5)
    with pytest.raises(DeltaRefused, match="without that tensor"):
        held.base("v", 4, 5)


class _Wire:
    """An in-process stand-in for the weights group: per (src, dst) a FIFO of tensors."""

    def __init__(self, monkeypatch, rank: int) -> None:
        self.q = defaultdict(list)
        self.split = SimpleNamespace(weights=None, describe_peer=lambda r: f"rank {r}")
        monkeypatch.setattr(weight_send.dist, "get_rank", lambda: rank)
        monkeypatch.setattr(weight_send, "send_object",
                            lambda split, obj, dst, *a, **k: self.q[(rank, dst)].append(obj))
        monkeypatch.setattr(weight_send, "send_tensor",
                            lambda split, t, dst, *a, **k: self.q[(rank, dst)].append(t.clone()))
        monkeypatch.setattr(inbox, "recv_object", lambda split, src, *a, **k: self.pop(src))
        monkeypatch.setattr(inbox, "recv_tensor",
                            lambda split, out, src, *a, **k: out.copy_(self.pop(src)))
        self.dst = None

    def pop(self, src: int):
        return self.q[(src, self.dst)].pop(0)


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """A bf16 trajectory: about 3 % of each tensor changes per step (plus one small tensor
    that changes entirely)."""
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(300, 40, generator=g).to(torch.bfloat16),
         "b": torch.randn(1000, generator=g).to(torch.bfloat16),
         "norm": torch.ones(8, dtype=torch.bfloat16)}
    for s in range(1, step + 1):
        w = {n: _changed(t, 0.03, seed=s) for n, t in w.items()}
        w["norm"] = w["norm"] + s
    return list(w.items())


def test_sender_and_receivers_across_versions(monkeypatch):
    """push_weights / receive_version: receiver 7 from version 0 on, receiver 8 joining at
    version 2 (full tensors first), then a restarted receiver 7 given a delta: refused."""
    wire = _Wire(monkeypatch, rank=0)
    plan = weight_send.TransferPlan(sends={0: [7]}, sources={7: [0], 8: [0]}, first_stage={0})
    sender, held = SenderBases(True), {7: ReceiverBases(), 8: ReceiverBases()}
    sent = []
    for v in range(4):
        if v == 2:
            plan.sends[0].append(8)
        monkeypatch.setattr(weight_send, "export_stage_weights",
                            lambda *a, _v=v: iter(_weights(_v)))
        sync, stats = weight_send.push_weights(wire.split, [], {}, 0.004, plan, v, sender)
        assert sync.num_buckets == 2 and sync.total_bytes == 26016
        for dst in plan.sends[0]:
            wire.dst = dst
            got = inbox.receive_version(wire.split, [0], held[dst])
            assert got.version == v and held[dst].version == v
            for (name, t), (n2, t2) in zip(_weights(v), [x for b in got.buckets for x in b]):
                assert name == n2 and torch.equal(bits(t), bits(t2))
        sent.append(stats)
    full = 26016   # bytes of the three bf16 tensors
    assert sent[0].bytes == full and sent[0].changed == sent[0].elements == 13008
    # version 1, 3: deltas (~3 % of 13000 elements at 6 bytes each, the norm whole)
    assert sent[1].bytes < full / 5 and 0.03 < sent[1].changed / sent[1].elements < 0.04
    # version 2: receiver 8's first version is whole, receiver 7's a delta
    assert full < sent[2].bytes < full * 1.25 and sent[2].elements == 2 * 13008
    # a receiver that restarted (holds nothing) must not apply a delta
    monkeypatch.setattr(weight_send, "export_stage_weights", lambda *a: iter(_weights(4)))
    weight_send.push_weights(wire.split, [], {}, 0.004, plan, 4, sender)
    wire.dst = 7
    with pytest.raises(DeltaRefused, match="version 4: a delta of a against version 3, but "
                                           "this receiver holds no version"):
        inbox.receive_version(wire.split, [0], ReceiverBases())
    # rollout.sync_delta=false: whole tensors, nothing kept
    off = SenderBases(False)
    for v in range(2):
        monkeypatch.setattr(weight_send, "export_stage_weights",
                            lambda *a, _v=v: iter(_weights(_v)))
        _, stats = weight_send.push_weights(wire.split, [], {}, 0.004, plan, v, off)
        assert stats.bytes == 2 * full and off.tensors == {}


def test_the_key_is_checked_by_name():
    from engine.rl.config import RLConfig
    from engine.rl.disaggregated.checks import async_problems

    from engine.rl.disaggregated.delta import delta_enabled

    cfg = RLConfig()
    assert cfg.rollout.sync_delta is None and async_problems(cfg, 2) == []
    cfg.rollout.sync_delta = "yes"
    assert async_problems(cfg, 2) == ["rollout.sync_delta='yes' must be true, false or null "
                                      "(auto: on when the job spans more than one node)"]
    # null (auto): deltas only where the job spans nodes; true / false as set
    assert [delta_enabled(None, n) for n in (1, 2)] == [False, True]
    assert [delta_enabled(s, 1) for s in (True, False)] == [True, False]
