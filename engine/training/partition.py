"""Token-balanced partition of a global batch over data-parallel ranks (docs/design/loss-math.md).

Pure functions on lists of per-sequence work estimates; no process groups. Every DP rank calls
`partition_balanced` on the same list (the lengths of the whole global batch) and gets the same
answer, so no communication is needed to agree on the split.

Contract of every partition function here: the result is a list of exactly `k` groups of item
indices; every index in `range(len(works))` appears exactly once; each group is sorted ascending;
the result is a deterministic function of `(works, k)`.
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import Sequence

# Relative margin an improvement must beat in the local-search pass (guards against float noise).
_REL_EPS = 1e-12


def sequence_work(length: int, a: float = 1.0, b: float = 1.0 / 4096) -> float:
    """Estimated compute of one sequence of `length` tokens: `a*L + b*L^2`.

    `a*L` stands for the linear layers (QKV/O projections, MLP, LM head): cost per token is
    independent of the length. `b*L^2` stands for causal attention (scores and weighted sum). In
    FLOPs, a dense decoder layer of hidden size h spends about 24 h^2 per token in linear layers
    and 2 L h per token in causal attention, i.e. `b/a ~ 1/(12 h)` (1/49152 for h = 4096). The
    default `b = 1/4096` says "at L = 4096 attention costs as much as the linear layers": it
    deliberately weighs attention more than the FLOP count, because attention kernels reach a lower
    fraction of peak than GEMMs and long sequences also carry activation-memory cost. Only ratios
    matter for balancing, so the unit is arbitrary.
    """
    if length < 0:
        raise ValueError(f"sequence length must be >= 0, got {length}")
    return a * length + b * length * length


def _check(works: Sequence[float], k: int) -> None:
    if k < 1:
        raise ValueError(f"number of groups k must be >= 1, got {k}")
    for i, w in enumerate(works):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"works[{i}] = {w!r}: every work must be finite and >= 0")


def _split_sizes(n: int, k: int) -> list[int]:
    """Sizes of a near-equal split of n items into k parts; the first n % k parts get one more."""
    base, extra = divmod(n, k)
    return [base + 1 if g < extra else base for g in range(k)]


def partition_contiguous(works: Sequence[float], k: int) -> list[list[int]]:
    """Baseline: contiguous split into k groups of near-equal count (first groups get the extra
    item), ignoring the works."""
    _check(works, k)
    groups, start = [], 0
    for size in _split_sizes(len(works), k):
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def partition_sorted_round_robin(works: Sequence[float], k: int) -> list[list[int]]:
    """Baseline: sort by work (descending, ties by index) and deal the items round-robin."""
    _check(works, k)
    order = sorted(range(len(works)), key=lambda i: (-works[i], i))
    groups: list[list[int]] = [[] for _ in range(k)]
    for rank, i in enumerate(order):
        groups[rank % k].append(i)
    return [sorted(g) for g in groups]


def imbalance(works: Sequence[float], groups: Sequence[Sequence[int]]) -> float:
    """Largest group work divided by the mean group work (over all `len(groups)` groups, empty
    ones included). 1.0 is perfect balance; 1.0 is also returned when the total work is 0."""
    loads = [sum(works[i] for i in g) for g in groups]
    total = sum(loads)
    if total <= 0:
        return 1.0
    return max(loads) / (total / len(loads))


def _karmarkar_karp(works: Sequence[float], k: int) -> list[list[int]]:
    """k-way largest differencing method (Karmarkar-Karp, 1982; k-way form of Michiels et al.).

    Every item starts as a k-tuple of partial groups (the item alone plus k-1 empty groups). The
    two tuples with the largest spread (max load - min load) are repeatedly combined by pairing the
    heaviest group of one with the lightest of the other, until one tuple remains.

    A tuple is stored as its non-empty groups only, as (load, indices) sorted heaviest first
    (equal loads: larger group first); the other k - len(parts) groups are implicitly empty. So
    early merges of single items cost O(1), and the whole run O(n k log k) at worst. Ties: the heap
    orders equal spreads by creation id (the item index for the initial tuples).

    Merging tuples with a and b non-empty groups leaves min(k, a + b) non-empty groups (empties
    are paired with the other tuple's non-empty groups first), so the result has min(k, n)
    non-empty groups, even when some works are 0.
    """
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(works):
        spread = float(w) if k > 1 else 0.0
        heap.append((-spread, i, [(float(w), [i])]))
    heapq.heapify(heap)
    next_id = len(works)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        a, b = len(first), len(second)
        # full tuples: first = first's parts then (k - a) empties (heaviest first);
        # second, lightest first = (k - b) empties then second's parts reversed. Positions
        # [a, k - b) are empty in both and stay empty.
        second_up = second[::-1]
        merged: list[tuple[float, list[int]]] = []
        for pos in [*range(a), *range(max(a, k - b), k)]:
            if pos < a and pos >= k - b:
                wa, ga = first[pos]
                wb, gb = second_up[pos - (k - b)]
                big, small = (ga, gb) if len(ga) >= len(gb) else (gb, ga)
                big.extend(small)  # both tuples are consumed: extend the larger list in place
                merged.append((wa + wb, big))
            elif pos < a:
                merged.append(first[pos])
            else:
                merged.append(second_up[pos - (k - b)])
        merged.sort(key=lambda p: (-p[0], -len(p[1])))
        low = merged[-1][0] if len(merged) == k else 0.0
        heapq.heappush(heap, (-(merged[0][0] - low), next_id, merged))
        next_id += 1
    parts = [g for _, g in heap[0][2]]
    return parts + [[] for _ in range(k - len(parts))]


def _best_exchange(heavy: list[tuple[float, int]], light: list[tuple[float, int]],
                   load_h: float, load_l: float) -> tuple[float, int | None, int | None]:
    """Best single move (heavy item -> light group) or swap (heavy item <-> light item).

    `heavy`/`light`: (work, index) lists sorted ascending. Returns (new max of the two loads,
    position in `heavy` or None, position in `light` or None); the pair's max is `load_h` when
    nothing helps. Moving work d from heavy to light gives max(load_h - d, load_l + d), best at
    d = (load_h - load_l) / 2; only 0 < d < load_h - load_l improves.
    """
    gap = load_h - load_l
    best = (load_h, None, None)
    light_works = [w for w, _ in light]
    for ph, (x, _) in enumerate(heavy):
        if 0 < x < gap:
            new_max = max(load_h - x, load_l + x)
            if new_max < best[0]:
                best = (new_max, ph, None)
        # swap: want y close to x - gap/2 with 0 < x - y < gap
        pos = bisect.bisect_left(light_works, x - gap / 2)
        for pl in (pos - 1, pos):
            if 0 <= pl < len(light):
                d = x - light_works[pl]
                if 0 < d < gap:
                    new_max = max(load_h - d, load_l + d)
                    if new_max < best[0]:
                        best = (new_max, ph, pl)
    return best


def _local_improvement(works: Sequence[float], groups: list[list[int]],
                       max_rounds: int) -> None:
    """In place: repeatedly take the heaviest group and, trying partners from the lightest up,
    apply the best move or swap that lowers the larger of the two loads. Every accepted step puts
    both loads strictly between the old ones, so the sum of squared loads strictly decreases and
    the loop terminates; `max_rounds` bounds its cost. No group is ever emptied: a move needs
    0 < x < load_h - load_l, impossible when x is the heavy group's only item; swaps keep counts."""
    k = len(groups)
    loads = [sum(works[i] for i in g) for g in groups]
    for _ in range(max_rounds):
        h = max(range(k), key=lambda g: (loads[g], -g))
        heavy = sorted((works[i], i) for i in groups[h])
        improved = False
        for p in sorted(range(k), key=lambda g: (loads[g], g)):
            if p == h or loads[p] >= loads[h]:
                break
            light = sorted((works[i], i) for i in groups[p])
            new_max, ph, pl = _best_exchange(heavy, light, loads[h], loads[p])
            if new_max < loads[h] - _REL_EPS * loads[h]:
                x, ix = heavy[ph]
                groups[h].remove(ix)
                groups[p].append(ix)
                loads[h] -= x
                loads[p] += x
                if pl is not None:
                    y, iy = light[pl]
                    groups[p].remove(iy)
                    groups[h].append(iy)
                    loads[h] += y
                    loads[p] -= y
                improved = True
                break
        if not improved:
            return


def partition_balanced(works: Sequence[float], k: int) -> list[list[int]]:
    """Split item indices into `k` groups minimising the largest total work.

    Karmarkar-Karp largest differencing, then a local-improvement pass (moves and swaps between
    the heaviest group and lighter ones). Deterministic; groups sorted ascending; every index once;
    a group is empty only when `len(works) < k`. Cost: O(n k log k) for the differencing, a few
    milliseconds for 8192 items over 64 groups plus the bounded local search.
    """
    _check(works, k)
    if not works:
        return [[] for _ in range(k)]
    groups = _karmarkar_karp(works, k)
    _local_improvement(works, groups, max_rounds=4 * k + 16)
    # order groups by their smallest index so the output does not depend on heap internals
    groups = [sorted(g) for g in groups]
    groups.sort(key=lambda g: (not g, g[0] if g else 0))
    return groups
