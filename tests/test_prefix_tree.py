"""Prefix sharing's pieces on one process (issue 91): the trie and its depth-first layout
(engine.training.prefix_tree), the tree attention and its CUDA inputs
(parallel.tree_attention), RoPE at tree depths (models.layers.attention.packed_rope), the tree
micro-batch and its one gather (engine.training.tree_batch), the plan's prefix units and the
config refusals (engine.config.prefix_sharing_settings). Each exactness check has a negative
control: a mask that lets a row see a sibling branch, positions counted along the tree row.
The model-level checks (SFT, GRPO at 1 process and at DP2, TP2+SP, PP2, CP2):
tests/test_prefix_sharing.py."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.config.prefix_sharing_settings import prefix_sharing_problems
from engine.training.loss_head import HiddenStates
from engine.training.micro_batches import SequenceData
from engine.training.prefix_tree import (build_prefix_tree, prefix_units, shared_groups,
                                         tree_tokens)
from engine.training.tree_batch import build_tree_micro_batch, unshared_output
from models.layers.attention import packed_rope
from models.layers.attention.rope_tables import megatron_bshd
from parallel import tree_attention as tree_attention_module
from parallel import tree_attention_split as tree_split_module
from parallel.tree_attention_split import split_tree_attention
from parallel import zigzag
from parallel.tree_attention import (dense_tree_attention, dense_tree_mask, flex_block_mask,
                                     flex_mask_mod, per_run_attention, tree_attention,
                                     tree_params)


def random_rows(seed: int, groups: int = 3, per_group: int = 4, vocab: int = 5):
    """Groups of rows sharing a random prefix; small vocabularies make accidental deeper
    sharing (and duplicates) likely."""
    rng = random.Random(seed)
    rows = []
    for _ in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
        for _ in range(per_group):
            rows.append(prefix + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))])
    rng.shuffle(rows)
    return rows


def brute_ancestors(tree, a: int) -> set[int]:
    out, node = set(), a
    while node >= 0:
        out.add(node)
        node = tree.parent[node]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_trie_layout_gather_depths_and_ancestors_against_brute_force(seed):
    rows = random_rows(seed)
    tree = build_prefix_tree(rows)
    distinct = {tuple(r[:t + 1]) for r in rows for t in range(len(r))}
    assert tree.num_tokens == len(distinct) == tree_tokens(rows)
    for row, idx in zip(rows, tree.gather):
        assert [tree.tokens[i] for i in idx] == row
        assert [tree.depth[i] for i in idx] == list(range(len(row)))
        assert all(tree.parent[b] == a for a, b in zip(idx, idx[1:]))
    mask = dense_tree_mask(tree.subtree_end)
    for a in range(tree.num_tokens):
        assert tree.parent[a] < a   # depth-first: ancestors first
        assert set(torch.nonzero(mask[a]).flatten().tolist()) == brute_ancestors(tree, a)
    roots = [a for a in range(tree.num_tokens) if tree.parent[a] < 0]
    assert tree.segments == roots + [tree.num_tokens]
    covered = [q for run in tree.runs for q in range(run.start, run.end)]
    assert covered == list(range(tree.num_tokens))
    for run in tree.runs:   # a run's keys: its first node's ancestors, then the run itself
        keys = [k for a, b in run.keys for k in range(a, b)]
        assert keys == sorted(brute_ancestors(tree, run.end - 1))


def per_row_attention(q, k, v, tree, scale):
    """Each row's causal SDPA on its own tokens, scattered back to the tree's nodes."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    for idx in tree.gather:
        g = torch.tensor(idx)
        qs, ks, vs = (x[g].transpose(0, 1)[None] for x in (q, k, v))
        out[g] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                scale=scale)[0].transpose(0, 1)
    return out


def _params(tree, pad: int = 0):
    total = tree.num_tokens + pad
    end = tree.subtree_end + [total] * pad
    bounds = tree.segments + ([total] if pad else [])
    depth = torch.tensor(tree.depth + list(range(pad)))
    return tree_params(bounds, end, tree.runs, depth, max(int(depth.max()) + 1, total))


