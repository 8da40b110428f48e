"""A lone request: `serve --backend vllm` against vLLM's own OpenAI server, side by side
(docs/benchmarks.md, "A lone request: serve against vLLM's server": the
goal is serve / vLLM <= GOAL in seconds per request).

Both servers run as processes of their own, one after the other started and then kept up
together, on the same local checkpoint in float32 with the same --max-model-len and KV cache
bytes, both compiled (vLLM's default and serve's) or both eager (`--eager`), each with vLLM's
own CPU thread binding ("auto"; serve keeps it: engine.generation.vllm.process.cpu_bind) and
this process's environment. The model: tools.tiny_models.build_eos_model (hidden HIDDEN,
2 layers, 4 heads of 128 dims, eos_boost 0), the one of `serve_load`. The request: one
completion of PROMPT's ids with max_tokens NEW_TOKENS at temperature 0, sent alone (nothing
else runs on either server) with httpx, timed from the send to the whole answer; the prompt is
the first of PROMPTS whose greedy reply on vLLM's server runs its max_tokens without eos, and
both servers must return the same reply (checked: else the run is refused, the comparison
needs the same work). After WARMUP requests each, REPEATS rounds alternate the order
(vLLM first, then serve first, ...), so a change of the host's load meets both alike.

Reported: per server the median seconds per request and its spread (the quartiles, min and
max), the ratio of the medians, and per round the ratio of that round's two requests, whose
quartiles are the ratio's spread. `verdict` judges GOAL against that spread: "met" when the
upper quartile of the per-round ratios is <= GOAL, "missed" when the lower quartile is above
it, else "within the spread".

    python -m tools.bench serve_vs_vllm [--quick] [--eager] [--repeats N] [--new-tokens N]

--quick: 5 rounds (a smoke run). A server start costs one to two minutes on a 2-core host and
is not counted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.common import BenchResult, Table, fmt, ratio_verdict, spread, timed_post
from tools.bench.serve_load import KV_BYTES, _wait_up

HIDDEN, MAX_CONTEXT, NEW_TOKENS, REPEATS, QUICK_REPEATS, WARMUP = 512, 512, 64, 21, 5, 3
GOAL = 1.2
PROMPTS = [[10 + k, 11, 12, 13 + k] for k in range(16)]
PORTS = {"vllm": 8141, "serve": 8142}
LABELS = {"vllm": "vLLM's OpenAI server", "serve": "serve --backend vllm"}


def commands(model: str, eager: bool) -> dict[str, list[str]]:
    """Each server's command line (module docstring: the same length, KV bytes, compile)."""
    eager_flag = ["--enforce-eager"] if eager else []
    return {
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--port", str(PORTS["vllm"]), "--dtype", "float32",
                 "--served-model-name", "tiny", "--max-model-len", str(MAX_CONTEXT),
                 "--kv-cache-memory-bytes", str(KV_BYTES), *eager_flag],
        "serve": [sys.executable, "-m", "engine.serve", "--model", model, "--backend", "vllm",
                  "--port", str(PORTS["serve"]), "--dtype", "float32",
                  "--served-model-name", "tiny", "--max-context", str(MAX_CONTEXT),
                  "--max-tokens", str(NEW_TOKENS), "--quiet", *eager_flag]}


def body(prompt: list[int], new_tokens: int) -> dict:
    """The lone request (greedy, so both servers give the same reply)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0}


def order(round_index: int) -> tuple[str, str]:
    """Which server goes first in a round: vLLM in even rounds, serve in odd ones."""
    return ("vllm", "serve") if round_index % 2 == 0 else ("serve", "vllm")


def verdict(pair_ratios: list[float], goal: float = GOAL) -> str:
    """GOAL judged against the per-round ratios' spread (module docstring)."""
    return ratio_verdict(pair_ratios, goal)


def pick_prompt(client, url: str, new_tokens: int) -> list[int]:
    """The first of PROMPTS whose greedy reply runs `new_tokens` (module docstring)."""
    for prompt in PROMPTS:
        _, reply = timed_post(client, url, body(prompt, new_tokens))
        if reply["usage"]["completion_tokens"] == new_tokens:
            return prompt
    raise RuntimeError(f"every prompt of PROMPTS ends at eos before {new_tokens} tokens")


def _start(name: str, argv: list[str], folder: str) -> tuple[subprocess.Popen, float]:
    log = Path(folder) / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        return proc, _wait_up(f"http://127.0.0.1:{PORTS[name]}", proc, log)
    except BaseException:
        proc.terminate()
        raise


