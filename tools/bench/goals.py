"""The benchmarks' goals (docs/benchmarks.md): each summary key's comparison and threshold,
judged on a run's summary and printed as a table."""
from __future__ import annotations

from tools.bench.common import Table

# key -> (comparison, threshold)
GOALS: dict[str, tuple[str, float]] = {
    "overhead_ratio": ("<=", 1.05),
    "balance_max_over_mean": ("<=", 1.02),
    "padding_fraction": ("<", 0.01),
    "generate_once_speedup": (">=", 3.0),
    "first_step_s_uncached": ("<=", 60.0),   # data: 20k chat rows, 2 ranks, empty cache
    "first_step_s_cached": ("<=", 20.0),
    "loss_head_sft_peak_gb": ("<=", 3.0),    # 8,192-token SFT step, vocab 151,936, chunked
    "async_step_time_ratio": ("<=", 0.6),
    "vllm_over_hf_tokens_per_s": (">=", 4.0),  # backends: same prompts, ~100M params    # step time s=1 / s=0, generation ~ training
    # trl: TRL seconds / engine seconds per step, the engine's defaults
    "trl_grpo_shared_speedup": (">=", 2.5),
    "trl_grpo_shared_prefix_off_speedup": (">=", 1.1),   # train.prefix_sharing=false
    "trl_grpo_distinct_speedup": (">=", 1.1),
    "trl_sft_speedup": (">=", 1.0),
    "trl_dpo_speedup": (">=", 1.0),
    # generate_vs_hf: transformers' generate seconds / the engine's generate seconds
    "generate_shared_speedup": (">=", 1.0),
    "generate_distinct_speedup": (">=", 1.0),
    # tinker: four models' concurrent forward_backward seconds / the same calls in turn
    "tinker_concurrent_over_sequential": ("<=", 0.5),
}


def goal_report(summary: dict) -> dict[str, dict]:
    """{key: {value, goal, met}} for every goal whose key is in `summary` (met is None when the
    value is None, i.e. the benchmark did not run)."""
    out = {}
    for key, (op, threshold) in GOALS.items():
        if key not in summary:
            continue
        value = summary[key]
        met = None if value is None else {"<=": value <= threshold, "<": value < threshold,
                                          ">=": value >= threshold}[op]
        out[key] = {"value": value, "goal": f"{op} {threshold}", "met": met}
    return out


def goals_table(goals: dict[str, dict]) -> Table:
    rows = [[k, "n/a" if g["value"] is None else f"{g['value']:.4f}", g["goal"],
             {True: "met", False: "MISSED", None: "not run"}[g["met"]]] for k, g in goals.items()]
    return Table("Goals", ["metric", "value", "goal", "status"], rows)