# the CPU's split path (tree_attention with every set of sibling runs split / its pieces with
# none split: every run one call with a lower-right mask), and the per-run path of other devices with every run's key spans
# concatenated (waste 0) / read as one slice with its siblings masked (waste 100)
PATHS = {"split": (tree_attention, "SPLIT_MIN_KEYS", 0),
         "lower_right": (split_tree_attention, "SPLIT_MIN_KEYS", 10 ** 9),
         "per_run_concat": (per_run_attention, "MAX_SLICE_WASTE", 0.0),
         "per_run_slice": (per_run_attention, "MAX_SLICE_WASTE", 100.0)}


def _path(path: str, monkeypatch):
    fn, name, value = PATHS[path]
    module = tree_split_module if name == "SPLIT_MIN_KEYS" else tree_attention_module
    monkeypatch.setattr(module, name, value)
    return fn


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("seed", range(4))
def test_tree_attention_equals_each_rows_own_attention(seed, path, monkeypatch):
    fn = _path(path, monkeypatch)
    rows = random_rows(seed + 10)
    tree = build_prefix_tree(rows)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tree.num_tokens + 3, 4, 8, generator=gen, dtype=torch.float64)
               for _ in range(3))
    ours = fn(q, k, v, _params(tree, pad=3), 0.35)
    ref = per_row_attention(q[:-3], k[:-3], v[:-3], tree, 0.35)
    assert float((ours[:-3] - ref).abs().max()) < 1e-12
    dense = dense_tree_attention(q, k, v, tree.subtree_end + [tree.num_tokens + 3] * 3, 0.35)
    assert float((ours - dense).abs().max()) < 1e-12
    # negative control: causal attention over the whole tree row lets rows see siblings
    leaky = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)),
                                           is_causal=True, scale=0.35)[0].transpose(0, 1)
    assert float((leaky[:-3] - ref).abs().max()) > 1e-2


@pytest.mark.parametrize("path", ["split", "lower_right", "per_run_concat"])
@pytest.mark.parametrize("seed", [3, 4])
def test_tree_attention_backward_matches_rows(seed, path, monkeypatch):
    attention = _path(path, monkeypatch)
    rows = random_rows(seed)
    tree = build_prefix_tree(rows)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(tree.num_tokens, 2, 4, generator=gen, dtype=torch.float64)
            for _ in range(3)]
    w = torch.randn(tree.num_tokens, 2, 4, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (lambda q, k, v: attention(q, k, v, _params(tree), 0.5),
               lambda q, k, v: per_row_attention(q, k, v, tree, 0.5)):
        x = [t.clone().requires_grad_() for t in base]
        (fn(*x) * w).sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in x]))
    assert float((grads[0] - grads[1]).abs().max()) < 1e-12


