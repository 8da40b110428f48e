"""`python -m engine.sft --config RECIPE --validate [--world-size N] [--nodes M]`: check a
recipe's layout arithmetic and memory for a cluster shape, without weights, GPUs or processes.

The model shape comes from `model.hf_path` (its config.json) when given, else from the preset
named by `model.shape` (models.families.presets.MODEL_SHAPES: the public HF configs of the recipe models). Defaults:
`--nodes` = recipe.nodes, `--gpus-per-node` = recipe.gpus_per_node, `--world-size` = their
product. Exit 0 with a summary, or 2 with every problem.

Memory per GPU: models.estimate.training_memory (the formulas are in its docstring), with
train.recompute* resolved by engine.config.model_settings.

The communication plan (models.estimate.comm, engine.config.comm_report) follows: bytes each
GPU hands to collectives per optimizer step, by kind. `--json` prints one JSON object instead
of text: summary, warnings, problems, ok, world_size, nodes, memory_gib and communication.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

from engine.config.schema import (ConfigError, SFTConfig, data_file_problems, layout_problems,
                           load_config, parallel_layout, read_model_config, sft_problems,
                           value_problems)
from engine.config.cli_flags import int_flag, pop_switch
from engine.config.micro_batch_defaults import apply_sft_micro_batching
from engine.config.comm_report import comm_section
from models.estimate import training_memory
from models.estimate.lora_memory import lora_summary
from engine.config.vision_settings import vision_estimate, vision_summary
from engine.config.lora_settings import lora_problems, lora_spec
from engine.config.model_settings import recompute_layer_problems, recompute_settings
from engine.training.plan import plan_mini_batch
from models.estimate.counting import stage_parameters
from models.families.presets import MODEL_SHAPES, shape_mismatches
from models.estimate.training_memory import MemoryEstimate, micro_batch_tokens

WARN_FRACTION = 0.9          # warn when the estimate exceeds this share of GPU memory
EXPECTED_TOLERANCE = 0.10    # recipe.expected_memory_gib must be within 10% of the estimate

def estimate_memory(hf: dict, layout, train, bf16: bool, distributed_optimizer: bool,
                    micro_batches: int, lora=None, vision=(False, 0),
                    muon: bool = False) -> MemoryEstimate:
    """models.estimate.training_memory.estimate_memory with train.recompute* resolved;
    `vision`: engine.config.vision_settings.vision_estimate; `muon`: optim.name=muon."""
    return training_memory.estimate_memory(hf, layout, train, bf16, distributed_optimizer,
                                           micro_batches, recompute_settings(train), lora,
                                           vision, muon)


def memory_checks(estimate: float, recipe, at_recipe_size: bool, what: str, fix: str,
                  stated_vs: str) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a per-GPU estimate (GiB) against recipe.gpu_memory_gib (over
    it: a problem naming `fix`; over WARN_FRACTION of it: a warning) and, at the recipe's own
    cluster size, recipe.expected_memory_gib (off by more than EXPECTED_TOLERANCE: a problem).
    `what` names the estimate ("estimated memory per GPU"), `stated_vs` how the mismatch
    message names it ("the estimate for 2 node(s) is")."""
    cap, stated = recipe.gpu_memory_gib, recipe.expected_memory_gib
    problems, warnings = [], []
    if estimate > cap:
        problems.append(f"{what} {estimate:.1f} GiB exceeds recipe.gpu_memory_gib={cap}: {fix}")
    elif estimate > WARN_FRACTION * cap:
        warnings.append(f"{what} {estimate:.1f} GiB is over {WARN_FRACTION:.0%} of {cap} GiB")
    if stated is not None and at_recipe_size and abs(stated - estimate) > (
            EXPECTED_TOLERANCE * estimate):
        problems.append(f"recipe.expected_memory_gib={stated} but {stated_vs} "
                        f"{estimate:.1f} GiB; update the recipe")
    return problems, warnings


@dataclass
class RecipeReport:
    summary: list[str]
    problems: list[str]
    warnings: list[str]
    data: dict = field(default_factory=dict)   # memory_gib, communication (for --json)


