"""Multi-LoRA batching of the Tinker service (docs/tinker.md, docs/benchmarks.md "Tinker:
four users at once"): MODELS LoRA training clients of the official `tinker` SDK send one
`forward_backward` each, concurrently (every call submitted, then every result awaited: the
service runs them as one batch through the base model) against the same calls one after
another (each result awaited before the next call). The goal: concurrent / sequential <= GOAL
in seconds per round.

The server is `python -m engine.tinker --backend BACKEND` in a process of its own (the command
users run; torch there uses the host's threads, this process only sends HTTP; `hf`, the
default: transformers' model, on the first GPU where there is one; `megatron`: the model built
by Megatron-Core on one rank, on CUDA where there is one), on a Qwen3-shaped fp32 model
with random weights (tools.tiny_models.build_tiny_model: MODEL; `--quick`: QUICK_MODEL), no
tokenizer downloads. Each call: DATUMS cross_entropy datums of TOKENS tokens (random ids,
weights 1; --datums, --tokens), LoRA rank RANK on every linear layer. After WARMUP rounds, REPEATS rounds
alternate the order (concurrent first, then sequential first, ...), so a change of the host's
load meets both alike; optim_step is not timed (it is per model and not batched).

Reported: per mode the median seconds per round and the quartiles, the ratio of the medians
and per round the ratio of that round's two timings (whose quartiles are the spread), and the
rows of the largest forward batch the service ran in each mode (the `batch_rows:max` metric
of the SDK's answers: MODELS x DATUMS when the concurrent calls ran as one batch, DATUMS one
after another). Summary keys: tinker_concurrent_over_sequential, tinker_ratio_quartiles,
tinker_batch_rows {concurrent, sequential}, tinker_verdict, tinker_backend, and the workload
tinker_models, tinker_datums, tinker_tokens (tools/bench/gpu/tinker_item.py checks the rows
against them).

    python -m tools.bench tinker [--quick] [--backend hf|megatron] [--repeats N] [--models M]
                                 [--datums D] [--tokens T]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import BenchResult, Table, fmt, free_port, median, ratio_verdict, spread

GOAL = 0.5
MODELS = 4
DATUMS = 4
TOKENS = 128
RANK = 8
WARMUP = 2
REPEATS = 10
QUICK_REPEATS = 3
MODEL = dict(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1152, head_dim=64,
             vocab_size=1024)
QUICK_MODEL = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, head_dim=32,
                   vocab_size=256)
KEY = "tml-bench"
BACKENDS = ("hf", "megatron")   # engine.tinker --backend (its `auto` is hf on one process)


def _start_server(model_dir: str, state_dir: str, port: int, backend: str,
                  extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m engine.tinker EXTRA --backend backend` on `model_dir`, waited for until it
    answers (its stdout and stderr to a log in `state_dir`, the end of it in the error if it
    exits first; killed if it never answers)."""
    from tools.bench.serve_load import _wait_up

    log = Path(state_dir) / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "engine.tinker", "--model", model_dir,
                             "--port", str(port), "--api-key", KEY, "--state-dir", state_dir,
                             *extra, "--backend", backend],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        _wait_up(f"http://127.0.0.1:{port}", proc, log, 300, "/api/v1/healthz")
    except RuntimeError:
        proc.kill()
        raise
    return proc


def _data(seed: int, vocab: int, datums: int, tokens: int) -> list:
    """`datums` cross_entropy datums of `tokens` random ids (targets: the next ids, weights
    1)."""
    import random

    from tinker import types

    rng = random.Random(seed)
    out = []
    for _ in range(datums):
        ids = [rng.randrange(4, vocab) for _ in range(tokens + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:],
                                               "weights": [1.0] * tokens}))
    return out


def _round(clients: list, data: list[list], concurrent: bool) -> tuple[float, float]:
    """One forward_backward per client, all submitted first (concurrent) or each awaited
    before the next; returns (seconds, largest batch_rows:max of the answers)."""
    start = time.perf_counter()
    if concurrent:
        futures = [c.forward_backward(d, "cross_entropy") for c, d in zip(clients, data)]
        outs = [f.result() for f in futures]
    else:
        outs = [c.forward_backward(d, "cross_entropy").result() for c, d in zip(clients, data)]
    seconds = time.perf_counter() - start
    return seconds, max(o.metrics["batch_rows:max"] for o in outs)


