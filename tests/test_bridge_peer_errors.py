"""The disaggregated bridge names its peer on every gloo failure (engine.rl.disaggregated.world).

A real two-rank gloo group: this process is job rank 0 (training), a subprocess job rank 1 (the
rollout leader). A silent peer times out at the wait; a dead peer makes gloo raise already when
the receive is posted, before any wait. Both must arrive as BridgeTimeout naming
"rollout rank 0 (job rank 1)" (the trainer's message that the async launch test greps for when a
rollout process dies)."""
from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine.rl.disaggregated.world import BridgeTimeout, SplitWorld, recv_object

PEER = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=60))
group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
sys.stdin.readline()   # the test says when to die
os._exit(0)
"""


def _posting_fails(group) -> bool:
    """Whether gloo raises when a receive from rank 1 is posted (not at its wait)."""
    try:
        work = group.recv([torch.zeros(1)], 1, 99)
    except RuntimeError:
        return True
    with pytest.raises(RuntimeError):   # posted before gloo saw the socket close
        work.wait(timedelta(seconds=5))
    return False


def _world_with_peer() -> tuple[SplitWorld, subprocess.Popen]:
    """A two-rank gloo group (this process job rank 0, training; the PEER subprocess job rank
    1, the rollout leader) as both bridges of a SplitWorld, and the peer's process."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)],
                            stdin=subprocess.PIPE, text=True)
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    return SplitWorld("train", 0, 2, 1, group, group, 60.0, 1), peer


def _end(peer: subprocess.Popen) -> int:
    """Tell the peer to die; its exit code."""
    peer.stdin.write("\n")
    peer.stdin.flush()
    return peer.wait(timeout=60)


def test_a_silent_and_a_dead_peer_are_named():
    split, peer = _world_with_peer()
    try:
        with pytest.raises(BridgeTimeout) as silent:
            recv_object(split, 1, 3, "waiting for rollout batch 0", timeout_s=0.5)
        assert str(silent.value).startswith(
            "waiting for rollout batch 0: no answer from rollout rank 0 (job rank 1) within "
            "rollout.peer_timeout_s=0.5 s")
    finally:
        _end(peer)
    # A new group: gloo closes a pair after its timeout, and the dead peer is the point here.
    split, peer = _world_with_peer()
    assert _end(peer) == 0
    # negative control: once gloo has seen the socket close, posting the receive raises a bare
    # RuntimeError that names no one (a wait-only wrapper lets it through)
    deadline = time.monotonic() + 60
    while not _posting_fails(split.bridge):
        assert time.monotonic() < deadline, "gloo never noticed the dead peer"
        time.sleep(0.1)
    with pytest.raises(BridgeTimeout) as dead:
        recv_object(split, 1, 3, "waiting for rollout batch 0", timeout_s=15)
    assert "no answer from rollout rank 0 (job rank 1)" in str(dead.value)
    assert "Connection closed by peer" in str(dead.value)
