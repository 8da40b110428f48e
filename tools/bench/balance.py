"""Balancing quality and padding on long-tailed length distributions (no model, pure math).

For each distribution and DP size, `trials` global batches of `per_rank x dp` sequences are
drawn; the DP partition is measured as max/mean estimated work (`engine.training.partition.imbalance`
of `sequence_work` = L + L^2/4096) for three methods: ours (`partition_balanced`, Karmarkar-Karp
plus local search), a contiguous split (what a plain sampler does) and sorted round robin. The
lower bound is max(1, largest single sequence work / mean rank work): no partition can beat it.

Padding: the engine's planner (`engine.training.plan.plan_mini_batch`) splits each rank's sequences into
micro-batches, either packed (token budget, each sequence padded to a multiple of 2*cp, as
`engine.training.batching.pack_sequences` does) or padded (fixed count, every row padded to the longest
of its micro-batch, as `pad_batch` does). Ranks with fewer micro-batches than the most loaded
rank get dummy micro-batches of `pad_multiple` masked tokens (`engine.training.rank_batch`); they count as
padding. Padding fraction = padding tokens / all tokens processed.
"""
from __future__ import annotations

import math
import time

import numpy as np

from tools.bench.common import BenchResult, Table, fmt, median

DISTRIBUTIONS = ("lognormal", "mixture")
METHODS = ("balanced", "contiguous", "sorted_rr")
HEADLINE_DP = (8, 64)
PLOT_DP = (2, 4, 8, 16, 32, 64)
PER_RANK = 64                 # sequences per DP rank in a global batch (global batch = 64 x dp)
FIXED_BATCH = 512             # second scenario: one global batch size for every DP size
MAX_LEN = 16384


def sample_lengths(distribution: str, n: int, rng: np.random.Generator) -> list[int]:
    """`n` sequence lengths in tokens.

    lognormal: median 800, sigma 1.0, clipped to [16, 16384] (mean ~1300, p99 ~8200).
    mixture: 75% short chat (lognormal median 300, sigma 0.6, [16, 4096]) and 25% long
    reasoning traces (lognormal median 6000, sigma 0.5, [512, 16384])."""
    if distribution == "lognormal":
        lengths = np.clip(np.round(rng.lognormal(math.log(800), 1.0, n)), 16, MAX_LEN)
    elif distribution == "mixture":
        chat = rng.random(n) < 0.75
        short = np.clip(np.round(rng.lognormal(math.log(300), 0.6, n)), 16, 4096)
        long_ = np.clip(np.round(rng.lognormal(math.log(6000), 0.5, n)), 512, MAX_LEN)
        lengths = np.where(chat, short, long_)
    else:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {DISTRIBUTIONS}")
    return [int(x) for x in lengths]


def imbalances(lengths: list[int], dp: int) -> dict[str, float]:
    """max/mean work over `dp` ranks for each method, plus the lower bound."""
    from engine.training.partition import (imbalance, partition_balanced, partition_contiguous,
                                  partition_sorted_round_robin, sequence_work)

    works = [sequence_work(n) for n in lengths]
    out = {"balanced": imbalance(works, partition_balanced(works, dp)),
           "contiguous": imbalance(works, partition_contiguous(works, dp)),
           "sorted_rr": imbalance(works, partition_sorted_round_robin(works, dp))}
    out["lower_bound"] = max(1.0, max(works) / (sum(works) / dp))
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan_padding(lengths: list[int], dp: int, packing: bool, pad_multiple: int,
                 micro_batch_size: int, max_tokens: int | None) -> tuple[int, int]:
    """(padding tokens, real tokens) of the engine's plan for one global batch, all ranks.
    `max_tokens` set: micro-batches by token budget (first-fit decreasing), else by count."""
    from engine.training.plan import plan_mini_batch

    plan = plan_mini_batch(lengths, dp, True, micro_batch_size, max_tokens)
    pad = 0
    for rank in plan.ranks:
        for mb in rank:
            ls = [lengths[i] for i in mb]
            if not ls:  # a dummy micro-batch: pad_multiple masked tokens
                pad += pad_multiple
            elif packing:
                pad += sum(_round_up(n, pad_multiple) - n for n in ls)
            else:
                pad += _round_up(max(ls), pad_multiple) * len(ls) - sum(ls)
    return pad, sum(lengths)


