"""Packed chat rows of real, varied lengths through the engine's compiled step, beside the
same tokens in transformers (the `packed` item of `python -m tools.bench gpu`, docs/benchmarks.md).

    python -m tools.bench.gpu_packed --workdir /tmp/gpu_packed --json OUT.json   # CUDA
    python -m tools.bench.gpu_packed --workdir /tmp/p --tiny --json OUT.json      # CPU smoke

Rows: `(--warmup + --steps) x --rows-per-step` chat rows (one user token, an assistant reply)
whose lengths (model input tokens: the rendering's ids minus one, what the engine counts in
`num_tokens`) are drawn from a log-normal distribution (median `--median`, shape `--sigma`,
seeded by `--seed`) and clipped to [`--min-len`, `--max-len`]; each row is rendered with the
engine's own chat renderer (engine.data.render) and checked to have exactly its drawn length.
One epoch, no shuffle: optimizer step k trains rows k*g .. (k+1)*g-1 (g = --rows-per-step).

Engine: `torchrun --nproc_per_node 1 -m engine.sft` on gpu_sft's dense model (Qwen3-0.6B
widths; --tiny: its tiny widths) with `train.packing=true` and
`train.max_tokens_per_micro_batch=--budget` (the engine's own first-fit-decreasing packing,
engine.training.plan), `train.compile` at its default (on with CUDA: the compiled step) or
`--compile`. Per step from its metrics.jsonl: num_tokens (checked against the drawn lengths
of that step's rows: `tokens_match`), time/step_s, compile/graphs, compile/recompiles,
compile/graph_breaks (models/build/compile_counts.py) and memory/max_allocated_gib.
Peer (`--peer-modes`, default eager,compiled; `none` skips it): transformers'
Qwen3ForCausalLM at the same widths (tools/bench/peer.py's model, optimizer and precision) on
the same micro-batches (the engine's plan of the same lengths, engine.training.plan) through
transformers' padding-free path: one row per micro-batch, the sequences concatenated,
`position_ids` restarting at 0 per sequence and no attention mask (transformers derives a
block-diagonal causal mask from them, masking_utils.find_packed_sequence_indices, and hands it
to SDPA as a dense mask: not a varlen kernel), labels -100 at each sequence's first token. Its
token ids are random, its loss covers every token (the engine's: the assistant's only).

Reported (timed steps: after --warmup): tokens/s = timed tokens / timed seconds, median step
seconds, model TFLOP/s and MFU (tools/bench/model_flops.py over each step's own sequence
lengths; attention counted per sequence, as packing computes it), peak memory, the compile
counts after the first step, after warm-up and at the end (`graphs_grew_after_warmup`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # also `python tools/bench/gpu_packed.py`

from tools.bench.gpu_sft import build_models  # noqa: E402
from tools.bench.model_flops import model_flops  # noqa: E402

COMPILE_KEYS = ("compile/graphs", "compile/recompiles", "compile/graph_breaks")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def sample_lengths(n: int, median: float, sigma: float, lo: int, hi: int, seed: int
                   ) -> list[int]:
    """`n` lengths ~ round(median * exp(sigma * N(0, 1))), clipped to [lo, hi] (seeded)."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))
            for _ in range(n)]


def write_rows(path: Path, lengths: list[int], model_dir: str, seed: int = 0) -> None:
    """Chat rows whose rendering by the engine's chat renderer has len(ids) - 1 == length
    (module docstring); ValueError when a length is below the template's overhead or a row
    renders to another length."""
    from transformers import AutoTokenizer

    from engine.data.render import render_messages

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)

    def chat(n: int) -> list[dict]:
        reply = " ".join(rng.choice(LETTERS) for _ in range(n))
        return [{"role": "user", "content": rng.choice(LETTERS)},
                {"role": "assistant", "content": reply}]

    overhead = len(render_messages(chat(1), tokenizer, "probe")[0]) - 1   # tokens at reply 1
    rows = []
    for i, length in enumerate(lengths):
        if length < overhead:
            raise ValueError(f"length {length} < the chat template's {overhead} tokens")
        messages = chat(length - overhead + 1)
        got = len(render_messages(messages, tokenizer, f"row {i}")[0]) - 1
        if got != length:
            raise ValueError(f"row {i} renders to {got} tokens, not {length}")
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n")


def step_lengths(lengths: list[int], per_step: int, step: int) -> list[int]:
    """The drawn lengths of optimizer step `step`'s rows (one epoch, no shuffle)."""
    return lengths[step * per_step:(step + 1) * per_step]


def engine_argv(model_dir: str, data: Path, workdir: Path, log_dir: Path, args) -> list[str]:
    """`-m engine.sft ...` with packing on the rows (module docstring)."""
    return ["-m", "engine.sft", f"model.hf_path={model_dir}", f"model.dtype={args.dtype}",
            f"data.train_files=[{data}]", f"data.cache_dir={workdir / 'cache'}",
            "data.num_workers=1", "data.shuffle=false", "train.packing=true",
            f"train.max_tokens_per_micro_batch={args.budget}",
            f"train.seq_length={args.max_len + 1}",
            f"train.global_batch_size={args.rows_per_step}",
            f"train.max_steps={args.warmup + args.steps}", "optim.lr=3e-4",
            "optim.warmup_steps=2", "optim.schedule=constant", f"logging.dir={log_dir}",
            "logging.progress_bar=false",
            *([f"train.compile={args.compile}"] if args.compile else [])]


