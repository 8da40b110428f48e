"""Prefix sharing with train.compile (launched by tests/test_prefix_sharing_compile.py).

    prefix_sharing_compile_check.py MODEL_DIR [OBJECTIVE ...]     (one process; default grpo sft)

For each objective of tests/multirank/prefix_sharing_check.py (grpo: the log-prob stage, then 3
policy updates with the full loss; sft: the log-probs, then 3 SFT steps), micro_batch_size 2
(packed: each micro-batch of the shared runs is a tree of its own, different from the others),
four runs on the same batches and HF weights: eager unshared, eager shared, compiled unshared,
compiled shared (train.compile: models.build.compile_layers). Rank 0 prints one "RESULT {json}"
line per objective with three comparisons (prefix_sharing_check.compare: the largest relative
difference of the log-prob table and of every compared metric over the steps):
  compiled_vs_eager:   compiled shared against eager shared (the compile tests' tolerance);
  shared_vs_unshared:  compiled shared against compiled unshared (prefix sharing's);
  eager_sharing:       eager shared against eager unshared (the reference: what sharing alone does),
and the compiled shared run's compile counts: per micro-batch forward (after it: graphs,
recompiles, graph breaks, this process's since it started, and the micro-batch's tokens) and the
run's totals, so the test can show that a new tree compiles nothing.
Negative control (CONTROL line, grpo): the compiled shared run with RoPE positions counted along
the tree row (the tree's natural order) instead of each token's depth in its row
(prefix_sharing_check.broken("tree_positions")), compared with the compiled unshared run.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tests.multirank.prefix_sharing_check as psc  # noqa: E402

TRAIN = dict(micro_batch_size=1, max_tokens_per_micro_batch=None, balance_dp=True, packing=True,
             lora=False, unchunked=False, aux=False)
_EAGER_ENGINE = psc._engine
COUNTS: list = []   # the compiled shared run's per-micro-batch compile counts


def _record_counts(module, args, kwargs, output) -> None:
    """After a micro-batch's forward: whether it ran a tree, the tree's shape (tokens,
    chains) and this process's compile counts."""
    from models.build.compile_counts import compile_stats
    from parallel.tree_attention import is_tree

    params = kwargs.get("packed_seq_params")
    tree = is_tree(params)
    s = compile_stats()
    COUNTS.append({"tree": tree, "tokens": params.row_length if tree else None,
                   "runs": len(params.runs) if tree else None, "graphs": s.graphs,
                   "recompiles": s.recompiles, "breaks": s.graph_breaks})


def _engine(model_dir, hf_config, layout_kw, world, train, sp):
    """prefix_sharing_check's engine, with its layers compiled when `train.compile` (the
    engine's train.compile=true: TrainEngine.build's compile_layers), and the compiled shared
    run's micro-batch forwards counted."""
    if not getattr(train, "compile", False):
        return _EAGER_ENGINE(model_dir, hf_config, layout_kw, world, train, sp)
    from engine.training.train_engine import TrainEngine
    build = TrainEngine.build
    TrainEngine.build = lambda *a, **kw: build(*a, **kw, compile_layers=True)
    try:
        state = _EAGER_ENGINE(model_dir, hf_config, layout_kw, world, train, sp)
    finally:
        TrainEngine.build = build
    if train.prefix_sharing and getattr(train, "count", False):
        for chunk in state.chunks:
            inner = getattr(chunk, "module", chunk)
            inner.register_forward_hook(_record_counts, with_kwargs=True)
    return state


def _run(run, model_dir, hf_config, compiled: bool, shared: bool, count: bool = False):
    train = SimpleNamespace(**TRAIN, prefix_sharing=shared, compile=compiled, count=count)
    return run(model_dir, hf_config, {}, 1, train, False)


def traced_control(model_dir, hf_config) -> list[dict]:
    """The compiled shared engine with tree rows traced into the compiled core attention (its
    regions' `eager_when` cleared, as tests/multirank/compile_retrace.py does for packed rows;
    recompile limit RETRACE_LIMIT): the GRPO log-prob stage over its trees, per micro-batch
    compile counts. The tree attention's chains and spans are host ints, which dynamo bakes into
    the graph and guards on: every new tree compiles again."""
    import torch

    from engine.rl.collect.batch import build_sequences
    from engine.rl.policy.logprobs import compute_token_logprobs
    from models.build.compile_counts import count_graphs
    from models.build.compile_layers import CompiledRegion
    from tests.multirank.compile_retrace import RETRACE_LIMIT

    train = SimpleNamespace(**TRAIN, prefix_sharing=True, compile=True, count=True)
    state = _engine(model_dir, hf_config, {}, 1, train, False)
    for chunk in state.chunks:
        for module in chunk.modules():
            region = module.__dict__.get("forward")
            if isinstance(region, CompiledRegion) and region.eager_when:
                region.eager_when = None
                region.compiled = torch.compile(region.eager, backend=count_graphs,
                                                dynamic=False, recompile_limit=RETRACE_LIMIT,
                                                isolate_recompiles=True)
    COUNTS.clear()
    compute_token_logprobs(state, build_sequences(psc.grpo_rollout(hf_config["vocab_size"])),
                           SETTINGS_T)
    state.release()
    return list(COUNTS)


SETTINGS_T = psc.SETTINGS["temperature"]


def main() -> None:
    import torch._dynamo.utils
    import torch.distributed as dist

    from models.build.compile_counts import compile_stats
    from models.hf.io import read_config
    from parallel.process_groups import init_distributed, shutdown

    init_distributed()
    psc._engine = _engine
    model_dir = sys.argv[1]
    names = sys.argv[2:] or ["grpo", "sft"]
    hf_config = read_config(model_dir)
    rank0 = dist.get_rank() == 0
    for name, run in psc.OBJECTIVES:
        if name not in names:
            continue
        eager_on = _run(run, model_dir, hf_config, False, True)
        compiled_off = _run(run, model_dir, hf_config, True, False)
        COUNTS.clear()
        before = compile_stats()
        compiled_on = _run(run, model_dir, hf_config, True, True, count=True)
        result = {"objective": name,
                  "compiled_vs_eager": psc.compare(eager_on, compiled_on),
                  "shared_vs_unshared": psc.compare(compiled_off, compiled_on),
                  "counts_before": vars(before), "counts_after": vars(compile_stats()),
                  "micro_batches": list(COUNTS)}
        if rank0:
            print("RESULT " + json.dumps(result), flush=True)
        if name != "grpo":
            continue
        with psc.broken("tree_positions"):
            bad = _run(run, model_dir, hf_config, True, True)
        if rank0:
            print("CONTROL " + json.dumps({"objective": name, "kind": "tree_positions",
                                           **psc.compare(compiled_off, bad)}), flush=True)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        traced = traced_control(model_dir, hf_config)
        torch._dynamo.utils.counters["graph_break"].clear()   # the pool's later cases read it
        torch._dynamo.utils.counters["graph_break"].update(breaks)
        if rank0:
            print("CONTROL " + json.dumps({"objective": name, "kind": "traced",
                                           "micro_batches": traced}), flush=True)
    psc._engine = _EAGER_ENGINE
    shutdown()


if __name__ == "__main__":
    from engine.cli import exit_process

    main()
    exit_process(0)
