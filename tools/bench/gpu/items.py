"""The checklist's items as commands: what each runs, where its results land, its timeout.

An `Item` is a list of argv lists (run in order from the repository root, each with
`sys.executable`), a timeout for all of them together, and the files its metrics are read
from (tools.bench.gpu.report). `build_items(names, workdir, smoke)` builds them for the GPU
sizes (the commands of the 2026-11-24 and 2026-11-26 H100 sessions, docs/benchmarks.md) or,
with `smoke`, for the CPU smoke sizes (fp32, hidden 64, 2 layers, fewer and shorter rollouts).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ITEMS = ("sft", "loss_head", "grpo", "lora_grpo", "vision")
SMOKE_DEFAULT = ("grpo", "vision")  # what --cpu-smoke runs unless --items says otherwise
RL_KEYS = ("rollout/logprob_diff", "rollout/logprob_diff_max", "debug/sync_logit_max_diff",
           "time/rollout_s", "time/logprob_s", "time/train_s", "time/weight_sync_s",
           "time/step_s", "reward/mean", "grad_norm")


@dataclass(frozen=True)
class Sizes:
    """Model, rollout and SFT sizes of one run of the checklist."""
    dtype: str
    hidden: int
    layers: int
    intermediate: int
    rl_steps: int
    prompts: int          # train.prompts_per_step
    n: int                # rollout.n
    micro: int            # train.micro_batch_size of the RL update
    rl_extra: tuple[str, ...] = ()
    sft_args: tuple[str, ...] = ()        # gpu_sft flags of the `sft` item
    head_args: tuple[str, ...] = ()       # gpu_sft flags of the `loss_head` item


GPU = Sizes(dtype="bfloat16", hidden=512, layers=8, intermediate=1536, rl_steps=3, prompts=16,
            n=8, micro=64,
            sft_args=("--cases", "dense,moe", "--steps", "8", "--warmup", "3"),
            head_args=("--cases", "dense,unchunked", "--seq", "16384", "--gbs", "1",
                       "--rows", "2", "--steps", "3", "--warmup", "1"))
SMOKE = Sizes(dtype="float32", hidden=64, layers=2, intermediate=128, rl_steps=2, prompts=4,
              n=4, micro=16, rl_extra=("rollout.max_new_tokens=24",),
              sft_args=("--tiny", "--cases", "dense,moe", "--seq", "64", "--steps", "3",
                        "--warmup", "1"),
              head_args=("--tiny", "--cases", "dense,unchunked", "--seq", "128", "--gbs", "1",
                         "--rows", "2", "--steps", "3", "--warmup", "1"))


@dataclass
class Item:
    """One checklist item: `commands` run in order under one `timeout_s`; `kind` says how
    its metrics are read (`sft`: gpu_sft's --json file `result`; `rl`/`sft_run`: the engine's
    metrics.jsonl `result`)."""
    name: str
    kind: str
    commands: list[list[str]]
    timeout_s: float
    result: Path
    work: Path            # the item's folder (its whole log: WORK/<name>.full.log)
    expected_steps: int = 0


def module(name: str, *args) -> list[str]:
    """argv of `python -m name args` with this interpreter."""
    return [sys.executable, "-m", name, *map(str, args)]


def gpu_sft_item(name: str, work: Path, flags: tuple[str, ...], timeout_s: float) -> Item:
    """A tools/bench/gpu_sft.py run; `sft` and `loss_head` share one workdir (the dense model
    is built once)."""
    out = work / f"{name}.json"
    cmd = module("tools.bench.gpu_sft", "--workdir", work / "gpu_sft", *flags, "--json", out)
    return Item(name, "sft", [cmd], timeout_s, out, work)


def grpo_item(name: str, work: Path, sizes: Sizes, lora: bool) -> Item:
    """GRPO on the demo model and addition prompts (docs/benchmarks.md, H100 session 3)."""
    w = work / name
    model = w / "init"
    prep = [module("tools.demo", "model", model, "--hidden", sizes.hidden, "--layers",
                   sizes.layers, "--intermediate", sizes.intermediate, "--seed", 0),
            module("tools.demo", "addition-data", w)]
    extra = []
    if lora:
        prep.append(module("tools.bench.gpu.prep", "lora-adapter", model, w / "adapter",
                           "--scale", 0.05))
        extra = [f"model.lora.init_from={w / 'adapter'}"]
    run = module("engine.rl", "algorithm=grpo", f"model.hf_path={model}", *extra,
                 f"model.dtype={sizes.dtype}", f"data.train_files=[{w / 'rl.jsonl'}]",
                 "reward.fn=math", "reward.timeout_s=null", "rollout.backend=hf",
                 f"rollout.n={sizes.n}", "rollout.temperature=1.0",
                 f"train.prompts_per_step={sizes.prompts}", "train.mini_batches_per_step=2",
                 f"train.micro_batch_size={sizes.micro}", f"train.max_steps={sizes.rl_steps}",
                 "optim.lr=5e-4", "optim.schedule=constant", "kl.beta=0.0",
                 "rollout.check_weight_sync=true", *sizes.rl_extra,
                 f"logging.dir={w / 'logs'}", "logging.progress_bar=false")
    return Item(name, "rl", prep + [run], 150, w / "logs" / "metrics.jsonl", w, sizes.rl_steps)


def vision_item(work: Path, sizes: Sizes) -> Item:
    """The counting demo's Qwen3-VL: 40 picture rows with 12 text-only rows interleaved,
    micro-batch 1, no shuffle (step 1 has text-only micro-batches), trained tower, the default
    parallel.overlap_grad_reduce (on with CUDA), 4 steps (H100 session 3)."""
    w = work / "vision"
    rows = w / "mixed.jsonl"
    prep = [module("tools.demo", "counting-data", w),
            module("tools.bench.gpu.prep", "vision-rows", w / "sft.jsonl", rows,
                   "--image-rows", 40, "--text-rows", 12)]
    run = module("engine.sft", f"model.hf_path={w / 'init'}", f"model.dtype={sizes.dtype}",
                 f"data.train_files=[{rows}]", f"data.cache_dir={w / 'cache'}",
                 "train.global_batch_size=8", "train.micro_batch_size=1",
                 "train.seq_length=48", "train.max_steps=4", "optim.lr=3e-3",
                 "optim.schedule=constant", "optim.warmup_steps=0", "data.shuffle=false",
                 "model.vision.freeze=false", f"logging.dir={w / 'logs'}",
                 "logging.progress_bar=false")
    return Item("vision", "sft_run", prep + [run], 120, w / "logs" / "metrics.jsonl", w, 4)


def build_items(names: list[str], workdir: Path, smoke: bool,
                overrides: dict[str, list[str]] | None = None) -> list[Item]:
    """The items `names` in that order; `overrides[name]` are appended to that item's last
    command (a hydra override for the engine items, a gpu_sft flag for sft and loss_head)."""
    unknown = [n for n in names if n not in ITEMS]
    if unknown:
        raise ValueError(f"--items: {unknown} unknown; valid: {', '.join(ITEMS)}")
    bad = [n for n in (overrides or {}) if n not in ITEMS]
    if bad:
        raise ValueError(f"--override: item {bad} unknown; valid: {', '.join(ITEMS)}")
    sizes = SMOKE if smoke else GPU
    make = {"sft": lambda: gpu_sft_item("sft", workdir, sizes.sft_args, 300),
            "loss_head": lambda: gpu_sft_item("loss_head", workdir, sizes.head_args, 150),
            "grpo": lambda: grpo_item("grpo", workdir, sizes, lora=False),
            "lora_grpo": lambda: grpo_item("lora_grpo", workdir, sizes, lora=True),
            "vision": lambda: vision_item(workdir, sizes)}
    items = [make[n]() for n in names]
    for item in items:
        item.commands[-1] += list((overrides or {}).get(item.name, []))
    return items
