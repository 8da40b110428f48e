"""Distributed rollout: engine placement, the work split, per-response seeds, and a GRPO run on
two torchrun "nodes" (localhost, 2 ranks each, TP2 x DP2) with one engine per node.

The multi-node part launches three runs of the same GRPO job (tiny qwen3, HF backend):
  A: default placement (2 engines: ranks 0 and 2), engine 1 dies on its 2nd generate call and
     is restarted from the current weights, weight-sync probe on;
  B: rollout.num_engines=1, stopped after step 2 with a checkpoint;
  C: B resumed for step 3 with the default 2 engines.
Per-response seeds make the responses independent of the engine count, a restart and a resume,
so A and B+C must agree on every step's rewards, lengths, losses and gradient norms.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.generation.base import SamplingParams
from engine.generation.placement import placement_problems, resolve_placement
from engine.generation.work_split import batch_seeds, response_seed, split_groups
from tests.launch import result_lines, run_two_nodes
from tools.tiny_models import build_tiny_model

# ----------------------------------------------------------------------------- placement


@pytest.mark.parametrize("engines,gpus,world,per_node,owners,gpus_out", [
    (None, None, 16, 8, (0, 8), 8),          # default: one per node, the node's GPUs
    (1, None, 16, 8, (0,), 8),               # one engine for two nodes, on rank 0
    (4, 2, 16, 8, (0, 2, 8, 10), 2),         # two per node, 2 GPUs each
    (8, None, 16, 8, (0, 2, 4, 6, 8, 10, 12, 14), 2),
    (2, None, 32, 8, (0, 16), 8),            # 4 nodes, engines on nodes 0 and 2
    (None, None, 4, 2, (0, 2), 2),           # the test's two localhost "nodes"
])
def test_placement_owners(engines, gpus, world, per_node, owners, gpus_out):
    placement = resolve_placement(engines, gpus, world, per_node)
    assert placement.owners == owners and placement.gpus_per_engine == gpus_out
    assert placement.engine_of(0) == 0 and placement.engine_of(1) is None
    assert [placement.local_slot(e) for e in range(len(owners))] == [o % per_node
                                                                     for o in owners]


def test_impossible_placements_name_the_keys():
    def problems(*args):
        return " | ".join(placement_problems(*args))

    assert "rollout.num_engines=3 must divide the 4 nodes" in problems(3, None, 32, 8)
    assert "rollout.num_engines=6 must be a multiple of the 4 nodes" in problems(6, None, 32, 8)
    assert ("with rollout.gpus_per_engine=4 they need 12 devices but a node runs 8"
            in problems(6, 4, 16, 8))
    assert "rollout.num_engines=0 must be null or an integer >= 1" in problems(0, None, 8, 8)
    assert "rollout.gpus_per_engine=-1" in problems(None, -1, 8, 8)
    assert "not a whole number of nodes" in problems(None, None, 12, 8)
    assert problems(None, None, 16, 8) == ""


# ----------------------------------------------------------------------------- work split


def test_split_keeps_groups_whole_and_balances_work():
    # 5 groups of n=2 with prompt lengths 10, 50, 20, 30, 40 (group-major)
    lengths = [10, 10, 50, 50, 20, 20, 30, 30, 40, 40]
    parts = split_groups(lengths, 2, 10, 2)
    # work per group 2*(len+10) = 40, 120, 60, 80, 100; longest first to the least loaded:
    # g1 -> e0 (120), g4 -> e1 (100), g3 -> e1 (180), g2 -> e0 (180), g0 -> e0 (220)
    assert parts == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert split_groups(lengths, 2, 10, 1) == [list(range(10))]
    # more engines than groups: some get nothing
    assert split_groups([5, 5], 2, 4, 3) == [[0, 1], [], []]
    with pytest.raises(ValueError, match="not whole groups of 2"):
        split_groups([1, 2, 3], 2, 4, 2)


def test_response_seeds_depend_only_on_their_coordinates():
    seeds = batch_seeds(7, 3, 4, 2)
    assert seeds[5] == response_seed(7, 3, 2, 1) and len(set(seeds)) == 8
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert batch_seeds(7, 4, 4, 2) != seeds and batch_seeds(8, 3, 4, 2) != seeds
    assert batch_seeds(7, 3, 2, 2) == seeds[:4]  # a prefix of the batch keeps its seeds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("engines_model")
    return build_tiny_model(str(root / "qwen3"), "qwen3", hidden=64, layers=4, heads=8,
                            kv_heads=2, seed=0, initializer_range=0.2)


def test_hf_seeded_rows_do_not_depend_on_the_rest_of_the_call(model_dir):
    """The same seeds give the same responses whether all prompts share one generate call or
    are split over two engines (different padding widths and batch sizes)."""
    from engine.generation.hf.backend import HFRolloutEngine

    engine = HFRolloutEngine(model_dir)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19]]
    seeds = [response_seed(1, 0, i, 0) for i in range(4)]

    def run(rows):
        params = SamplingParams(max_new_tokens=12, temperature=1.0,
                                seeds=[seeds[i] for i in rows])
        return engine.generate([prompts[i] for i in rows], params)

    whole = run([0, 1, 2, 3])
    parts = run([1, 3]) + run([0, 2])
    by_row = dict(zip([1, 3, 0, 2], parts))
    for i, gen in enumerate(whole):
        assert gen.response_ids == by_row[i].response_ids
        assert gen.response_logprobs == pytest.approx(by_row[i].response_logprobs, abs=1e-5)
    assert len({tuple(g.response_ids) for g in whole}) > 1  # really sampled
    shuffled = SamplingParams(max_new_tokens=12, temperature=1.0, seeds=seeds[::-1])
    assert [g.response_ids for g in engine.generate(prompts, shuffled)] != [
        g.response_ids for g in whole]
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2, seeds=seeds[:3]))


def test_start_refuses_an_impossible_placement(model_dir, tmp_path, monkeypatch):
    """validate_rl (run before any process group) checks the placement for the launched
    world: 2 nodes of 2 processes (torchrun's LOCAL_WORLD_SIZE) cannot host 3 engines."""
    from engine.config.schema import ConfigError, load_config
    from engine.rl.checks import validate_rl
    from engine.rl.config import RLConfig

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 ?", "answer": "2"}) + "\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    base = [f"model.hf_path={model_dir}", f"data.train_files=[{prompts}]"]
    cfg, _ = load_config(RLConfig, [*base, "rollout.num_engines=3"])
    with pytest.raises(ConfigError, match="rollout.num_engines=3 must be a multiple of the 2 "
                                          "nodes"):
        validate_rl(cfg, 4)
    cfg, _ = load_config(RLConfig, base)
    validate_rl(cfg, 4)  # the default (one engine per node) is fine


# ----------------------------------------------------------------------------- sync topology


def test_every_engine_gets_the_whole_model_from_its_own_replica(pools, model_dir):
    """tests/multirank/engine_sync.py on 4 ranks: PP2 x DP2 with owners in different stages
    (streams in both directions), owners that are TP rank 1, a restart target off rank 0, DP4.
    Every target owner holds every HF tensor once, bitwise; nobody else receives a byte."""
    from tests.multirank.engine_sync import CASES

    proc = pools.script(4, "tests/multirank/engine_sync.py", model_dir, timeout=600)
    assert proc.returncode == 0
    results = {r["case"]: r["reports"] for r in result_lines(proc.stdout)}
    assert list(results) == [c[0] for c in CASES]
    for case, reports in results.items():
        targets = [r for r in reports if r["target"]]
        assert targets, case
        for r in reports:
            if r["engine"] is not None:
                assert r["names_ok"] and r["exact"] and not r["duplicates"], (case, r)
            if r["target"]:
                assert r["stats"] > 0, (case, r)
            else:  # no relaying: only an engine's owner receives its stream
                assert r["recv_bytes"] == 0 and r["stats"] is None, (case, r)
        sizes = {r["stats"] for r in targets}
        assert len(sizes) == 1, (case, sizes)  # every engine gets the same bytes
    # owners in another stage than their tensors' do receive point-to-point
    assert [r["recv_bytes"] > 0 for r in results["pp2_dp2_two_engines"]] == [True, False, True,
                                                                              False]


# ----------------------------------------------------------------------------- two nodes

# metrics that must be equal whatever the engine count, restarts and resume
SAME = ("reward/mean", "reward/std", "response/length_mean", "policy/loss", "policy/pg_loss",
        "policy/kl", "policy/entropy", "grad_norm", "train/groups")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("engines_data") / "add.jsonl"
    rows = [{"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?" + " now" * (i % 4),
             "answer": i % 10 + (3 * i + 1) % 10} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(pools, model_dir, prompts_file, tmp_path_factory) -> dict:
    """A and B on the 4-rank pool (tests/pool.py) numbered as 2 torchrun nodes of 2; C, the
    resume of B's checkpoint, a real launch on 2 nodes (a new process reads the checkpoint)."""
    root = tmp_path_factory.mktemp("engines_runs")
    common = ("-m", "engine.rl", f"model.hf_path={model_dir}",
              f"data.train_files=[{prompts_file}]", "parallel.tp=2", "rollout.n=2",
              "rollout.max_new_tokens=8", "train.prompts_per_step=6", "train.max_steps=3",
              "train.seq_length=64", "optim.lr=1e-3", "kl.beta=0.05", "rollout.retry_wait_s=0",
              "reward.fn=tests.rl_rewards:digit_reward", "logging.progress_bar=false")
    out = {}
    marker = root / "engine1_died"
    node1 = {"DYING_ROLLOUT_MARKER": str(marker), "DYING_ROLLOUT_AT_CALL": "2"}
    out["A"] = pools.script(
        4, *common, f"logging.dir={root / 'A'}", "rollout.check_weight_sync=true",
        "rollout.backend=tests.flaky_rollout:DyingHFEngine", timeout=600, nodes=2,
        rank_env={2: node1, 3: node1}).nodes(2)
    out["died"] = marker.exists()
    ckpt = root / "ckpt"
    out["B"] = pools.script(4, *common, f"logging.dir={root / 'B'}", "rollout.num_engines=1",
                            f"checkpoint.dir={ckpt}", "train.exit_interval=2", timeout=600,
                            nodes=2).nodes(2)
    out["C"] = run_two_nodes(2, *common, f"logging.dir={root / 'C'}", f"checkpoint.dir={ckpt}",
                             timeout=600)
    for name in ("A", "B", "C"):
        out[f"{name}_metrics"] = (_metrics(root / name)
                                  if (root / name / "metrics.jsonl").exists() else [])
    return out


def test_two_nodes_default_to_one_engine_each_and_restart_a_dead_one(runs):
    assert [p.returncode for p in runs["A"]] == [0, 0]
    assert runs["died"]
    steps = runs["A_metrics"]
    assert len(steps) == 3
    for m in steps:
        assert m["rollout/engines"] == 2
        assert m["debug/sync_logit_max_diff"] < 1e-4     # both engines hold the trainer's
        assert m["rollout/logprob_diff"] < 1e-3          # weights after every sync
        assert m["rollout/sync_bytes_per_engine"] > 0 and m["time/weight_sync_s"] > 0
        assert m["rollout/engine_imbalance"] >= 1.0
    # one generate call per engine per generation batch, except step 2: engine 1 died on its
    # call (no retry for a dead engine), was restarted and generated again: (1 + 1 + 1) / 2
    assert [m["rollout/generate_calls"] for m in steps] == [1.0, 1.5, 1.0]
    assert [m["rollout/restarts"] for m in steps] == [0.0, 1.0, 0.0]
    assert [m["rollout/retries"] for m in steps] == [0.0, 0.0, 0.0]
    assert "engine 1 (rank 2) was restarted from the current weights on generation batch 1: " \
           "recovered" in runs["A"][0].stdout
    assert "2 rollout engine(s)" in runs["A"][0].stdout and "owner ranks [0, 2]" in \
        runs["A"][0].stdout
    assert "2 CPU rank(s) per engine" in runs["A"][0].stdout  # tp 2; not "GPU(s)" on a CPU host
    assert "GPU(s)" not in runs["A"][0].stdout


def test_engine_count_restart_and_resume_do_not_change_the_run(runs):
    assert [p.returncode for p in runs["B"]] == [0, 0]
    assert [p.returncode for p in runs["C"]] == [0, 0]
    one_engine = runs["B_metrics"]
    resumed = runs["C_metrics"]
    assert [m["rollout/engines"] for m in one_engine] == [1.0, 1.0]
    assert [m["rollout/engines"] for m in resumed] == [2.0]
    reference = runs["A_metrics"]
    for a, b in zip(reference, one_engine + resumed, strict=True):
        for key in SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # the runs really learned something different per step (the comparison is not vacuous)
    assert len({round(m["reward/mean"], 6) for m in reference}) > 1
    assert reference[0]["grad_norm"] > 0