def model_config(cfg, problems: list[str]) -> dict | None:
    preset = MODEL_SHAPES.get(cfg.model.shape) if cfg.model.shape else None
    if cfg.model.shape and preset is None:
        problems.append(f"model.shape={cfg.model.shape!r} is not a known preset; choose one "
                        f"of {', '.join(MODEL_SHAPES)}")
    if cfg.model.hf_path:
        try:
            hf = read_model_config(cfg)
        except ConfigError as e:
            problems.append(str(e))
            return None
        if preset is not None:
            problems += [f"model.shape={cfg.model.shape} does not match model.hf_path: {m}"
                         for m in shape_mismatches(preset, hf)]
        return hf
    if preset is None and not cfg.model.shape:
        problems.append("give model.shape (one of " + ", ".join(MODEL_SHAPES) + ") or "
                        "model.hf_path so the model shape is known")
    return preset


def validate_recipe(cfg, world_size: int, nodes: int, beside=None) -> RecipeReport:
    """Every problem and warning of running `cfg` on `nodes` nodes with `world_size` GPUs.
    `beside(hf_config) -> (name, GiB per GPU)`: a frozen model resident beside the trained one
    (DPO's reference), added to the estimate the memory checks see (0 GiB: nothing added)."""
    problems = (value_problems(cfg) + sft_problems(cfg)
                + data_file_problems(cfg, require_train=False))
    warnings: list[str] = []
    if not cfg.data.train_files:
        warnings.append("data.train_files is not set (required to train)")
    if not isinstance(nodes, int) or nodes < 1 or world_size < 1 or world_size % nodes:
        problems.append(f"world size {world_size} is not a positive multiple of --nodes {nodes}")
        return RecipeReport([], problems, warnings)
    hf = model_config(cfg, problems)
    if hf is None:
        return RecipeReport([], problems, warnings)
    apply_sft_micro_batching(cfg, hf)   # the micro-batches a run would plan
    layout_issues = (layout_problems(cfg, world_size, hf) + lora_problems(cfg, hf)
                     + recompute_layer_problems(cfg.parallel, cfg.train,
                                                hf["num_hidden_layers"]))
    if layout_issues:
        return RecipeReport([], problems + layout_issues, warnings)
    p = cfg.parallel
    layout = parallel_layout(p, world_size)
    per_node = world_size // nodes
    if per_node % (p.tp * p.cp):
        warnings.append(f"tp x cp = {p.tp * p.cp} does not fit inside one node of {per_node} "
                        "GPUs: tensor/context-parallel traffic crosses the network")
    train = cfg.train
    if train.global_batch_size < layout.dp:
        warnings.append(f"train.global_batch_size={train.global_batch_size} < dp={layout.dp}: "
                        "some DP ranks only run empty micro-batches")
    plan = plan_mini_batch([train.seq_length] * train.global_batch_size, layout.dp,
                           train.balance_dp, train.micro_batch_size,
                           train.max_tokens_per_micro_batch)
    m = plan.num_micro_batches
    if p.pp > 1 and m < p.pp:
        warnings.append(f"{m} micro-batches per step < parallel.pp={p.pp}: the pipeline "
                        "bubble dominates; raise train.global_batch_size")
    if train.seq_length > hf.get("max_position_embeddings", train.seq_length):
        warnings.append(f"train.seq_length={train.seq_length} exceeds the model's "
                        f"max_position_embeddings={hf['max_position_embeddings']}")
    bf16 = cfg.model.dtype == "bfloat16"
    mem = estimate_memory(hf, layout, train, bf16, cfg.optim.distributed_optimizer, m,
                          lora_spec(cfg, hf), vision_estimate(cfg, train),
                          cfg.optim.name == "muon")
    cap = cfg.recipe.gpu_memory_gib
    too_big, near = _checked_memory(cfg, mem.total, world_size, nodes,
                                    beside(hf) if beside is not None else ("", 0.0))
    problems += too_big
    warnings += near
    params = stage_parameters(hf, p.tp, p.pp, p.ep)
    tokens = train.global_batch_size * train.seq_length
    active = (f" ({params.active / 1e9:.2f} B active per token, "
              f"{params.expert_stage / 1e9:.2f} B expert parameters per GPU)"
              if params.expert_stage else "")
    name = cfg.model.shape or hf.get("model_type")
    summary = [
        f"model: {name}, {params.total / 1e9:.2f} B parameters{active}, "
        f"{hf['num_hidden_layers']} "
        f"layers, dtype {cfg.model.dtype}",
        f"layout: {layout.describe()} on {nodes} node(s) x {per_node} GPUs; "
        f"{params.layers_per_stage} layers per pipeline stage",
        f"batch: {train.global_batch_size} sequences x {train.seq_length} tokens = {tokens} "
        f"tokens per step (at most); {m} micro-batches per DP rank per step, "
        f"{micro_batch_tokens(train)} tokens per micro-batch",
        f"activations: sequence parallelism {'on' if layout.sequence_parallel else 'off'}, "
        f"recompute {_recompute_text(train)}",
        *lora_summary(hf, lora_spec(cfg, hf), params.total),
        *vision_summary(cfg, hf, train),
        f"memory per GPU (estimate, GiB): weights {mem.weights:.1f} + grads {mem.grads:.1f} "
        f"+ optimizer {mem.optimizer:.1f} + activations {mem.activations:.1f} "
        f"({mem.notes['layers_in_flight']:g} layer passes of {mem.notes['tokens_per_rank']:g} "
        f"tokens) + logits {mem.logits:.1f} + runtime {mem.runtime:.1f} = {mem.total:.1f} "
        f"of {cap}",
    ]
    comm_lines, comm = comm_section(cfg, hf, layout, micro_batch_tokens(train), m)
    memory = {k: v for k, v in asdict(mem).items() if k != "notes"}
    return RecipeReport(summary + comm_lines, problems, warnings,
                        {"memory_gib": {**memory, "total": mem.total}, "communication": comm})