def measure(model: str, eager: bool, repeats: int, new_tokens: int, folder: str) -> dict:
    """Both servers up; the prompt picked on vLLM's; warm-up; `repeats` alternating rounds;
    both stopped. {"seconds": {name: [s per round]}, "prompt", "start_s": {name: s}}."""
    import httpx

    procs, starts = {}, {}
    urls = {n: f"http://127.0.0.1:{p}/v1/completions" for n, p in PORTS.items()}
    try:
        for name, argv in commands(model, eager).items():
            procs[name], starts[name] = _start(name, argv, folder)
        with httpx.Client() as client:
            prompt = pick_prompt(client, urls["vllm"], new_tokens)
            payload = body(prompt, new_tokens)
            texts = {n: timed_post(client, u, payload)[1]["choices"][0]["text"]
                     for n, u in urls.items()}
            if texts["vllm"] != texts["serve"]:
                raise RuntimeError(f"the servers' greedy replies differ: {texts}")
            for _ in range(WARMUP):
                for url in urls.values():
                    timed_post(client, url, payload)
            seconds: dict[str, list[float]] = {n: [] for n in urls}
            for i in range(repeats):
                for name in order(i):
                    s, reply = timed_post(client, urls[name], payload)
                    if reply["usage"]["completion_tokens"] != new_tokens:
                        raise RuntimeError(f"{name}: {reply['usage']} (asked {new_tokens})")
                    seconds[name].append(s)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=120)
    return {"seconds": seconds, "prompt": prompt, "start_s": starts}


def build_model(folder: str) -> str:
    """serve_load's model, its context cut to MAX_CONTEXT."""
    from tools.tiny_models import build_eos_model

    model = build_eos_model(f"{folder}/llama", hidden=HIDDEN, eos_boost=0.0)
    config = json.loads((Path(model) / "config.json").read_text())
    (Path(model) / "config.json").write_text(json.dumps(
        {**config, "max_position_embeddings": MAX_CONTEXT}))
    return model


def report(res: dict, eager: bool, new_tokens: int, load: tuple[float, float]) -> BenchResult:
    """The table and summary of `measure`'s result (module docstring)."""
    sec = res["seconds"]
    stats = {n: spread(v) for n, v in sec.items()}
    pairs = [s / v for s, v in zip(sec["serve"], sec["vllm"])]
    pair = spread(pairs)
    ratio = stats["serve"]["median"] / stats["vllm"]["median"]
    judged = verdict(pairs)
    rows = [[LABELS[n], fmt(st["median"]), f"{fmt(st['q1'])}-{fmt(st['q3'])}",
             f"{fmt(st['min'])}-{fmt(st['max'])}", fmt(res["start_s"][n], 1)]
            for n, st in stats.items()]
    mode = "eager" if eager else "compiled"
    notes = [f"One request at a time, {new_tokens} new tokens at temperature 0 (the same reply "
             f"from both: checked), {len(pairs)} rounds alternating which server goes first, "
             f"after {WARMUP} warm-up requests each; both {mode}. serve / vLLM: ratio of the "
             f"medians {ratio:.3f}; per-round ratios median {pair['median']:.3f}, quartiles "
             f"{pair['q1']:.3f}-{pair['q3']:.3f}; goal <= {GOAL}: {judged}. Host load average "
             f"(1 min) at the start {load[0]:.2f}, at the end {load[1]:.2f}."]
    summary = {"serve_over_vllm_lone_s": ratio, "pair_ratio_median": pair["median"],
               "pair_ratio_q1": pair["q1"], "pair_ratio_q3": pair["q3"], "verdict": judged,
               "rounds": len(pairs), "new_tokens": new_tokens, "eager": eager,
               "load_avg_1m_start": round(load[0], 2), "load_avg_1m_end": round(load[1], 2),
               "seconds_vllm": [round(x, 4) for x in sec["vllm"]],
               "seconds_serve": [round(x, 4) for x in sec["serve"]],
               **{f"{k}_s_{n}": st[k] for n, st in stats.items() for k in ("median", "q1",
                                                                            "q3")}}
    return BenchResult([Table("A lone request: serve against vLLM's own server",
                              ["server", "median s", "quartiles s", "min-max s",
                               "start s (not counted)"], rows, notes)], summary)


def run_serve_vs_vllm(quick: bool, eager: bool = False, repeats: int | None = None,
                      new_tokens: int = NEW_TOKENS) -> BenchResult:
    folder = tempfile.mkdtemp(prefix="bench_serve_vs_vllm_")
    model = build_model(folder)
    load_start = os.getloadavg()[0]
    res = measure(model, eager, repeats or (QUICK_REPEATS if quick else REPEATS), new_tokens,
                  folder)
    return report(res, eager, new_tokens, (load_start, os.getloadavg()[0]))


def main(argv: list[str], prog: str = "python -m tools.bench serve_vs_vllm") -> int:
    """The item's own flags (tools.bench.__main__ hands it its arguments): prints the table and
    the summary (tools.bench.common.emit); exit status 0."""
    import argparse

    from tools.bench.common import emit, quiet_libraries

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEATS} rounds instead of {REPEATS} (a smoke run)")
    parser.add_argument("--eager", action="store_true",
                        help="both servers with --enforce-eager (default: both compiled)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (overrides --quick)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help=f"max_tokens of the request (default {NEW_TOKENS})")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    if not 0 < args.new_tokens < MAX_CONTEXT - max(map(len, PROMPTS)):
        parser.error(f"--new-tokens {args.new_tokens}: must be in [1, "
                     f"{MAX_CONTEXT - max(map(len, PROMPTS)) - 1}]")
    quiet_libraries()
    emit(run_serve_vs_vllm(args.quick, args.eager, args.repeats, args.new_tokens))
    return 0
