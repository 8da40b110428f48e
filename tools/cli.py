"""The `megatron-sft-engine` console command (alias `mse`), installed by `pip install`.

    megatron-sft-engine sft [--nproc-per-node N] [--config FILE.yaml] [key=value ...]
    megatron-sft-engine rl  [--nproc-per-node N] [--config FILE.yaml] [key=value ...]
    megatron-sft-engine dpo [--nproc-per-node N] [--config FILE.yaml] [key=value ...]
    megatron-sft-engine rm  [--nproc-per-node N] [--config FILE.yaml] [key=value ...]
    megatron-sft-engine rm score --model HF_DIR --data FILE.jsonl
    megatron-sft-engine kto [--nproc-per-node N] [--config FILE.yaml] [key=value ...]
    megatron-sft-engine validate {sft,rl,dpo,rm,kto} --config RECIPE.yaml [--world-size N] [--nodes M] [--json]
    megatron-sft-engine convert {hf-to-mcore,mcore-to-hf,verify} ... [--nproc-per-node N]
    megatron-sft-engine bench NAME [--quick]
    megatron-sft-engine demo {assets,model,addition-data,rm-data,tools-data,...} ...
    megatron-sft-engine serve --model DIR [--backend hf|vllm] [--port P] ...
    megatron-sft-engine tinker --model DIR [--port P] [--api-key KEY | --keys-file F] ...

Each subcommand is the module a checkout runs with `python -m` (`engine.sft`, `engine.rl`,
`engine.dpo`, `engine.rm`, `engine.kto`, `engine.serve`, `tools.convert`, `tools.bench`,
`tools.demo`; those keep working) and answers `--help` with its own text: for `sft`, `rl`,
`dpo`, `rm` and `kto`, every config key with its type, default
and meaning, generated from the schema. `--nproc-per-node N` starts N local ranks through torchrun (`python -m
torch.distributed.run --standalone`); multi-node jobs call torchrun themselves
(recipes/*_multi_node.sh). Exit codes are the module's: 0 done, 2 configuration or data error, 1
run-time failure.
"""
from __future__ import annotations

import os
import sys

PROG = "megatron-sft-engine"
ENGINES = ("sft", "rl", "dpo", "rm", "kto")   # the training entry points (engine.<name>)
SUBCOMMANDS = {  # name: (module torchrun runs for --nproc-per-node, or None; one-line meaning)
    "sft": ("engine.sft", "supervised fine-tuning"),
    "rl": ("engine.rl", "GRPO / DAPO / PPO / on-policy distillation"),
    "dpo": ("engine.dpo", "preference optimisation on pairs: DPO, IPO, cDPO/robust, hinge, "
                          "SimPO, ORPO (dpo.loss_type), RPO"),
    "rm": ("engine.rm", "reward models: Bradley-Terry on preference pairs; `rm score`: "
                        "an exported reward model's scores of chats"),
    "kto": ("engine.kto", "KTO on unpaired feedback (a prompt, a completion, a boolean label)"),
    "validate": (None, "check a recipe's layout, memory and communication for a cluster; "
                       "no GPUs, no weights"),
    "convert": ("tools.convert", "checkpoints between Hugging Face and Megatron-Core"),
    "bench": (None, "the engine's benchmarks (docs/benchmarks.md)"),
    "demo": (None, "the CPU demos' tiny models, data and greedy evaluation"),
    "serve": (None, "serve a Hugging Face checkpoint OpenAI-compatibly (/v1; hf or vllm); "
                    "evaluation, LLM judges"),
    "tinker": ("engine.tinker", "serve the Tinker training API (LoRA adapters of many users on one base "
                     "model; docs/tinker.md)"),
}


def usage() -> str:
    from engine.config.help import version

    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} ... (alias: mse)", "",
             f"{PROG} {version()}: Megatron-Core SFT and RL whose loss does not depend on the "
             "parallel layout.", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {meaning}" for name, (_, meaning) in SUBCOMMANDS.items()]
    lines += ["", f"`{PROG} SUBCOMMAND --help` prints the subcommand's options (for sft, rl, dpo, "
              "rm and kto: every config key).", "", "examples:",
              f"  {PROG} sft model.hf_path=DIR data.train_files=[train.jsonl] train.max_steps=100",
              f"  {PROG} sft --nproc-per-node 4 --config recipes/sft/qwen3_8b_h100.yaml "
              "model.hf_path=DIR",
              f"  {PROG} validate rl --config recipes/rl/qwen3_8b_grpo_h100.yaml --nodes 4",
              f"  {PROG} convert mcore-to-hf --ckpt runs/x/checkpoints --out runs/x/hf"]
    return "\n".join(lines) + "\n"


VALIDATE_USAGE = (f"usage: {PROG} validate {{sft,rl,dpo,rm,kto}} --config RECIPE.yaml "
                  "[--world-size N] [--nodes M] [--gpus-per-node G] [--json] [key=value ...]")
VALIDATE_FLAGS = (
    ("--config RECIPE.yaml", "the recipe to check (its recipe.nodes and recipe.gpus_per_node "
                             "give the cluster shape)"),
    ("--world-size N", "GPUs in all (default: nodes x GPUs per node)"),
    ("--nodes M", "nodes (default: the recipe's recipe.nodes)"),
    ("--gpus-per-node G", "GPUs per node (default: the recipe's recipe.gpus_per_node)"),
    ("--json", "one JSON object (ok, world_size, nodes, summary, warnings, problems, "
               "memory_gib, communication) instead of text"),
    ("key=value", "overrides a key of the recipe (`megatron-sft-engine ENTRY --help` lists "
                  "the keys of each entry point)"))


