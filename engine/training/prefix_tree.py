"""A micro-batch's rows merged into a tree by their token ids (prefix sharing,
docs/prefix-sharing.md).

Pure functions on lists of ints, no tensors, no process groups. Rows that begin with the same
tokens (a GRPO group's prompt, a DPO pair's prompt, an agent's history) are merged into a trie:
node = (parent node, token id); no metadata is assumed, identical prefixes share whatever their
origin. The tree is laid out in depth-first order (children in order of first appearance), so
every node follows all of its ancestors and a node's subtree is the contiguous span
[node, subtree_end[node]).

Contract of `build_prefix_tree(rows)` (T = number of tree nodes = distinct prefixes):
- `tokens[n]`: the token id of node n; `depth[n]`: its position in every row that contains it
  (rows share only prefixes, so that position is the same in each of them);
- `parent[n]`: the parent node (-1 for a root); `subtree_end[n]`: one past the last node of n's
  subtree, so b is an ancestor-or-self of a  <=>  b <= a < subtree_end[b];
- `gather[i][t]`: the node of row i's token t: tokens[gather[i][t]] == rows[i][t] and
  depth[gather[i][t]] == t;
- `segments`: bounds [0, ..., T] of the root subtrees (no token of one sees another);
- `runs`: the chains between branch points (RunSpan: queries [start, end), keys the spans of
  the run's ancestors then the run itself), the unit of the per-run attention
  (parallel.tree_attention).

One trie (`_Trie`) makes all of them: `build_prefix_tree`'s layout, `tree_tokens`' count and
the planning's running unit (`prefix_units`: rows sharing a prefix kept in one micro-batch, the
budget counted in tree tokens; `unshared_within_budget`: a micro-batch that runs unshared,
`worth_sharing` false, re-planned within the budget by the unshared planner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.training.batching import micro_batches_by_token_budget
from parallel.tree_attention_split import merge_spans


@dataclass(frozen=True)
class RunSpan:
    """One chain of the tree: nodes [start, end) each the only child of the one before.
    `keys`: the contiguous spans (a, b) of tree nodes the run's queries attend, ascending, the
    last one ending at `end` (the run itself, seen causally: lower-right aligned)."""
    start: int
    end: int
    keys: tuple[tuple[int, int], ...]


@dataclass
class PrefixTree:
    tokens: list[int]
    parent: list[int]
    depth: list[int]
    subtree_end: list[int]
    gather: list[list[int]]
    segments: list[int]
    runs: list[RunSpan]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def build_prefix_tree(rows: Sequence[Sequence[int]]) -> PrefixTree:
    """The trie of `rows` in depth-first layout (module docstring for the contract)."""
    trie = _Trie()
    paths = [trie.insert(row) for row in rows]
    roots, children, token_of = trie.roots, trie.children, trie.keys
    # depth-first order: children in order of first appearance (dict insertion order)
    order: list[int] = []
    stack = list(reversed(list(roots.values())))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(list(children[node].values())))
    dfs = [0] * len(order)
    for pos, node in enumerate(order):
        dfs[node] = pos
    n = len(order)
    tokens = [token_of[node] for node in order]
    parent = [-1] * n
    for node in order:
        for child in children[node].values():
            parent[dfs[child]] = dfs[node]
    depth = [0] * n
    for a in range(n):
        if parent[a] >= 0:
            depth[a] = depth[parent[a]] + 1
    size = [1] * n
    for a in range(n - 1, -1, -1):
        if parent[a] >= 0:
            size[parent[a]] += size[a]
    subtree_end = [a + size[a] for a in range(n)]
    segments = [0]
    for a in range(n):
        if parent[a] < 0 and a > 0:
            segments.append(a)
    if n:
        segments.append(n)
    gather = [[dfs[node] for node in path] for path in paths]
    return PrefixTree(tokens, parent, depth, subtree_end, gather, segments,
                      _runs(parent, children, order, dfs))


def _runs(parent: list[int], children: list[dict[int, int]], order: list[int],
          dfs: list[int]) -> list[RunSpan]:
    """The chains of the tree (a node starts a run when it is a root or its parent has more
    than one child or its parent is not the node before it), with their key spans."""
    n = len(parent)
    fanout = [len(children[node]) for node in order]
    starts = [a for a in range(n)
              if parent[a] < 0 or fanout[parent[a]] > 1 or parent[a] != a - 1]
    runs: list[RunSpan] = []
    run_of = [0] * n
    for r, (a, b) in enumerate(zip(starts, starts[1:] + [n])):
        for node in range(a, b):
            run_of[node] = r
        p = parent[a]
        if p < 0:
            keys: tuple[tuple[int, int], ...] = ((a, b),)
        else:   # the parent's run up to the parent, then that run's own ancestors
            parent_run = runs[run_of[p]]
            keys = parent_run.keys[:-1] + ((parent_run.keys[-1][0], p + 1), (a, b))
        runs.append(RunSpan(a, b, merge_spans(keys)))
    return runs


def shared_groups(rows: Sequence[Sequence[int]], min_fraction: float = 0.25,
                  min_tokens: int = 256) -> list[list[int]]:
    """Groups of row indices worth running as one tree: rows sorted by their tokens, a row
    joins the previous row's group when their common prefix covers at least `min_fraction` of
    the shorter of the two or at least `min_tokens` tokens (a GRPO group's prompt, a DPO
    pair's prompt, an agent's earlier turns; not a chat template's few header tokens). Each
    group is ascending; groups in order of their first row; every index appears once.
    Deterministic in `rows` alone."""
    order = sorted(range(len(rows)), key=lambda i: (list(rows[i]), i))
    groups: list[list[int]] = []
    prev = None
    for i in order:
        if prev is not None:
            shorter = min(len(rows[i]), len(rows[prev]))
            shared = common_prefix(rows[i], rows[prev])
            if shorter and (shared >= min_fraction * shorter or shared >= min_tokens):
                groups[-1].append(i)
                prev = i
                continue
        groups.append([i])
        prev = i
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# a micro-batch runs as a tree only when the tree saves at least this share of its tokens: below
# it the per-chain attention and the gather cost more than they save (docs/prefix-sharing.md)
MIN_SAVING = 0.1


def worth_sharing(tree_size: int, row_tokens: int) -> bool:
    """Whether a micro-batch of `row_tokens` tokens whose trie has `tree_size` nodes runs as a
    tree (MIN_SAVING)."""
    return tree_size <= (1.0 - MIN_SAVING) * row_tokens


def tree_tokens(rows: Sequence[Sequence[int]]) -> int:
    """Nodes of the trie of `rows` (tokens that run through the model when they share)."""
    trie = _Trie()
    for row in rows:
        trie.insert(row)
    return trie.size


def prefix_units(rows: Sequence[Sequence[int]], max_tokens: int | None,
                 units: Sequence[Sequence[int]] | None = None
                 ) -> tuple[list[list[int]], list[int]]:
    """(units, tree tokens of each unit) for planning a mini-batch with prefix sharing: the
    rows that share a prefix (`shared_groups`) kept together, a group split (in its sorted
    order, so that neighbours share most) where its tree would exceed `max_tokens` (null: no
    split). Given `units` (e.g. preference pairs that must stay together) are kept as they are
    and merged when they share a prefix. Deterministic in `rows` alone."""
    if units is None:
        base = [[i] for i in range(len(rows))]
    else:
        base = [list(u) for u in units]
    heads = [rows[u[0]] for u in base]
    out: list[list[int]] = []
    sizes: list[int] = []
    for group in shared_groups(heads):
        members = sorted(group, key=lambda g: (list(heads[g]), g))
        current, trie = [], _Trie()
        for g in members:
            grow = trie.growth([rows[i] for i in base[g]])
            if current and max_tokens and trie.size + grow > max_tokens:
                out.append(current)
                sizes.append(trie.size)
                current, trie = [], _Trie()
            current = current + base[g]
            for i in base[g]:
                trie.insert(rows[i])
        out.append(current)
        sizes.append(trie.size)
    return out, sizes


def unshared_within_budget(ranks: list[list[list[int]]], rows: Sequence[Sequence[int]],
                           units: Sequence[Sequence[int]] | None,
                           max_tokens: int) -> list[list[list[int]]]:
    """A plan made with tree tokens (`ranks[dp_rank][micro_batch]`: indices into `rows`, the
    trie's rows) in which every micro-batch that runs unshared (its trie saves too little,
    `worth_sharing`) and holds more than `max_tokens` row tokens is re-planned by the planner
    of the unshared path (batching.micro_batches_by_token_budget, first-fit decreasing over its
    `units`' row tokens; `units` null: single rows): its pieces take its place, each within
    `max_tokens` unless one unit exceeds it alone (as without sharing). Ranks left with fewer
    micro-batches than the most are topped up with empty ones (dummies, as plan_mini_batch's).
    A function of its arguments alone, so every rank makes the same plan of the global batch."""
    base = [list(u) for u in units] if units is not None else [[i] for i in range(len(rows))]
    unit_of = {i: u for u, members in enumerate(base) for i in members}
    out = []
    for micro_batches in ranks:
        mine = []
        for mb in micro_batches:
            total = sum(len(rows[i]) for i in mb)
            if total <= max_tokens or worth_sharing(tree_tokens([rows[i] for i in mb]), total):
                mine.append(mb)
                continue
            ids = list(dict.fromkeys(unit_of[i] for i in mb))
            lengths = [sum(len(rows[i]) for i in base[u]) for u in ids]
            mine += [[i for u in piece for i in base[u]]
                     for piece in micro_batches_by_token_budget(ids, lengths, max_tokens)]
        out.append(mine)
    count = max((len(m) for m in out), default=0)
    return [m + [[] for _ in range(count - len(m))] for m in out]


class _Trie:
    """Token rows merged by their prefixes: the one trie of this module (build_prefix_tree's
    layout, tree_tokens' count and prefix_units' running unit are all made of it). Nodes are
    numbered in order of creation; `keys[n]` is node n's token, `children[n]` its children
    {token: node} and `roots` the root nodes, both in order of first appearance (dict order)."""

    def __init__(self) -> None:
        self.roots: dict[int, int] = {}
        self.children: list[dict[int, int]] = []
        self.keys: list[int] = []

    @property
    def size(self) -> int:
        """Nodes of the trie (distinct prefixes inserted)."""
        return len(self.keys)

    def insert(self, row: Sequence[int]) -> list[int]:
        """The node of each token of `row`, creating those the trie lacks."""
        level, path, keys, children = self.roots, [], self.keys, self.children
        for tok in row:
            tok = int(tok)
            node = level.get(tok)
            if node is None:
                node = level[tok] = len(keys)
                keys.append(tok)
                children.append({})
            path.append(node)
            level = children[node]
        return path

    def growth(self, rows: Sequence[Sequence[int]]) -> int:
        """Nodes inserting `rows` would add (the trie unchanged): each row's tokens past its
        longest prefix already in the trie, merged with the other rows' that leave the trie
        at the same node."""
        leaving: dict[int, list] = {}   # node a row leaves the trie at (-1: the roots) -> rest
        for row in rows:
            level, node, depth = self.roots, -1, 0
            for tok in row:
                nxt = level.get(int(tok))
                if nxt is None:
                    break
                node, level, depth = nxt, self.children[nxt], depth + 1
            if depth < len(row):
                leaving.setdefault(node, []).append(row[depth:])
        return sum(len(rest[0]) if len(rest) == 1 else tree_tokens(rest)
                   for rest in leaving.values())
