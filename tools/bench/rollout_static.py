"""The HF rollout backend's eager loop against its static-cache and compiled decode paths
(rollout.hf.static_cache / rollout.hf.compile) on the CPU, tokens/s in one run: part of
`python -m tools.bench rollout` (tools/bench/rollout.py).

Three engines on the same checkpoint (the rollout bench's CASES), prompts and per-response
seeds, one generate call per rollout batch each: eager (static_cache=false), static
(static_cache=true, compile=false) and compiled (static_cache=true, compile=true: torch.compile's
default mode on a CPU). The first call of each is the warm-up (for the compiled engine: the
compilation of every shape bucket the batch meets) and is reported apart; then the variants
alternate over the timed repeats and tokens/s is generated tokens over the median wall time.
Every call of a repeat uses the same seeds, so the three engines sample the same tokens; the
table says whether they did and the largest log-prob difference from eager.
"""
from __future__ import annotations

import time

from tools.bench.common import Table, fmt, median

VARIANTS = {"eager": dict(static_cache=False, compile=False),
            "static": dict(static_cache=True, compile=False),
            "compiled": dict(static_cache=True, compile=True)}


def time_engines(model_dir: str, prompts: list[list[int]], seeds: list[int], max_new: int,
                 repeats: int) -> dict[str, dict]:
    """Per variant: first-call seconds, timed seconds and tokens, and per repeat whether its
    tokens equal eager's and the largest |log-prob - eager's|."""
    from engine.generation import SamplingParams
    from engine.generation.hf.backend import HFRolloutEngine

    engines = {name: HFRolloutEngine(model_dir, device="cpu", **kw)
               for name, kw in VARIANTS.items()}
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seeds=seeds)
    out = {name: {"first_s": 0.0, "times": [], "tokens": [], "same": True, "diff": 0.0}
           for name in VARIANTS}
    for i in range(repeats + 1):
        order = list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]
        gens = {}
        for name in order:
            start = time.perf_counter()
            gens[name] = engines[name].generate(prompts, params)
            elapsed = time.perf_counter() - start
            if i == 0:
                out[name]["first_s"] = elapsed
            else:
                out[name]["times"].append(elapsed)
                out[name]["tokens"].append(sum(len(g.response_ids) for g in gens[name]))
        for name in VARIANTS:
            pairs = list(zip(gens[name], gens["eager"]))
            out[name]["same"] &= all(g.response_ids == e.response_ids for g, e in pairs)
            out[name]["diff"] = max([out[name]["diff"]] + [
                abs(a - b) for g, e in pairs
                for a, b in zip(g.response_logprobs, e.response_logprobs)])
    return out


def static_table(rows: list[list[str]], responses: int) -> Table:
    """The comparison table of `rows` (static_rows)."""
    return Table(
        "HF rollout backend: eager loop vs static KV cache vs compiled decode step (CPU)",
        ["model", "max new tokens", "variant", "first call s", "median s", "tokens/s",
         "vs eager", "same tokens", "max |logprob diff|"], rows,
        [f"{responses} responses in one generate call per repeat, per-response seeds, "
         "temperature 1; first call = warm-up (compiled: every shape bucket's compilation); "
         "timed repeats alternate the order of the variants. static = "
         "rollout.hf.static_cache=true compile=false; compiled = static_cache=true "
         "compile=true (torch.compile default mode on CPU)."])


def static_rows(label: str, max_new: int, result: dict
                ) -> tuple[list[list[str]], dict[str, float]]:
    """Table rows of one case and its tokens/s ratios vs eager."""
    rate = {n: median(r["tokens"]) / median(r["times"]) for n, r in result.items()}
    rows = [[label, str(max_new), name, fmt(r["first_s"], 2), fmt(median(r["times"]), 3),
             fmt(rate[name], 0), fmt(rate[name] / rate["eager"], 2) + "x",
             "yes" if r["same"] else "NO", f"{r['diff']:.1e}"]
            for name, r in result.items()]
    return rows, {n: rate[n] / rate["eager"] for n in result if n != "eager"}