def torchrun(argv: list[str], log: Path, port: int) -> int:
    """`torchrun --nproc_per_node 1 argv` from the repository root, its output into `log`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(port), *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        return subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


def run_engine(model_dir: str, data: Path, workdir: Path, args,
               launch: Callable[[list[str], Path], int] | None = None) -> list[dict]:
    """engine.sft on the rows, started by `launch(argv, log)` (default: torchrun, one
    process; a test hands its rank pool); its metrics.jsonl rows."""
    log_dir = workdir / "runs" / "packed"
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "metrics.jsonl").unlink(missing_ok=True)
    argv = engine_argv(model_dir, data, workdir, log_dir, args)
    log = log_dir / "log.txt"
    rc = (launch or (lambda a, f: torchrun(a, f, args.port)))(argv, log)
    path = log_dir / "metrics.jsonl"
    if rc != 0 or not path.exists():
        tail = log.read_text()[-3000:] if log.exists() else ""
        raise RuntimeError(f"engine.sft exited {rc}: {tail}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(step_rows: list[list[int]], seconds: list[float], hf: dict, warmup: int,
              peak: float | None) -> dict:
    """tokens/s, median step seconds, TFLOP/s and MFU over the timed steps (module
    docstring); `step_rows[k]`: step k's sequence lengths, `seconds[k]` its time."""
    timed = range(warmup, len(seconds)) if len(seconds) > warmup else range(len(seconds))
    tokens = sum(sum(step_rows[k]) for k in timed)
    total_s = sum(seconds[k] for k in timed)
    tflops = sum(model_flops(hf, step_rows[k]) for k in timed) / total_s / 1e12
    return {"tokens_per_s": tokens / total_s, "step_s": statistics.median(
        seconds[k] for k in timed), "tflops": tflops,
        "mfu": tflops / peak if peak else None, "timed_tokens": tokens}


def tokens_match(num_tokens: list, lengths: list[int], per_step: int) -> bool:
    """Whether each step's packed tokens (metrics.jsonl num_tokens) are the sum of the drawn
    lengths of that step's rows: nothing cut, padded or dropped."""
    return [int(n) for n in num_tokens] == [
        sum(step_lengths(lengths, per_step, k)) for k in range(len(num_tokens))]


def engine_result(rows: list[dict], lengths: list[int], hf: dict, args, peak) -> dict:
    """The engine's numbers, its compile counts and the token check (module docstring)."""
    per_step = [step_lengths(lengths, args.rows_per_step, k) for k in range(len(rows))]
    counts = {k: [r.get(k) for r in rows] for k in COMPILE_KEYS}
    graphs = counts["compile/graphs"]
    losses = [r["loss"] for r in rows]
    return {
        **summarize(per_step, [r["time/step_s"] for r in rows], hf, args.warmup, peak),
        "steps": len(rows), "num_tokens": [r["num_tokens"] for r in rows],
        "drawn_tokens": [sum(s) for s in per_step],
        "tokens_match": tokens_match([r["num_tokens"] for r in rows], lengths,
                                     args.rows_per_step),
        "sequences": [r["num_sequences"] for r in rows], "step_s_all":
        [r["time/step_s"] for r in rows], "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "compile": counts, "graphs_grew_after_warmup": None if graphs[0] is None else
        graphs[-1] > graphs[min(args.warmup, len(graphs)) - 1],
        "peak_mem_gib": max((r.get("memory/max_allocated_gib", 0.0) for r in rows),
                            default=None) or None}


def peer_micro_batches(step: list[int], budget: int) -> list[list[int]]:
    """The engine's micro-batches of one step at one rank (engine.training.plan), as lists of
    sequence lengths."""
    from engine.training.plan import plan_mini_batch

    plan = plan_mini_batch(step, 1, True, 1, budget)
    return [[step[i] for i in mb] for mb in plan.ranks[0]]