class _Group:
    def __init__(self, size=1, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_rope_takes_each_tokens_position_in_its_own_row():
    rows = random_rows(4)
    tree = build_prefix_tree(rows)
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(tree.num_tokens, 2, 8, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(64).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    params = _params(tree)
    ours = packed_rope.apply_thd(t, params.cu_seqlens_q_padded, freqs, cp_group=_Group())
    bshd = megatron_bshd()
    for idx in tree.gather:   # each row alone, as the unshared path ropes it
        g = torch.tensor(idx)
        ref = bshd(t[g][:, None], freqs[:len(idx)])[:, 0]
        assert float((ours[g] - ref).abs().max()) < 1e-6
    # negative control: positions counted along the tree row
    along = tree_params(tree.segments, tree.subtree_end, tree.runs,
                        torch.arange(tree.num_tokens), 64)
    wrong = packed_rope.apply_thd(t, along.cu_seqlens_q_padded, freqs, cp_group=_Group())
    assert float((wrong - ours).abs().max()) > 1e-2


def test_flex_inputs_are_the_dense_mask():
    rows = random_rows(5)
    tree = build_prefix_tree(rows)
    n = tree.num_tokens
    end = torch.tensor(tree.subtree_end)
    qi, ki = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(flex_mask_mod(end)(0, 0, qi, ki), dense_tree_mask(tree.subtree_end))
    block = flex_block_mask(_params(tree), "cpu", block_size=4)
    dense = dense_tree_mask(tree.subtree_end)
    blocks = block.to_dense()[0, 0].bool()   # [n/4, n/4] blocks holding any visible pair
    pad = -(-n // 4) * 4
    padded = torch.zeros(pad, pad, dtype=torch.bool)
    padded[:n, :n] = dense
    any_visible = padded.view(pad // 4, 4, pad // 4, 4).any(dim=3).any(dim=1)
    assert torch.equal(blocks, any_visible)


def seqs_of(rows):
    return [SequenceData(r, r[1:] + [0], [1] * len(r), 1.0) for r in rows]


@pytest.mark.parametrize("cp", [1, 2])
def test_tree_micro_batch_gathers_every_rows_tokens(cp):
    rows = random_rows(6)
    seqs = seqs_of(rows)
    multiple = 2 * cp if cp > 1 else 1
    per_rank = [build_tree_micro_batch(seqs, list(range(len(seqs))), multiple, None, cp, r)
                for r in range(cp)]
    total = per_rank[0].tree.row_length
    assert total % multiple == 0 and per_rank[0].tree.num_tokens == tree_tokens(rows)
    full_tokens = zigzag.unshard([m.tree.tokens for m in per_rank], [total], cp)[0]
    full_depth = zigzag.unshard([m.tree.position_ids for m in per_rank], [total], cp)[0]
    for mb in per_rank:   # the gathered tree tokens are the unshared layout's own tokens
        real = mb.seq_ids[0] >= 0
        assert torch.equal(full_tokens[mb.tree.gather][real], mb.tokens[0][real])
        assert torch.equal(full_depth[mb.tree.gather][real], mb.position_ids[0][real])


def test_gather_sums_a_shared_tokens_gradient_over_its_rows():
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7]]
    mb = build_tree_micro_batch(seqs_of(rows), [0, 1, 2], 1, None, 1, 0)
    hidden = torch.randn(1, mb.tree.row_length, 3, requires_grad=True)
    out = unshared_output(HiddenStates(hidden, torch.zeros(1), 4), mb.tree)
    assert out.hidden.shape == (1, 10, 3)
    out.hidden.sum().backward()
    # node of token 5 (and 6) sits in 3 rows, 7 in 2, 8 and 9 in 1
    assert hidden.grad[0, :, 0].tolist() == [3.0, 3.0, 2.0, 1.0, 1.0]


def test_prefix_units_keep_groups_together_and_split_by_budget():
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(40)] for _ in range(3)]
    rows = [p + [rng.randrange(100) for _ in range(rng.randint(1, 10))] for p in prompts
            for _ in range(4)]
    groups = shared_groups(rows)
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    units, sizes = prefix_units(rows, None)
    assert sorted(map(sorted, units)) == sorted(map(sorted, groups))
    assert sizes == [tree_tokens([rows[i] for i in u]) for u in units]
    units, sizes = prefix_units(rows, 60)   # one prompt + a few replies per unit
    assert sorted(i for u in units for i in u) == list(range(12))
    assert all(s <= 60 or len(u) == 1 for u, s in zip(units, sizes))
    assert len(units) > 3
    # a chat header of a few tokens is not a shared prefix worth grouping
    short = [[1, 2, 3] + [rng.randrange(4, 100) for _ in range(30)] for _ in range(4)]
    assert sorted(shared_groups(short)) == [[0], [1], [2], [3]]


