"""`python -m engine.rl --config RECIPE --validate [--nodes M] [--gpus-per-node G]`: check an RL
recipe for a cluster shape without GPUs, weights or training (exit 0, or 2 listing problems).

It checks the configuration keys, the training layout for the model shape (model.hf_path's
config.json, else the model.shape preset) and the rollout engine placement, and prints the
placement (engines, GPUs per engine, owner ranks) and what one weight sync moves: every engine
receives the whole model in model.dtype (HF tensors, unpadded vocabulary) once per RL step.
"""
from __future__ import annotations

import sys

from engine.config import ConfigError, layout_problems, value_problems
from engine.config_loading import load_config
from engine.recipe_validation import _int_flag, _model_config
from engine.rl.config import RLConfig, apply_algorithm_defaults, explicit_keys, rl_problems
from engine.rl.rollout.placement import placement_problems, resolve_placement
from models.families import stage_parameters

GB = 1e9


def rl_recipe_report(cfg: RLConfig, nodes: int, per_node: int) -> tuple[list[str], list[str]]:
    """(summary lines, problems) of running `cfg` on `nodes` x `per_node` GPUs."""
    problems = value_problems(cfg) + rl_problems(cfg)
    world = nodes * per_node
    if nodes < 1 or per_node < 1:
        return [], problems + [f"--nodes {nodes} and --gpus-per-node {per_node} must be >= 1"]
    hf = _model_config(cfg, problems)
    if hf is None:
        return [], problems
    problems += layout_problems(cfg, world, hf)
    r = cfg.rollout
    placement_issues = placement_problems(r.num_engines, r.gpus_per_engine, world, per_node)
    if problems or placement_issues:
        return [], problems + placement_issues
    placement = resolve_placement(r.num_engines, r.gpus_per_engine, world, per_node)
    params = stage_parameters(hf, 1, 1).total
    sync_bytes = params * (2 if cfg.model.dtype == "bfloat16" else 4)
    p = cfg.parallel
    summary = [
        f"model: {cfg.model.shape or hf.get('model_type')}, {params / 1e9:.2f} B parameters, "
        f"dtype {cfg.model.dtype}",
        f"training layout: tp={p.tp} pp={p.pp} cp={p.cp} dp={world // (p.tp * p.pp * p.cp)} "
        f"on {nodes} node(s) x {per_node} GPUs",
        f"rollout: backend {r.backend}, {placement.describe()}",
        f"weight sync per RL step: {sync_bytes / GB:.1f} GB to each of "
        f"{placement.num_engines} engine(s) ({placement.num_engines * sync_bytes / GB:.1f} GB "
        "in all), each engine fed from its own model replica",
        f"rollout batch: {cfg.train.prompts_per_step} prompts x {r.n} responses, about "
        f"{cfg.train.prompts_per_step * r.n / placement.num_engines:.0f} responses per engine",
    ]
    return summary, []


def rl_validate_main(argv: list[str]) -> int:
    """CLI of `--validate` for engine.rl: prints the summary (exit 0) or the problems (2)."""
    argv = [a for a in argv if a != "--validate"]
    try:
        nodes = _int_flag(argv, "--nodes")
        per_node = _int_flag(argv, "--gpus-per-node")
        cfg, _ = load_config(RLConfig, argv)
        apply_algorithm_defaults(cfg, explicit_keys(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    nodes = nodes if nodes is not None else cfg.recipe.nodes
    per_node = per_node if per_node is not None else cfg.recipe.gpus_per_node
    summary, problems = rl_recipe_report(cfg, nodes, per_node)
    for line in summary:
        print(line)
    if problems:
        print(f"recipe INVALID on {nodes} node(s) x {per_node} GPUs:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        sys.stderr.flush()
        return 2
    print(f"recipe OK on {nodes} node(s) x {per_node} GPUs", flush=True)
    return 0