def peer_batch(lengths: list[int], vocab: int, device, gen):
    """(ids [1, sum], position_ids [1, sum], labels [1, sum]) of one packed micro-batch."""
    import torch

    total = sum(lengths)
    ids = torch.randint(4, vocab, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = -100
    return ids.to(device), pos.to(device), labels.to(device)


def run_peer(mode: str, steps: list[list[list[int]]], tiny: bool, warmup: int, dtype: str,
             peak, hf: dict) -> dict:
    """transformers on the same micro-batches (module docstring), one mode; compiled: the
    sequence dimension marked dynamic, so the varied lengths compile one graph, not one per
    length (torch's automatic dynamic shapes would recompile once first)."""
    import torch

    from tools.bench.peer import CLIP, build_model, make_optimizer, peer_config, sync

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = peer_config(tiny)
    model = build_model(config, device)
    optimizer = make_optimizer(model)
    run = torch.compile(model) if mode == "compiled" else model
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    gen = torch.Generator().manual_seed(0)
    batches = [[peer_batch(mb, config.vocab_size, device, gen) for mb in step] for step in steps]
    if mode == "compiled":   # every micro-batch has its own length: one dynamic graph
        for tensor in (t for step in batches for mb in step for t in mb):
            torch._dynamo.mark_dynamic(tensor, 1)
    seconds, losses = [], []
    for step in batches:
        sync(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for ids, pos, labels in step:
            with torch.autocast(device.type, dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                loss = run(input_ids=ids, position_ids=pos, labels=labels).loss / len(step)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(total))
    lengths = [[n for mb in step for n in mb] for step in steps]
    return {"mode": mode, **summarize(lengths, seconds, hf, warmup, peak),
            "step_s_all": seconds, "losses": losses, "compile_s": seconds[0],
            "finite": all(math.isfinite(x) for x in losses),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
            if device.type == "cuda" else None}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.gpu_packed",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/bench_gpu_packed")
    ap.add_argument("--tiny", action="store_true", help="gpu_sft's tiny dense model (CPU)")
    ap.add_argument("--rows-per-step", type=int, default=48, help="train.global_batch_size")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=int, default=16384,
                    help="train.max_tokens_per_micro_batch")
    ap.add_argument("--median", type=float, default=700.0, help="log-normal median length")
    ap.add_argument("--sigma", type=float, default=0.9, help="log-normal shape")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", choices=("auto", "true", "false"), default=None,
                    help="train.compile (default: the engine's)")
    ap.add_argument("--peer-modes", default="eager,compiled", help="eager,compiled or none")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--port", type=int, default=29631)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.peer_modes.split(",") if m and m != "none"]
    bad = [m for m in modes if m not in ("eager", "compiled")]
    if bad:
        ap.error(f"--peer-modes: {bad} unknown; valid: eager, compiled, none")
    if args.budget < args.max_len + 1:
        ap.error(f"--budget {args.budget} must be at least --max-len + 1 ({args.max_len + 1})")
    args.modes = modes
    return args


def measure(args, launch: Callable[[list[str], Path], int] | None = None) -> dict:
    """The whole item (module docstring) for parsed `args`; returns the report (what --json
    writes). `launch`: run_engine's."""
    import torch

    from tools.bench.mfu import peak_bf16_tflops

    cuda = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_bf16_tflops(gpu) if cuda else None
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_models(workdir, args.tiny, {"dense"})["dense"]
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    lengths = sample_lengths((args.warmup + args.steps) * args.rows_per_step, args.median,
                             args.sigma, args.min_len, args.max_len, args.seed)
    data = workdir / f"packed_{args.seed}.jsonl"
    write_rows(data, lengths, model_dir, args.seed)
    t0 = time.perf_counter()
    rows = run_engine(model_dir, data, workdir, args, launch)
    engine = {**engine_result(rows, lengths, hf, args, peak), "wall_s": time.perf_counter() - t0}
    steps = [peer_micro_batches(step_lengths(lengths, args.rows_per_step, k), args.budget)
             for k in range(args.warmup + args.steps)]
    peers = []
    for mode in args.modes:   # a peer that fails (e.g. out of memory) leaves the engine's
        try:
            peers.append(run_peer(mode, steps, args.tiny, args.warmup, args.dtype, peak, hf))
        except RuntimeError as e:
            peers.append({"mode": mode, "error": f"{type(e).__name__}: {str(e)[:400]}",
                          "finite": False})
    out = {"gpu": gpu, "peak_bf16_tflops": peak, "torch": torch.__version__,
           "args": dict(vars(args)), "lengths": lengths,
           "length_stats": {"mean": statistics.mean(lengths), "median": statistics.median(
               lengths), "min": min(lengths), "max": max(lengths)},
           "micro_batches": [len(s) for s in steps], "engine": engine,
           "peer": {p["mode"]: p for p in peers},
           "peer_path": "transformers padding-free (position_ids, no attention mask; SDPA "
                        "with the block-diagonal causal mask it derives)"}
    for p in peers:
        if "tokens_per_s" in p:
            out[f"engine_over_peer_{p['mode']}"] = engine["tokens_per_s"] / p["tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    engine = out["engine"]
    brief = {"tokens_per_s": engine["tokens_per_s"], "mfu": engine["mfu"],
             "tokens_match": engine["tokens_match"], "compile": {
                 k: v[-1] for k, v in engine["compile"].items()},
             "graphs_grew_after_warmup": engine["graphs_grew_after_warmup"],
             "peak_mem_gib": engine["peak_mem_gib"],
             **{k: v for k, v in out.items() if k.startswith("engine_over_peer")}}
    print(json.dumps(brief))
    return 0 if engine["tokens_match"] and engine["finite"] and all(
        p["finite"] for p in out["peer"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
