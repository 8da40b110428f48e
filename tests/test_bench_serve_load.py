"""tools/bench/serve_load.py's pure parts (the benchmark itself starts two servers and is run by
hand: docs/benchmarks.md): the seeded workload both servers get, and the latency quantile."""
from __future__ import annotations

import numpy as np

from tools.bench import serve_load


def test_workload_is_seeded_and_in_range():
    a, b = serve_load.workload(16, 256), serve_load.workload(16, 256)
    assert a == b
    tokens = [j["body"]["max_tokens"] for j in a]
    assert min(tokens) >= serve_load.MIN_TOKENS and max(tokens) <= 256
    assert len(set(tokens)) > 8            # mixed lengths, not one budget
    assert all(0 <= j["at"] < serve_load.SPREAD_S for j in a)
    assert len({j["body"]["seed"] for j in a}) == 16
    assert serve_load.workload(16, 256, seed=1) != a     # control: the seed matters


def test_quantile_matches_numpy_linear():
    values = sorted(np.random.default_rng(0).exponential(size=17).tolist())
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert abs(serve_load.quantile(values, q) - np.quantile(values, q)) < 1e-12


def test_serve_vs_vllm_judges_the_goal_against_the_per_round_spread():
    """tools/bench/serve_vs_vllm.py's pure parts: the verdict reads the per-round ratios'
    quartiles (met: upper <= 1.2; missed: lower > 1.2; else within the spread), rounds
    alternate which server goes first, and both servers get the same length, KV bytes and
    compile mode (eager on both or neither)."""
    from tools.bench import serve_vs_vllm as sv

    assert sv.verdict([1.0, 1.05, 1.1, 1.15, 1.3]) == "met"            # q3 1.15
    assert sv.verdict([1.0, 1.1, 1.25, 1.3, 1.4]) == "within the spread"  # q1 1.1, q3 1.3
    assert sv.verdict([1.1, 1.25, 1.3, 1.4, 1.5]) == "missed"           # q1 1.25
    assert sv.spread([3.0, 1.0, 2.0, 4.0]) == {"median": 2.5, "q1": 1.75, "q3": 3.25,
                                               "min": 1.0, "max": 4.0}
    assert [sv.order(i)[0] for i in range(4)] == ["vllm", "serve", "vllm", "serve"]
    for eager in (False, True):
        cmds = sv.commands("/m", eager)
        assert all(("--enforce-eager" in c) == eager for c in cmds.values())
        assert cmds["vllm"][cmds["vllm"].index("--max-model-len") + 1] == \
            cmds["serve"][cmds["serve"].index("--max-context") + 1] == str(sv.MAX_CONTEXT)
        assert str(sv.KV_BYTES) in cmds["vllm"]   # serve's CPU default: 1 GiB (serve_load)