# (label, packing, cp, micro_batch_size, max_tokens_per_micro_batch)
PADDING_CASES = (
    ("packed, token budget 16384, cp=1", True, 1, 1, 16384),
    ("packed, token budget 16384, cp=2", True, 2, 1, 16384),
    ("packed, token budget 16384, cp=8", True, 8, 1, 16384),
    ("padded, token budget 16384 rows x width", False, 1, 1, 16384),
    ("padded, 4 sequences per micro-batch", False, 1, 4, None),
)
HEADLINE_PADDING = 1          # PADDING_CASES index of the reported padding_fraction
PADDED_BASELINE = 4           # PADDING_CASES index of the padded baseline
PADDING_DP = 8


def _measure(dist: str, d_index: int, dp: int, n: int, trials: int, seed: int,
             padding: dict[str, list[float]] | None) -> dict[str, list[float]]:
    """Imbalance of every method (and the lower bound) over `trials` batches of `n` sequences;
    when `padding` is given, also appends each PADDING_CASES fraction to it."""
    per: dict[str, list[float]] = {m: [] for m in (*METHODS, "lower_bound")}
    for trial in range(trials):
        rng = np.random.default_rng([seed, d_index, dp, n, trial])
        lengths = sample_lengths(dist, n, rng)
        for k, v in imbalances(lengths, dp).items():
            per[k].append(v)
        for label, packing, cp, mbs, budget in (PADDING_CASES if padding is not None else ()):
            pad, real = plan_padding(lengths, dp, packing, 2 * cp if cp > 1 else 1, mbs, budget)
            padding[label].append(pad / (pad + real))
    return per


