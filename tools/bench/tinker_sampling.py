"""Sampling of the Tinker service (docs/tinker.md, "Sampling"): `--sampler hf` (the engine's
transformers generation backend) against `--sampler vllm` (vLLM, one LoRA adapter per sampling
session), both servers started one after the other by this script on the same model.

MODELS LoRA models (rank RANK on every linear and lm_head) of the official `tinker` SDK are each
saved for sampling; a round times (a) one session's `sample` of SAMPLES continuations of
NEW_TOKENS tokens after a PROMPT-token prompt, (b) the MODELS sessions' samples in flight at
once (vLLM batches them; the hf sampler runs them one after another), (c) MODELS requests of
one session (other prompts, as an RL loop sends a step's prompts) one after another and
(d) the same in flight at once (the service runs them as one generate call: engine.tinker
.service's sample batching). The median over REPEATS rounds after one warm-up. The model: tools.bench.tinker_batching's (a Qwen3-shaped fp32 model,
hidden 384; `--quick`: its small one).

    python -m tools.bench tinker_sampling [--quick] [--samplers hf,vllm] [--repeats N]
"""
from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from tools.bench.common import BenchResult, Table, fmt, free_port, median
from tools.bench.tinker_batching import KEY, MODEL, QUICK_MODEL, _start_server

MODELS = 4
RANK = 8
SAMPLES = 8
NEW_TOKENS = 64
PROMPT = 128
REPEATS = 3
SAMPLERS = ("hf", "vllm")


def _rounds(url: str, vocab: int, repeats: int, new_tokens: int) -> dict[str, list[float]]:
    """The timed rounds against one server (module docstring)."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    sessions = [sc.create_lora_training_client(base_model="model", rank=RANK, seed=i).result()
                .save_weights_and_get_sampling_client().result() for i in range(MODELS)]
    rng = random.Random(0)
    prompt = types.ModelInput.from_ints([rng.randrange(4, vocab) for _ in range(PROMPT)])
    prompts = [types.ModelInput.from_ints([rng.randrange(4, vocab) for _ in range(PROMPT)])
               for _ in range(MODELS)]
    times = {"one": [], "all": [], "requests_sequential": [], "requests_together": []}
    for r in range(repeats + 1):   # round 0: the warm-up
        params = types.SamplingParams(max_tokens=new_tokens, seed=r, stop=[])
        got = {}
        start = time.perf_counter()
        sessions[0].sample(prompt, SAMPLES, params).result()
        got["one"] = time.perf_counter() - start
        start = time.perf_counter()
        for f in [s.sample(prompt, SAMPLES, params) for s in sessions]:
            f.result()
        got["all"] = time.perf_counter() - start
        start = time.perf_counter()
        for p in prompts:
            sessions[0].sample(p, SAMPLES, params).result()
        got["requests_sequential"] = time.perf_counter() - start
        start = time.perf_counter()
        for f in [sessions[0].sample(p, SAMPLES, params) for p in prompts]:
            f.result()
        got["requests_together"] = time.perf_counter() - start
        if r:
            for k, v in got.items():
                times[k].append(v)
    return times


def run_tinker_sampling(quick: bool, samplers: tuple[str, ...], repeats: int) -> BenchResult:
    from tools.tiny_models import build_tiny_model

    shape = QUICK_MODEL if quick else MODEL
    new_tokens = 8 if quick else NEW_TOKENS
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_tinker_sampling_") as work:
        model_dir = build_tiny_model(str(Path(work, "model")), "qwen3", seed=0, **shape)
        for sampler in samplers:
            state = Path(work, sampler)
            state.mkdir()
            port = free_port()
            server = _start_server(model_dir, str(state), port, "hf",
                                   ("--sampler", sampler, "--sampler-max-lora-rank", str(RANK)))
            try:
                results[sampler] = _rounds(f"http://127.0.0.1:{port}", shape["vocab_size"],
                                           repeats, new_tokens)
            finally:
                server.terminate()
                server.wait(timeout=60)
    table = Table(
        f"Tinker sampling: {SAMPLES} x {new_tokens} tokens after a {PROMPT}-token prompt per "
        f"session, LoRA rank {RANK}, hidden {shape['hidden']}, median of {repeats} rounds",
        ["sampler", "one session (s)", f"{MODELS} sessions at once (s)",
         f"{MODELS} requests of one session, one after another (s)",
         "the same at once (s)"],
        [[s, *(fmt(median(t[k])) for k in ("one", "all", "requests_sequential",
                                            "requests_together"))]
         for s, t in results.items()])
    return BenchResult([table], {"tinker_sampling": {
        s: {"one_session_s": median(t["one"]), "all_sessions_s": median(t["all"]),
            "requests_sequential_s": median(t["requests_sequential"]),
            "requests_together_s": median(t["requests_together"])}
        for s, t in results.items()}})


def main(argv: list[str], prog: str = "python -m tools.bench tinker_sampling") -> int:
    """The item's own flags: prints the table and the summary (tools.bench.common.emit)."""
    import argparse

    from tools.bench.common import emit, quiet_libraries

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the small model, 8 new tokens (a smoke run)")
    parser.add_argument("--samplers", default=",".join(SAMPLERS),
                        help="comma-separated, from hf and vllm (default: both)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed rounds (default {REPEATS})")
    args = parser.parse_args(argv)
    samplers = tuple(args.samplers.split(","))
    if not samplers or any(s not in SAMPLERS for s in samplers):
        parser.error(f"--samplers {args.samplers}: choose from {', '.join(SAMPLERS)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    quiet_libraries()
    emit(run_tinker_sampling(args.quick, samplers, args.repeats))
    return 0
