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