def _checked_memory(cfg, trained_gib: float, world_size: int, nodes: int,
                    beside: tuple[str, float]) -> tuple[list[str], list[str]]:
    """memory_checks of the trained model's estimate plus what sits `beside` it
    ((name, GiB), 0 GiB: nothing), at `nodes` nodes of `world_size` GPUs."""
    at_recipe_size = (nodes == cfg.recipe.nodes
                      and world_size == cfg.recipe.nodes * cfg.recipe.gpus_per_node)
    name, extra = beside
    with_it = f" with the {name}" if extra else ""
    return memory_checks(
        trained_gib + extra, cfg.recipe, at_recipe_size, f"estimated memory per GPU{with_it}",
        "raise tp/pp/cp or lower train.micro_batch_size / max_tokens_per_micro_batch",
        f"the estimate{with_it} for {nodes} node(s) is")


def _recompute_text(train) -> str:
    granularity, method, layers = recompute_settings(train)
    return f"full ({method}, {layers} layer(s))" if granularity == "full" else granularity


def validate_main(argv: list[str], schema=SFTConfig, check=None) -> int:
    """CLI of `--validate`: prints the summary (exit 0) or the problems (exit 2). `schema` and
    `check(cfg, world_size, nodes) -> RecipeReport` (default validate_recipe): DPO's own."""
    argv = [a for a in argv if a != "--validate"]
    as_json = pop_switch(argv, "--json")
    try:
        world = int_flag(argv, "--world-size")
        nodes = int_flag(argv, "--nodes")
        per_node = int_flag(argv, "--gpus-per-node")
        cfg, _ = load_config(schema, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    nodes = nodes if nodes is not None else cfg.recipe.nodes
    per_node = per_node if per_node is not None else cfg.recipe.gpus_per_node
    world = world if world is not None else nodes * per_node
    report = (check or validate_recipe)(cfg, world, nodes)
    if as_json:
        print(json.dumps({"ok": not report.problems, "world_size": world, "nodes": nodes,
                          "summary": report.summary, "warnings": report.warnings,
                          "problems": report.problems, **report.data}, indent=1), flush=True)
        return 2 if report.problems else 0
    for line in report.summary:
        print(line)
    for w in report.warnings:
        print(f"warning: {w}")
    if report.problems:
        print(f"recipe INVALID for world size {world} on {nodes} node(s):", file=sys.stderr)
        for p in report.problems:
            print(f"  - {p}", file=sys.stderr)
        sys.stderr.flush()
        return 2
    print(f"recipe OK for world size {world} on {nodes} node(s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(validate_main(sys.argv[1:]))