def test_trie_growth_is_the_nodes_the_rows_add():
    """prefix_tree._Trie.growth (prefix_units' running unit): the nodes inserting several rows
    would add, rows that continue from the same node merged, the trie unchanged."""
    from engine.training.prefix_tree import _Trie

    for seed in range(4):
        rows = random_rows(seed + 40)
        trie = _Trie()
        for a in range(0, len(rows), 3):
            unit = rows[a:a + 3]
            size = trie.size
            grow = trie.growth(unit)
            assert trie.size == size
            assert grow == tree_tokens(rows[:a + 3]) - tree_tokens(rows[:a])
            for row in unit:
                trie.insert(row)


def _cfg(**over):
    train = SimpleNamespace(prefix_sharing=True, compile=over.pop("compile", "false"))
    parallel = SimpleNamespace(cp=over.pop("cp", 1), cp_comm_type=over.pop("comm", "a2a"))
    model = SimpleNamespace(hf_path="/m", mtp=SimpleNamespace(enabled=over.pop("mtp", False)))
    return SimpleNamespace(train=train, parallel=parallel, model=model)


@pytest.mark.parametrize("model_type,word", [
    ("qwen3_5", "Gated DeltaNet"), ("qwen3_vl", "images")])
def test_refused_families_are_named(model_type, word):
    problems = prefix_sharing_problems(_cfg(), {"model_type": model_type})
    assert len(problems) == 1 and "train.prefix_sharing=true" in problems[0]
    assert word in problems[0]


def test_refused_settings_and_accepted_dense_models():
    assert prefix_sharing_problems(_cfg(), {"model_type": "qwen3"}) == []
    off = _cfg()
    off.train.prefix_sharing = False
    assert prefix_sharing_problems(off, {"model_type": "qwen3_5"}) == []
    # train.compile shares (tests/test_prefix_sharing_compile.py): not refused
    assert prefix_sharing_problems(_cfg(compile="true"), {"model_type": "qwen3"}) == []
    for over, word in ((dict(mtp=True), "model.mtp.enabled"),
                       (dict(cp=2, comm="p2p"), "parallel.cp_comm_type")):
        problems = prefix_sharing_problems(_cfg(**over), {"model_type": "llama"})
        assert len(problems) == 1 and word in problems[0]
    # sinks and sliding windows share (tests/test_prefix_sharing_sinks.py)
    assert prefix_sharing_problems(_cfg(), {"model_type": "gpt_oss"}) == []
    assert prefix_sharing_problems(
        _cfg(), {"model_type": "qwen2", "use_sliding_window": True}) == []


def test_rows_sharing_too_little_run_unshared():
    """A micro-batch whose trie saves less than MIN_SAVING of its tokens runs as the plain
    packed rows (no tree); with a fixed shape (pipeline parallelism) it stays a tree."""
    rows = [[1, 2] + [10 + i] * 18 for i in range(3)]   # share 2 of 20 tokens each
    plain = build_tree_micro_batch(seqs_of(rows), [0, 1, 2], 1, None, 1, 0)
    assert plain.tree is None and plain.tokens.shape == (1, 60)
    fixed = build_tree_micro_batch(seqs_of(rows), [0, 1, 2], 1, 64, 1, 0)
    assert fixed.tree is not None and fixed.tree.row_length == 64
    assert fixed.tree.num_tokens == 56