def run_balance(quick: bool, plot_path: str | None = None, seed: int = 0) -> BenchResult:
    """Run the whole balance benchmark (seconds; `quick` draws 5 batches per case, else 20)."""
    t0 = time.perf_counter()
    trials = 5 if quick else 20
    dps = sorted(set(HEADLINE_DP) | set(PLOT_DP))
    # per_rank[dist][dp] / fixed[dist][dp]: {method: [imbalance per trial]}
    per_rank: dict[str, dict[int, dict[str, list[float]]]] = {d: {} for d in DISTRIBUTIONS}
    fixed: dict[str, dict[int, dict[str, list[float]]]] = {d: {} for d in DISTRIBUTIONS}
    padding = {d: {c[0]: [] for c in PADDING_CASES} for d in DISTRIBUTIONS}
    for d_index, dist in enumerate(DISTRIBUTIONS):
        for dp in dps:
            per_rank[dist][dp] = _measure(dist, d_index, dp, PER_RANK * dp, trials, seed,
                                          padding[dist] if dp == PADDING_DP else None)
            fixed[dist][dp] = _measure(dist, d_index, dp, FIXED_BATCH, trials, seed, None)

    def rows_of(results, batch_of):
        return [[dist, str(dp), str(batch_of(dp))]
                + [fmt(median(results[dist][dp][m]), 4) for m in METHODS]
                + [fmt(max(results[dist][dp]["balanced"]), 4),
                   fmt(median(results[dist][dp]["lower_bound"]), 4),
                   fmt(max(o / b for o, b in zip(results[dist][dp]["balanced"],
                                                 results[dist][dp]["lower_bound"])), 4)]
                for dist in DISTRIBUTIONS for dp in HEADLINE_DP]

    headers = ["distribution", "DP", "global batch", "ours", "contiguous", "sorted round robin",
               "ours, worst batch", "lower bound", "ours / bound, worst"]
    balance_table = Table(
        f"DP balance, {PER_RANK} sequences per rank: max/mean work (median of {trials} batches)",
        headers, rows_of(per_rank, lambda dp: PER_RANK * dp),
        ["work = L + L^2/4096 (engine.training.partition.sequence_work); lower bound = max(1, largest "
         "sequence / mean rank work): no partition can do better."])
    fixed_table = Table(
        f"DP balance, fixed global batch {FIXED_BATCH} (few sequences per rank at DP 64)",
        headers, rows_of(fixed, lambda dp: FIXED_BATCH),
        [f"at DP 64 a rank gets {FIXED_BATCH // 64} sequences: a single long sequence can "
         "outweigh a whole rank's share, so the lower bound itself is above 1."])
    curve_rows = [[dist, scenario, str(dp)]
                  + [fmt(median(results[dist][dp][m]), 4) for m in (*METHODS, "lower_bound")]
                  for results, scenario in ((per_rank, f"{PER_RANK}/rank"),
                                            (fixed, f"batch {FIXED_BATCH}"))
                  for dist in DISTRIBUTIONS for dp in PLOT_DP]
    curve_table = Table("Balance against DP size (the plot's data; medians)",
                        ["distribution", "scenario", "DP", "ours", "contiguous",
                         "sorted round robin", "lower bound"], curve_rows)
    pad_rows = [[label] + [fmt(100 * median(padding[d][label]), 2) + " %" for d in DISTRIBUTIONS]
                for label, *_ in PADDING_CASES]
    padding_table = Table(
        f"Padding fraction at DP {PADDING_DP}, {PER_RANK} sequences per rank (median)",
        ["micro-batches (engine.training.plan)", *DISTRIBUTIONS], pad_rows,
        ["padding fraction = padding tokens / all tokens processed. Packed rows pad each "
         "sequence to a multiple of 2*cp (zigzag CP sharding); padded micro-batches pad every "
         "row to the longest of its micro-batch; dummy micro-batches of ranks with fewer "
         "micro-batches count as padding."])

    def worst_median(results, method):
        return max(median(results[d][dp][method]) for d in DISTRIBUTIONS for dp in HEADLINE_DP)

    headline, padded = PADDING_CASES[HEADLINE_PADDING][0], PADDING_CASES[PADDED_BASELINE][0]
    summary = {
        "balance_max_over_mean": worst_median(per_rank, "balanced"),
        "balance_worst_batch_max_over_mean": max(
            max(per_rank[d][dp]["balanced"]) for d in DISTRIBUTIONS for dp in HEADLINE_DP),
        "naive_balance_max_over_mean": worst_median(per_rank, "contiguous"),
        "sorted_rr_max_over_mean": worst_median(per_rank, "sorted_rr"),
        "fixed_batch_balance_max_over_mean": worst_median(fixed, "balanced"),
        "fixed_batch_lower_bound": worst_median(fixed, "lower_bound"),
        "padding_fraction": max(median(padding[d][headline]) for d in DISTRIBUTIONS),
        "padded_padding_fraction": max(median(padding[d][padded]) for d in DISTRIBUTIONS),
        "balance_trials": trials,
        "balance_seconds": time.perf_counter() - t0,
    }
    if plot_path:
        plot_balance(per_rank, fixed, plot_path)
        summary["balance_plot"] = str(plot_path)
    return BenchResult([balance_table, fixed_table, curve_table, padding_table], summary)


def plot_balance(per_rank: dict, fixed: dict, path: str) -> None:
    """Write a PNG of max/mean work against DP size: columns = distributions, rows = the two
    scenarios (PER_RANK sequences per rank; a fixed global batch of FIXED_BATCH); one line per
    method plus the lower bound (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"balanced": ("ours: engine.training.partition (Karmarkar-Karp + local search)", "-o"),
              "contiguous": ("contiguous split", "-s"),
              "sorted_rr": ("sorted round robin", "-^"),
              "lower_bound": ("lower bound (largest sequence alone)", ":")}
    scenarios = ((per_rank, f"{PER_RANK} sequences per rank"),
                 (fixed, f"global batch {FIXED_BATCH}"))
    fig, axes = plt.subplots(2, len(DISTRIBUTIONS), figsize=(11, 8), sharex=True)
    for row, (results, scenario) in enumerate(scenarios):
        for col, dist in enumerate(DISTRIBUTIONS):
            ax = axes[row][col]
            for method, (label, style) in styles.items():
                ys = [median(results[dist][dp][method]) for dp in PLOT_DP]
                ax.plot(PLOT_DP, ys, style, label=label, markersize=4,
                        color="black" if method == "lower_bound" else None)
            ax.set_xscale("log", base=2)
            ax.set_xticks(PLOT_DP, [str(d) for d in PLOT_DP])
            ax.set_title(f"{dist} lengths, {scenario}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if row == 1:
                ax.set_xlabel("data-parallel size")
            if col == 0:
                ax.set_ylabel("max / mean work per DP rank")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("DP balance (1 = perfect): median over random global batches", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