def validate_help() -> str:
    """`validate --help` (and `validate ENTRY --help`): its usage, meaning and flags."""
    width = max(len(flag) for flag, _ in VALIDATE_FLAGS)
    lines = [VALIDATE_USAGE, "", "Checks a recipe's layout arithmetic, memory per GPU and "
             "communication plan for a cluster shape, without GPUs, weights or processes. Exit "
             "0 with a summary, 2 with every problem.", "", "flags:"]
    lines += [f"  {flag:<{width}}  {meaning}" for flag, meaning in VALIDATE_FLAGS]
    lines += ["", "examples:", f"  {PROG} validate rl --config recipes/rl/qwen3_8b_grpo_h100.yaml "
              "--nodes 4", f"  {PROG} validate sft --config recipes/sft/qwen3_8b_h100.yaml "
              "--world-size 16 --json"]
    return "\n".join(lines)


def pop_nproc(argv: list[str]) -> int | None:
    """Remove `--nproc-per-node N` (or `--nproc-per-node=N`, `--nproc_per_node`) from argv;
    return N. Exit 2 on a missing or non-positive value."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in ("--nproc-per-node", "--nproc_per_node"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            del argv[i:i + 2]
        else:
            del argv[i]
        if not value.isdigit() or int(value) < 1:
            print(f"error: --nproc-per-node needs a positive integer, got {value!r}",
                  file=sys.stderr)
            raise SystemExit(2)
        return int(value)
    return None


def launch(module: str, nproc: int, argv: list[str]) -> None:
    """Replace this process by torchrun running `python -m module argv` on `nproc` local
    ranks (--standalone: a free rendezvous port on this host)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *argv]
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def _engine_help(name: str) -> tuple[str, str, list[str]]:
    """(prog, usage, examples) that `sft --help` / `rl --help` print under this command."""
    prog = f"{PROG} {name}"
    recipe = {"sft": "recipes/sft/qwen3_8b_h100.yaml", "rl": "recipes/rl/qwen3_8b_grpo_h100.yaml",
              "dpo": "recipes/dpo/qwen3_8b_dpo_h100.yaml",
              "rm": "recipes/rm/qwen3_8b_rm_h100.yaml",
              "kto": "recipes/kto/qwen3_8b_kto_h100.yaml"}[name]
    data = {"sft": "data.train_files=[train.jsonl]",
            "rl": "data.train_files=[prompts.jsonl] reward.fn=math rollout.n=8",
            "dpo": "data.train_files=[pairs.jsonl] dpo.loss_type=sigmoid",
            "rm": "data.train_files=[pairs.jsonl] rm.center_rewards_coefficient=0.01",
            "kto": "data.train_files=[kto.jsonl] kto.beta=0.1"}[name]
    scoring = [f"{prog} score --model runs/rm/hf --data chats.jsonl  (an exported reward "
               "model's scores of chats; `score --help`)"] if name == "rm" else []
    return prog, f"{prog} [--nproc-per-node N] [--config FILE.yaml] [key=value ...]", [
        f"{prog} model.hf_path=DIR {data} train.max_steps=100",
        f"{prog} --nproc-per-node 8 --config {recipe} model.hf_path=DIR parallel.tp=2",
        f"torchrun --nnodes 2 --nproc_per_node 8 ... -m engine.{name} --config {recipe}  "
        "(multi-node)",
        f"{PROG} validate {name} --config {recipe} --nodes 2", *scoring]


def run_engine(name: str, argv: list[str]) -> int:
    if name == "sft":
        from engine.sft.__main__ import main
    elif name == "dpo":
        from engine.dpo.__main__ import main
    elif name == "rm":
        from engine.rm.__main__ import main
    elif name == "kto":
        from engine.kto.__main__ import main
    else:
        from engine.rl.__main__ import main
    return main(argv, *_engine_help(name))


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        from engine.config.help import version

        print(f"{PROG} {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}; valid: {', '.join(SUBCOMMANDS)} "
              f"(`{PROG} --help`)", file=sys.stderr)
        return 2
    sys.argv[0] = f"{PROG} {name}"   # what argparse-based subcommands print as their prog
    module = SUBCOMMANDS[name][0]
    if module is not None and "-h" not in rest and "--help" not in rest:
        nproc = pop_nproc(rest)
        if nproc is not None:
            launch(module, nproc, rest)
    if name in ENGINES:
        return run_engine(name, rest)
    if name == "validate":
        if "-h" in rest or "--help" in rest:   # `validate sft --help` too: validate's flags
            print(validate_help())
            return 0
        if rest[:1] not in [[e] for e in ENGINES]:
            print(f"error: {VALIDATE_USAGE}", file=sys.stderr)
            return 2
        return run_engine(rest[0], [*rest[1:], "--validate"])
    if name == "convert":
        from tools.convert import main as convert_main

        return convert_main(rest, prog=f"{PROG} convert")
    if name == "bench":
        from tools.bench.__main__ import main as bench_main

        return bench_main(rest, prog=f"{PROG} bench")
    if name == "serve":
        from engine.serve.__main__ import main as serve_main

        return serve_main(rest, prog=f"{PROG} serve")
    if name == "tinker":
        from engine.tinker.__main__ import main as tinker_main

        return tinker_main(rest, prog=f"{PROG} tinker")
    from tools.demo import main as demo_main

    return demo_main(rest)


def console() -> None:
    """The installed script's entry point: main(), then, when a subcommand loaded torch,
    engine.cli.exit_process (the exit without the interpreter's module teardown, ~1 s then); a
    plain exit otherwise (--help, --version and refused keys load no torch: engine.cli)."""
    code = main()
    if "torch" not in sys.modules:
        raise SystemExit(code)
    from engine.cli import exit_process

    exit_process(code)


if __name__ == "__main__":
    console()
