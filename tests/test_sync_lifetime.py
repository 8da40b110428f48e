"""engine.generation.sync.lifetime: the weight-sync buffer lifetime as one state machine. One
test per allowed move (through BufferTable, the owner's table SharedBuckets keeps), every other
move refused naming both states, and the worker's side (WorkerViews). In-process, no vLLM."""
from __future__ import annotations

import gc

import pytest
import torch

from engine.generation.sync.handles import SharedBuckets
from engine.generation.sync.lifetime import (NEW, TRANSITIONS, BadTransition, BufferTable, State,
                                             WorkerViews, check)

ALL = [NEW, *State]


def _returned(table: BufferTable, buffer: torch.Tensor) -> int:
    token = table.export(buffer)
    table.move(token, State.RETURNED)
    return token


def test_new_to_outstanding_a_new_buffer_gets_a_fresh_token():
    table, a, b = BufferTable(), torch.zeros(8), torch.zeros(8)
    assert (table.export(a), table.export(b)) == (0, 1)
    assert table.state(0) is State.OUTSTANDING and table.buffers[1] is b


def test_outstanding_to_returned_when_the_call_returned():
    table = BufferTable()
    token = table.export(torch.zeros(8))
    table.move(token, State.RETURNED)
    assert table.state(token) is State.RETURNED and table.tokens(State.OUTSTANDING) == []


def test_returned_to_free_at_the_close_when_no_worker_views_it():
    table = BufferTable()
    token = _returned(table, torch.zeros(8))
    table.closed(set())
    assert table.state(token) is State.FREE and table.reusable(8, torch.device("cpu")) is \
        table.buffers[token]


def test_returned_to_released_a_viewed_buffer_at_the_close_and_a_device_one():
    table = BufferTable()
    viewed, other = _returned(table, torch.zeros(8)), _returned(table, torch.zeros(8))
    device = _returned(table, torch.zeros(8, device="meta"))   # stands in for a GPU buffer
    table.closed({viewed})
    assert (table.state(viewed), table.state(other), table.state(device)) == (
        None, State.FREE, None)   # released: forgotten, the owner's reference dropped
    assert viewed not in table.buffers and device not in table.buffers
    explicit = _returned(table, torch.zeros(8))
    table.move(explicit, State.RELEASED)   # SharedBuckets.release of a device buffer
    assert table.state(explicit) is None


def test_free_to_outstanding_the_next_sync_refills_the_same_buffer_under_its_token():
    table, buffer = BufferTable(), torch.zeros(16)
    token = _returned(table, buffer)
    table.closed(set())
    assert table.reusable(17, torch.device("cpu")) is None   # too small
    assert table.reusable(16, torch.device("meta")) is None  # another device
    assert table.export(table.reusable(10, torch.device("cpu"))) == token
    assert table.state(token) is State.OUTSTANDING and table.tokens(State.FREE) == []


def test_free_to_released_a_close_that_frees_newer_buffers_drops_the_older_ones():
    table = BufferTable()
    old = _returned(table, torch.zeros(8))
    table.closed(set())
    table.closed(set())   # a sync by file (nothing returned): the free buffer stays
    assert table.state(old) is State.FREE
    new = _returned(table, torch.zeros(32))   # a bucket the free buffer could not hold
    table.closed(set())
    assert table.state(old) is None and table.state(new) is State.FREE


@pytest.mark.parametrize("src,dst", [(s, d) for s in ALL for d in State
                                     if (s, d) not in TRANSITIONS])
def test_every_other_move_is_refused_naming_both_states(src, dst):
    name = src.value if src is not None else "new"
    allowed = ", ".join(d.value for (s, d) in TRANSITIONS if s == src) or "none"
    with pytest.raises(BadTransition, match=f"bucket 7: {name} -> {dst.value} is not allowed"
                       f".*; from {name}: {allowed}$"):
        check(7, src, dst)


def test_the_table_refuses_releasing_an_outstanding_buffer_and_keeps_it():
    shared = SharedBuckets()
    token = shared.hold(torch.zeros(8))
    with pytest.raises(BadTransition, match="outstanding -> released is not allowed \\(it is "
                                            "still being loaded by the engine's workers"):
        shared.release(token)
    assert shared.outstanding == {token}
    with pytest.raises(BadTransition, match="bucket 99: new -> returned"):
        shared.returned(99)   # a token never exported
    assert len(TRANSITIONS) == 6


def test_a_worker_reports_the_buffers_it_still_views_then_forgets_them():
    views, kept, dropped = WorkerViews(), torch.zeros(8), torch.zeros(8)
    views.open(3, kept.untyped_storage())
    views.open(4, dropped.untyped_storage())
    del dropped
    gc.collect()
    assert views.still_viewed() == [3]
    assert views.still_viewed() == []   # forgotten: the next sync starts empty