def test_cli_refuses_before_any_process_group(tmp_path):
    """`python -m engine.sft ... train.prefix_sharing=true` with settings it cannot share
    under: exit code 2, one report naming the keys, before torch.distributed starts
    (tests.launch.run_main fails the case otherwise). Negative control: the same run without
    sharing gets past the check (and would start the process groups)."""
    import json as json_lib

    from engine.sft.__main__ import main
    from tests.launch import run_main
    from tools.tiny_models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), "qwen3_moe", hidden=64, layers=2,
                             heads=8, kv_heads=2, intermediate=64)
    data = tmp_path / "train.jsonl"
    data.write_text(json_lib.dumps({"messages": [
        {"role": "user", "content": "what is 1 + 2 ?"},
        {"role": "assistant", "content": "the answer is 3"}]}) + "\n")
    base = [f"model.hf_path={model}", f"data.train_files=[{data}]", "train.seq_length=32",
            "train.global_batch_size=2", "train.max_steps=1", "logging.progress_bar=false",
            f"logging.dir={tmp_path}/log", "moe.capacity_factor=1.5"]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = run_main(main, base + ["train.prefix_sharing=true"], env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    report = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(report) == 1 and "train.prefix_sharing=true" in report[0] \
        and "moe.capacity_factor" in report[0], proc.stderr[-2000:]
    with pytest.raises(AssertionError, match="start torch.distributed"):
        run_main(main, base, env)


def _budget_rows():
    """Rows 0 and 1 share 4 of their 12 tokens (their tree: 20 of 24), row 2 shares nothing
    (20 tokens): planned by tree tokens, all three fit a 40-token budget (20 + 20), but
    together they save 4 of 44 tokens (under MIN_SAVING) and run unshared: 44 tokens."""
    return [[1, 2, 3, 4] + [10 + i] * 8 for i in range(2)] + [[50 + t for t in range(20)]]


@pytest.mark.parametrize("dp", [1, 2])
def test_unshared_fallback_is_replanned_within_the_token_budget(dp):
    """A micro-batch that falls back to its unshared rows (its tree saves under 10 %) is
    re-planned by the unshared planner: every micro-batch of every rank runs at most
    train.max_tokens_per_micro_batch tokens, every rank runs the same count, and every row is
    planned once. (Before: the three rows ran as one 44-token micro-batch against 40.)"""
    from engine.training.rank_batch import build_rank_batch

    budget = 40
    rows = _budget_rows()
    if dp == 2:   # a second rank's rows: a group that shares well (a tree of 22 of 40 tokens)
        rows += [[7, 8, 9, 11] * 4 + [20 + i] * 4 for i in range(2)]
    seqs = seqs_of(rows)
    cfg = SimpleNamespace(micro_batch_size=1, max_tokens_per_micro_batch=budget,
                          balance_dp=True, packing=True, prefix_sharing=True)
    counts, planned = set(), []
    for rank in range(dp):
        layout = dict(dp=dp, dp_rank=rank, cp=1, cp_rank=0, tp=1, pp=1, vpp=1, dp_group=None)
        rb = build_rank_batch(seqs, torch.ones(len(seqs), dtype=torch.float64), cfg,
                              layout=layout)
        counts.add(len(rb.micro_batches))
        planned += rb.positions
        for mb in rb.micro_batches:
            run = mb.tree.num_tokens if mb.tree is not None else mb.num_tokens
            assert run <= budget, (rank, run, rb.plan.ranks)
    assert len(counts) == 1 and sorted(planned) == list(range(len(rows)))


def test_unshared_fallback_keeps_given_units_whole():
    """unshared_within_budget re-plans over the given units (a DPO pair stays in one
    micro-batch); a micro-batch within the budget, or one that runs as a tree, is kept."""
    from engine.training.prefix_tree import unshared_within_budget

    rows = [[1, 2, 3, 4] + [10 + i] * 8 for i in range(2)] + [[50 + t for t in range(20)]]
    rows += [[90 + t for t in range(6)], [70 + t for t in range(6)]]   # a pair of 12 tokens
    pieces = unshared_within_budget([[[0, 1, 2, 3, 4]]], rows, [[0], [1], [2], [3, 4]], 40)
    assert sorted(i for mb in pieces[0] for i in mb) == [0, 1, 2, 3, 4]
    assert all(sum(len(rows[i]) for i in mb) <= 40 for mb in pieces[0])
    assert any({3, 4} <= set(mb) for mb in pieces[0]), pieces
    assert unshared_within_budget([[[0, 1]], [[2]]], rows, None, 20) == [[[0, 1]], [[2]]]
    assert unshared_within_budget([[[0, 1, 2]], [[]]], rows, None, 44) == [[[0, 1, 2]], [[]]]