def run_tinker(quick: bool, repeats: int | None = None, models: int = MODELS,
               datums: int = DATUMS, tokens: int = TOKENS, backend: str = "hf") -> BenchResult:
    import tinker
    from tinker import types

    from tools.tiny_models import build_tiny_model

    shape = QUICK_MODEL if quick else MODEL
    repeats = repeats or (QUICK_REPEATS if quick else REPEATS)
    with tempfile.TemporaryDirectory(prefix="bench_tinker_") as work:
        model_dir = build_tiny_model(str(Path(work, "model")), "qwen3", seed=0, **shape)
        state = Path(work, "state")
        state.mkdir()
        port = free_port()
        server = _start_server(model_dir, str(state), port, backend)
        try:
            sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
            clients = [sc.create_lora_training_client(base_model="model", rank=RANK, seed=i)
                       .result() for i in range(models)]
            data = [_data(i, shape["vocab_size"], datums, tokens) for i in range(models)]
            for _ in range(WARMUP):
                _round(clients, data, True)
                _round(clients, data, False)
            times = {True: [], False: []}
            rows = {True: 0.0, False: 0.0}
            ratios = []
            for r in range(repeats):
                got = {}
                for concurrent in ((True, False) if r % 2 == 0 else (False, True)):
                    got[concurrent] = _round(clients, data, concurrent)
                for concurrent, (seconds, batch) in got.items():
                    times[concurrent].append(seconds)
                    rows[concurrent] = max(rows[concurrent], batch)
                ratios.append(got[True][0] / got[False][0])
            for c in clients:   # the models train (nothing else is checked here)
                c.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        finally:
            server.terminate()
            server.wait(timeout=60)
    ratio = median(times[True]) / median(times[False])
    per_round = spread(ratios)
    lo, hi = per_round["q1"], per_round["q3"]
    verdict = ratio_verdict(ratios, GOAL)
    stats = {c: spread(times[c]) for c in (True, False)}
    table = Table(
        f"Tinker ({backend} backend): {models} models' forward_backward, concurrent vs one "
        f"after another ({datums} x {tokens} tokens each, LoRA rank {RANK}, hidden "
        f"{shape['hidden']}, {repeats} rounds)",
        ["mode", "s per round (median)", "quartiles", "largest batch (rows)"],
        [[("concurrent" if c else "one after another"), fmt(stats[c]["median"]),
          f"{fmt(stats[c]['q1'])}-{fmt(stats[c]['q3'])}", f"{rows[c]:.0f}"]
         for c in (True, False)],
        notes=[f"concurrent / one after another: {ratio:.3f} (per-round quartiles "
               f"{lo:.3f}-{hi:.3f}); goal <= {GOAL}: {verdict}"])
    return BenchResult([table], {"tinker_concurrent_over_sequential": ratio,
                                 "tinker_ratio_quartiles": [lo, hi],
                                 "tinker_batch_rows": {"concurrent": rows[True],
                                                       "sequential": rows[False]},
                                 "tinker_verdict": verdict, "tinker_backend": backend,
                                 "tinker_models": models, "tinker_datums": datums,
                                 "tinker_tokens": tokens})


def main(argv: list[str], prog: str = "python -m tools.bench tinker") -> int:
    """The item's own flags (tools.bench.__main__ hands it its arguments): prints the table and
    the summary (tools.bench.common.emit); exit status 0."""
    import argparse

    from tools.bench.common import emit, quiet_libraries

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEATS} rounds on a smaller model (a smoke run)")
    parser.add_argument("--backend", choices=BACKENDS, default="hf",
                        help="the service's backend (engine.tinker --backend; default hf)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (overrides --quick)")
    parser.add_argument("--models", type=int, default=MODELS,
                        help=f"LoRA models sending at once (default {MODELS})")
    parser.add_argument("--datums", type=int, default=DATUMS,
                        help=f"datums per forward_backward call (default {DATUMS})")
    parser.add_argument("--tokens", type=int, default=TOKENS,
                        help=f"tokens per datum (default {TOKENS})")
    args = parser.parse_args(argv)
    if args.datums < 1 or not 1 <= args.tokens <= 480:
        parser.error(f"--datums {args.datums} must be >= 1 and --tokens {args.tokens} in "
                     "[1, 480] (the model's 512 positions)")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    if args.models < 2:
        parser.error(f"--models {args.models}: must be >= 2")
    quiet_libraries()
    emit(run_tinker(args.quick, args.repeats, args.models, args.datums, args.tokens,
                    args.backend))
    return 0
