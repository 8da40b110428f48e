"""train.prefix_sharing with MoE routing replay (moe.routing_replay, issue 91): shared equals
unshared on the tiny Qwen3-MoE (8 experts, top-2) for GRPO, with a recorded routing that
disagrees where rows share tokens (the harness: tests/multirank/prefix_replay_check.py), at 1
process (with the negative controls), EP2 (DP2), TP2 + SP, CP2 (Ulysses) and PP2; and the pieces
(engine.training.tree_routing) on hand-made rows."""
from __future__ import annotations

import json

import pytest
import torch

CHECK = "tests/multirank/prefix_replay_check.py"
TOL = 1e-5
LAYOUTS = ("1,1,1,ep=2+mbs=2", "2,1,1,sp+mbs=2", "1,1,2,mbs=2", "1,2,1,mbs=2")


def _lines(proc, tag: str) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines()
            if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.conftest import INIT_RANGE
    from tools.tiny_models import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("moe")), "qwen3_moe", layers=2,
                            initializer_range=INIT_RANGE)


@pytest.fixture(scope="module")
def one_process(pools, moe_dir):
    proc = pools.script(1, CHECK, moe_dir, "1,1,1,mbs=2+ctl", timeout=600)
    return _lines(proc, "RESULT"), _lines(proc, "CONTROL")


def _check(r: dict) -> None:
    """Log-probs (replaying the diverged routing), every non-moe/* metric over 3 steps, the
    step-1 recording and moe/replay_mismatch equal; the diverged routing is replayed (the
    log-prob pass's mismatch is the diverged tokens' share); the rows share."""
    assert r["logprob_rel"] < TOL and r["metric_rel"] < TOL, r
    assert r["first_loss_rel"] < TOL and r["first_grad_norm_rel"] < TOL, r
    assert r["recorded_diff"] == 0.0, r
    assert r["mismatch_rel"] < TOL and r["moe_rel"]["moe/replay_mismatch"] < TOL, r
    off, on = r["logprob_mismatch"]
    assert off > 0.01 and abs(on - off) < TOL * off, r
    assert r["ratio_off"] == 1.0 and r["ratio_on"] < 0.6, r
    assert len(set(r["losses"])) == 3, r   # the model trains


def test_replay_shared_equals_unshared_at_one_process(one_process):
    (result,), _ = one_process
    _check(result)


def test_replay_negative_controls_are_caught(one_process):
    """Rows whose recorded routings differ merged by tokens alone replay one row's routing
    for all (log-probs and metrics move); a node's mismatch counted once, not per row token,
    moves moe/replay_mismatch (all else equal); a node's choice recorded for its first row
    only leaves the other rows' recordings empty (recorded_diff)."""
    (result,), controls = one_process
    by_kind = {c["kind"]: c for c in controls}
    assert sorted(by_kind) == ["first_row", "per_node", "unkeyed"]
    unkeyed, per_node = by_kind["unkeyed"], by_kind["per_node"]
    assert by_kind["first_row"]["recorded_diff"] > 0.1, by_kind["first_row"]
    assert unkeyed["logprob_rel"] > 1e-2 and unkeyed["metric_rel"] > 1e-2, unkeyed
    assert unkeyed["ratio_on"] < result["ratio_on"], unkeyed   # it shared the diverged tokens
    assert per_node["mismatch_rel"] > 1e-2 and per_node["logprob_rel"] < TOL, per_node


def test_replay_shared_equals_unshared_at_every_layout(pools, moe_dir):
    """EP2 (DP2), TP2 + SP (each TP rank records its slice of the tree), CP2 (each CP rank
    records the nodes of its zigzag shard for every row token they stand for) and PP2 (each
    stage its layers; one tree row length for the step, from the keyed trees)."""
    proc = pools.script(2, CHECK, moe_dir, *LAYOUTS, timeout=600)
    results = _lines(proc, "RESULT")
    assert [r["spec"] for r in results] == list(LAYOUTS)
    for r in results:
        _check(r)


def _seq(tokens, routing):
    from engine.training.micro_batches import SequenceData
    from engine.training.routing import ROUTED_EXPERTS

    s = SequenceData(list(tokens), list(tokens), [1] * len(tokens))
    if routing is not None:
        s.extras[ROUTED_EXPERTS] = torch.tensor(routing, dtype=torch.uint8)
    return s


def test_trie_is_keyed_by_recorded_routing():
    """Three rows sharing 4 tokens: rows 0 and 1 recorded the same routing, row 2 another
    from token 2 on: the keyed trie shares tokens 0-1 among all three and 2-3 between rows 0
    and 1 only (9 nodes; by tokens alone 6, row 2's tokens 2-4 merged: the control); the replayed routing of every node is
    each of its rows' own, the weights count its rows, and recording reaches every row."""
    from engine.training.prefix_tree import build_prefix_tree, tree_tokens
    from engine.training.tree_routing import node_tokens, tree_routing, trie_rows

    same = [[0, 1], [2, 3], [4, 5], [6, 7], [1, 2]]
    other = [[0, 1], [2, 3], [5, 4], [6, 7], [3, 1]]   # a set equal as a set counts apart too
    seqs = [_seq([5, 6, 7, 8, 9], same), _seq([5, 6, 7, 8, 10], same[:4] + [[0, 2]]),
            _seq([5, 6, 7, 8, 9], other)]
    rows = trie_rows(seqs)
    assert tree_tokens(rows) == 2 + 4 + 3 and tree_tokens([s.tokens for s in seqs]) == 6
    tree = build_prefix_tree(rows)
    assert node_tokens(tree, seqs) == [5, 6, 7, 8, 9, 10, 7, 8, 9]
    assert tree.gather[0][:4] == tree.gather[1][:4] and tree.gather[2][:2] == tree.gather[0][:2]
    assert tree.gather[2][2] != tree.gather[0][2]
    total = 12   # three padding tokens (CP2's zigzag: a multiple of 4)
    routing = tree_routing(seqs, [4, 7, 2], tree, total, 1, 0)
    routed = routing.routed[0]
    for s, path in zip(seqs, tree.gather):
        assert torch.equal(routed[path].long(), s.extras["routed_experts"].long())
    assert routing.weight[0].tolist() == [3, 3, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0]
    nodes, seq_ids, positions = routing.members
    assert sorted(zip(seq_ids.tolist(), positions.tolist())) == sorted(
        (i, t) for i in (2, 4, 7) for t in range(5))
    # CP2: the two ranks' shards partition the natural row; dummies (-1) are no members
    halves = [tree_routing(seqs, [4, -1, 2], tree, total, 2, r) for r in (0, 1)]
    assert sorted(torch.cat([h.natural[0] for h in halves]).tolist()) == list(range(total))
    assert halves[0].members[1].tolist().count(7) == 0
    assert sum(float(h.weight.sum()) for h in halves) == 10.0
    # without routed experts: the token trie, no replay target
    plain = [_seq(s.tokens, None) for s in seqs]
    assert trie_rows(plain) == [s.tokens for s in seqs]
    assert tree_routing(plain, [0, 1, 2], build_prefix_tree(trie_rows(plain)), 8, 1, 0
                        ).routed is None
