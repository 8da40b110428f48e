"""Asynchronous RL (rollout.placement=disaggregated, rollout.max_staleness;
docs/async-rl.md): rollout on its own ranks with a fixed policy lag is exact and reproducible.

Launches on 2 torchrun "nodes" on localhost (node 0 trains, node 1, rollout.num_ranks=2, runs
two HF engines), every one validating before training and after steps 2 and 4: colocated DP2
vs disaggregated s=0 (equal, validation too); s=1 at DP2, TP2 and PP2 (equal to each other,
different from s=0, rollout/staleness 1 from step 1 on); s=1 again with an engine killed on
batch 2 (restarted: the same run bit for bit, the "same configuration twice" check); the
weights cross as deltas (rollout.sync_delta=true: its auto default keeps them whole on one
machine) except in the plain s=1 run (whole tensors), so the killed-engine run also checks deltas against full syncs bit for bit; s=1
stopped after steps 1 and 2 and resumed (equal to the straight run bit for bit). On one
torchrun of 3 processes (2 training ranks, 1 rollout rank): DAPO with dynamic sampling and
multi-turn episodes (s=0 equal to colocated), a rollout error, a hung rollout and a dead rollout
process (each ends the job with a message naming the rollout side).

The runs that end well use the session's rank pool (tests/pool.py): its ranks leave the pool's
process group and the job splits into its two worlds itself, from torchrun's variables
(`own_world`), 2 "nodes" numbered as torchrun numbers them; real torchrun launches are kept for
the failures (a rollout process that dies, a job torchrun ends) and the resumes (a new process
reads the checkpoint)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_torchrun, run_two_nodes, start, torchrun_cmd, wait
from tests.metrics_docs import undocumented
from tools.tiny_models import build_eos_model, build_tiny_model

SAME = ("reward/mean", "reward/std", "response/length_mean", "policy/loss", "policy/pg_loss",
        "policy/kl", "policy/entropy", "grad_norm", "train/groups")
STEPS = 4


def _broken_engine():
    from engine.generation.hf.backend import HFRolloutEngine

    class BrokenEngine(HFRolloutEngine):
        def generate(self, prompts, params):
            raise RuntimeError("engine exploded on purpose")
    return BrokenEngine


def __getattr__(name):  # rollout.backend=tests.test_rl_async:BrokenEngine (imported lazily)
    if name == "BrokenEngine":
        return _broken_engine()
    raise AttributeError(name)


def _lines(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _metrics(log_dir: Path) -> list[dict]:
    """The training steps' lines (validation before training is a line of its own)."""
    return [m for m in _lines(log_dir) if "reward/mean" in m]


def _val_metrics(log_dir: Path) -> dict[int, dict]:
    """{step: val/* metrics} of every line that has them."""
    return {m["step"]: {k: v for k, v in m.items() if k.startswith("val/")}
            for m in _lines(log_dir) if "val/reward_mean" in m}


# policy/loss and policy/pg_loss: whitened advantages times ratios near 1 nearly cancel (about
# 3e-7 here): their rounding is judged against the terms' size, not the residue's (as
# tests/test_rl_lora.py: 2e-6 absolute)
FLOOR = {"policy/loss": 0.2, "policy/pg_loss": 0.2}


def _close(a: list[dict], b: list[dict], rel: float = 1e-5) -> bool:
    """Every SAME metric of every step within `rel` of the larger of the two (FLOOR: at least
    of that size); the pairs that are not are printed (captured output of a failure)."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    far = [(i, k, x[k], y[k]) for i, (x, y) in enumerate(zip(a, b)) for k in SAME
           if abs(x[k] - y[k]) > rel * max(abs(x[k]), abs(y[k]), FLOOR.get(k, 1e-8))]
    if far:
        print("not close (step, key, a, b):", far)
    return not far


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async")
    model = build_tiny_model(str(root / "qwen3"), "qwen3", hidden=64, layers=4, heads=8,
                             kv_heads=2, seed=0, initializer_range=0.2)
    prompts, val_prompts = root / "p.jsonl", root / "val.jsonl"
    prompts.write_text("".join(json.dumps(
        {"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?" + " now" * (i % 4),
         "answer": 0}) + "\n" for i in range(24)))
    val_prompts.write_text("".join(json.dumps({"prompt": f"what is {i} times 3 ?", "answer": 0})
                                   + "\n" for i in range(3)))
    common = ("-m", "engine.rl", f"model.hf_path={model}", f"data.train_files=[{prompts}]",
              "rollout.n=2", "rollout.max_new_tokens=8", "train.prompts_per_step=4",
              f"train.max_steps={STEPS}", "train.seq_length=64", "optim.lr=1e-3",
              "kl.beta=0.05", "reward.fn=tests.rl_rewards:digit_reward",
              "logging.progress_bar=false")
    # validation before training and after steps 2 and 4 (version 2 and 4; 4 is needed only
    # by the validation), sampled at T=1 so it sees the policy
    val = (f"data.val_files=[{val_prompts}]", "train.val_interval=2", "val.before_train=true",
           "val.n=2", "val.temperature=1.0")
    dis = ("rollout.placement=disaggregated", "rollout.num_ranks=2", "rollout.num_engines=2",
           "rollout.peer_timeout_s=120")
    # the cheaper split where two nodes add nothing: 3 processes, the last one rolls out
    # rollout.sync_delta=true: deltas on one machine too (auto turns them on across nodes only)
    dis1 = ("rollout.placement=disaggregated", "rollout.num_ranks=1", "rollout.peer_timeout_s=120",
            "rollout.sync_delta=true")
    # The two launches that end on rollout.peer_timeout_s spend most of their time waiting:
    # started first, they wait while the pool runs below use the cores.
    waiting = {
        "hang": start(torchrun_cmd(3, *common, *dis1, "rollout.peer_timeout_s=15",
                                   "reward.fn=tests.rl_rewards:sleeping_reward",
                                   "reward.timeout_s=null", f"logging.dir={root / 'hang'}")),
        # reward.num_workers=0: scored in the rollout rank's own process, so dying_reward ends
        # that rank (in a pool worker it would end only the worker, which the pool replaces)
        "killed": start(torchrun_cmd(3, *common, *dis1, "rollout.peer_timeout_s=15",
                                     "reward.fn=tests.rl_rewards:dying_reward",
                                     "reward.num_workers=0", "reward.timeout_s=null",
                                     f"logging.dir={root / 'killed'}"))}
    out = {"colocated": pools.script(2, *common, *val, f"logging.dir={root / 'colocated'}")}
    marker = root / "engine_died"
    for name, extra in (("s0", ("rollout.max_staleness=0",)),
                        # whole tensors: the reference of the delta syncs (s1_dying)
                        ("s1", ("rollout.max_staleness=1", "rollout.sync_delta=false")),
                        ("s1_tp2", ("rollout.max_staleness=1", "parallel.tp=2")),
                        # the engines checked against the version that sampled each batch
                        ("s1_pp2", ("rollout.max_staleness=1", "parallel.pp=2",
                                    "rollout.check_behaviour_logprobs=true")),
                        # an engine dies on its 3rd generate call (batch 1 from version 0 at
                        # call 3 counting validation) and is restarted with that version
                        ("s1_dying", ("rollout.max_staleness=1", "rollout.retry_wait_s=0",
                                      "rollout.backend=tests.flaky_rollout:DyingHFEngine"))):
        node1 = {"DYING_ROLLOUT_MARKER": str(marker), "DYING_ROLLOUT_AT_CALL": "4"}
        out[name] = pools.script(
            4, *common, *val, *dis, *extra, f"logging.dir={root / name}", timeout=900,
            nodes=2, rank_env={2: node1, 3: node1}, own_world=True).nodes(2)
    out["died"] = marker.exists()
    out["fail"] = run_torchrun(3, *common, *dis1, "rollout.backend=tests.test_rl_async:"
                                "BrokenEngine", "rollout.max_retries=0",
                                f"logging.dir={root / 'fail'}", timeout=600)
    out.update({name: wait(proc, timeout=600) for name, proc in waiting.items()})
    for name in ("colocated", "s0", "s1", "s1_tp2", "s1_pp2", "s1_dying"):
        out[f"{name}_m"] = _metrics(root / name)
        out[f"{name}_val"] = _val_metrics(root / name)
    out.update(root=root, common=common, dis=dis, dis1=dis1, val=val)
    return out


def _tail(procs) -> str:
    """The end of the (first) launch's output, for assertion messages."""
    p = procs[0] if isinstance(procs, list) else procs
    return p.stdout[-3000:] + p.stderr[-3000:]


def _ok(procs) -> bool:
    procs = procs if isinstance(procs, list) else [procs]
    return all(p.returncode == 0 for p in procs)


def test_disaggregated_s0_equals_colocated(runs):
    assert _ok(runs["colocated"]) and _ok(runs["s0"]), runs["s0"][0].stdout[-3000:]
    assert _close(runs["colocated_m"], runs["s0_m"])
    assert [m["rollout/staleness"] for m in runs["s0_m"]] == [0.0] * STEPS
    assert "disaggregated: 2 training rank(s), 2 rollout rank(s)" in runs["s0"][0].stdout
    # validation on the rollout side at the same points, with the same numbers
    assert sorted(runs["s0_val"]) == [0, 2, 4]
    assert runs["s0_val"] == runs["colocated_val"]


def test_s1_lags_one_version_is_layout_invariant_and_differs_from_s0(runs):
    for name in ("s1", "s1_tp2", "s1_pp2"):
        assert _ok(runs[name]), runs[name][0].stdout[-3000:] + runs[name][0].stderr[-3000:]
    s1 = runs["s1_m"]
    assert [m["rollout/staleness"] for m in s1] == [0.0] + [1.0] * (STEPS - 1)
    assert [m["rollout/policy_version"] for m in s1] == [0.0, 0.0, 1.0, 2.0]
    assert _close(s1, runs["s1_tp2_m"]) and _close(s1, runs["s1_pp2_m"])
    # PP2: each stage sends its own part; the engine receives the same bytes
    assert [m["rollout/sync_bytes_per_engine"] for m in runs["s1_pp2_m"][:2]] == \
        [m["rollout/sync_bytes_per_engine"] for m in s1[:2]]
    for layout in ("s1_tp2", "s1_pp2"):
        for step, val in runs[f"{layout}_val"].items():
            assert all(abs(val[k] - runs["s1_val"][step][k]) <= 1e-5 * max(1.0, abs(val[k]))
                       for k in val), (layout, step)
    assert sorted(runs["s1_val"]) == [0, 2, 4]
    # rollout.check_behaviour_logprobs (PP2: each stage swaps its own shard): the engines'
    # log-probs equal those of the version that sampled each batch at every step, while the
    # current weights' differ from step 2 on (the one-version lag the check sees through)
    pp2 = runs["s1_pp2_m"]
    assert all(m["rollout/behaviour_logprob_diff"] < 1e-5 for m in pp2), pp2
    assert pp2[0]["rollout/logprob_diff"] < 1e-5
    assert all(m["rollout/logprob_diff"] > 1e-3 for m in pp2[1:]), pp2
    assert all("rollout/behaviour_logprob_diff" not in m for m in s1)
    # negative control: steps 0 and 1 train on the same batches as s=0 only at step 0
    assert s1[0]["reward/mean"] == runs["s0_m"][0]["reward/mean"]
    assert not _close(s1, runs["s0_m"])
    for m in s1:
        assert m["time/rollout_wait_s"] >= 0 and m["time/generate_s"] > 0
        assert m["rollout/idle_s"] >= 0


def test_dead_engine_is_restarted_with_the_version_it_served(runs):
    """An engine dies on batch 2 (generated by version 1): rebuilt from model.hf_path, it gets
    version 1 again from its owner's host copy and the run equals the undisturbed one bit for
    bit (the same configuration run twice gives the same numbers). The undisturbed run synced
    whole tensors, this one deltas (rollout.sync_delta): the engines' log-probs
    (rollout/logprob_diff) are bitwise the same (deltas that shrink: the DAPO runs below)."""
    assert _ok(runs["s1_dying"]) and runs["died"]
    dying = runs["s1_dying_m"]
    restarts = [m["rollout/restarts"] for m in dying]   # both engines may race to the marker
    assert restarts[2] >= 1 and restarts[:2] + restarts[3:] == [0.0, 0.0, 0.0]
    assert "was restarted from the current weights on generation batch 2: recovered" in \
        runs["s1_dying"][1].stdout   # the rollout leader runs on node 1
    for key in (*SAME, "rollout/staleness", "rollout/logprob_diff"):
        assert [m[key] for m in dying] == [m[key] for m in runs["s1_m"]], key
    assert runs["s1_dying_val"] == runs["s1_val"]
    # sync/*: steps 1 and 2 send versions 1 and 2 (each replica to its engine); the full run's
    # bytes are the model's, twice; negative control: the full run has no changed fraction
    full, delta = runs["s1_m"][:2], dying[:2]
    assert [m["sync/bytes"] for m in full] == [2 * m["rollout/sync_bytes_per_engine"]
                                               for m in full]
    assert all("sync/changed_fraction" not in m for m in full)
    for f, d in zip(full, delta):   # fp32 at lr 1e-3: (almost) every element changes,
        assert 0.99 < d["sync/changed_fraction"] <= 1.0, d          # tensors go whole
        assert d["sync/bytes"] == f["sync/bytes"], d
        assert d["sync/seconds"] > 0


def test_rollout_failures_end_the_job_with_a_message(runs):
    fail = runs["fail"]
    assert fail.returncode != 0
    assert "rollout leader, job rank 2, batch 0" in fail.stdout + fail.stderr
    assert "engine exploded on purpose" in fail.stdout + fail.stderr
    hang = runs["hang"]
    assert hang.returncode != 0
    # the trainer names the silent peer and the limit; what it was waiting for (rollout
    # batch 0, or still the first weights when a loaded host delays it) is not the point
    assert ("no answer from rollout rank 0 (job rank 2) within "
            "rollout.peer_timeout_s=15") in hang.stdout + hang.stderr
    # the rollout leader's process dies without a word: the trainer names it
    killed = runs["killed"]
    assert killed.returncode != 0
    assert "no answer from rollout rank 0 (job rank 2)" in killed.stdout + killed.stderr


def test_async_keys_are_refused_naming_the_key():
    from engine.rl.disaggregated.checks import async_problems
    from engine.rl.config import RLConfig
    cfg = RLConfig()
    cfg.rollout.max_staleness = 1
    assert "rollout.max_staleness=1 needs rollout.placement=disaggregated" in \
        async_problems(cfg, 4)[0]
    cfg.rollout.placement = "disaggregated"
    assert "rollout.num_ranks=None must be an integer in [1, 3]" in async_problems(cfg, 4)[0]
    cfg.rollout.num_ranks = 1
    assert async_problems(cfg, 4) == []
    cfg.rollout.check_behaviour_logprobs = True
    assert async_problems(cfg, 4) == []
    cfg.rollout.max_staleness = 0
    assert "rollout.check_behaviour_logprobs=true needs rollout.max_staleness >= 1" in \
        async_problems(cfg, 4)[0]
    cfg.rollout.max_staleness, cfg.rollout.check_behaviour_logprobs = 1, False
    assert "must be whole nodes of 2 GPUs" in async_problems(cfg, 4, gpus_per_node=2)[0]
    cfg.rollout.sleep_during_train = True
    assert "rollout.sleep_during_train=true is colocated only" in async_problems(cfg, 4)[0]
    cfg.rollout.placement = "elsewhere"
    assert "rollout.placement='elsewhere' must be one of" in async_problems(cfg, 4)[0]


def test_s1_resumed_at_steps_1_and_2_equals_the_straight_run(pools, runs):
    """s = 1 stopped after step 1 (the trainer tells the waiting engine owners to stop),
    resumed and stopped after step 2 (the rollout side has generated every batch already and
    ended), resumed to step 4: the batches generated ahead come back from the checkpoint and
    the three pieces equal the straight s = 1 run bitwise (which also validated: validation
    touches no training state)."""
    root, ckpt = runs["root"], runs["root"] / "ckpt_s1"
    pieces = []
    for name, extra in (("r1", ("train.exit_interval=1",)), ("r2", ("train.exit_interval=2",)),
                        ("r3", ())):
        args = (*runs["common"], *runs["dis"], "rollout.max_staleness=1",
                "rollout.check_behaviour_logprobs=true",
                f"checkpoint.dir={ckpt}", *extra, f"logging.dir={root / name}")
        if name != "r3":   # the first two pieces on the rank pool (r2 resumes in it)
            procs = pools.script(4, *args, timeout=600, nodes=2, own_world=True).nodes(2)
        else:              # new processes read the checkpoint
            procs = run_two_nodes(2, *args, timeout=600)
        assert _ok(procs), procs[0].stdout[-3000:] + procs[0].stderr[-3000:]
        pieces.append(_metrics(root / name))
    assert [len(p) for p in pieces] == [1, 1, 2]
    assert "[rl] resumed at step 2 of 4" in procs[0].stdout
    # rollout.check_behaviour_logprobs after a resume at step v: batch v (0-based) was sampled
    # by version v - 1, which the checkpoint does not hold: no metric there (said once); batch
    # v + 1 by version v, the resumed weights, kept again
    assert "they log no rollout/behaviour_logprob_diff" in procs[0].stdout
    assert pieces[0][0]["rollout/behaviour_logprob_diff"] < 1e-5
    assert "rollout/behaviour_logprob_diff" not in pieces[1][0]
    assert "rollout/behaviour_logprob_diff" not in pieces[2][0]
    assert pieces[2][1]["rollout/behaviour_logprob_diff"] < 1e-5
    # once more, with validation on: nothing to do, and the rollout side waits for nothing
    # (on the pool: the resume itself was read by new processes in r3)
    again = pools.script(4, *runs["common"], *runs["dis"], *runs["val"],
                         "rollout.max_staleness=1", f"checkpoint.dir={ckpt}",
                         f"logging.dir={root / 'r4'}", timeout=600, nodes=2,
                         own_world=True).nodes(2)
    assert _ok(again), again[1].stdout[-3000:] + again[1].stderr[-3000:]
    assert "nothing to do: 4 steps done" in again[0].stdout
    resumed = [m for p in pieces for m in p]
    straight = runs["s1_m"]
    for key in (*SAME, "rollout/staleness", "rollout/policy_version"):
        assert [m[key] for m in resumed] == [m[key] for m in straight], key


@pytest.fixture(scope="module")
def more_runs(pools, runs) -> dict:
    """DAPO with dynamic sampling and multi-turn episodes, colocated and disaggregated."""
    root, common, dis1 = runs["root"], runs["common"], runs["dis1"]
    # bf16: most values keep their bf16 value from one step to the next, so the weights cross
    # as real deltas (rollout.sync_delta)
    dapo = ("algorithm=dapo", "model.dtype=bfloat16", "rollout.max_new_tokens=6",
            "train.prompts_per_step=2",
            "train.max_steps=3", "dapo.max_gen_batches=4", "seed=1",
            "reward.fn=tests.rl_rewards:parity_reward")
    # a model whose sampled turns end (eos), so episodes reach their second turn
    eos_model = build_eos_model(str(root / "eos_llama"))
    env = (f"model.hf_path={eos_model}", "env.fn=tests.test_rl_env:CountEnv", "env.max_turns=2",
           "train.max_steps=2", "train.seq_length=128", "rollout.max_new_tokens=6")
    out = {}
    for name, extra in (("dapo", dapo), ("env", env)):
        out[f"{name}_colocated"] = pools.script(2, *common, *extra,
                                                f"logging.dir={root / (name + '_colocated')}")
        for s in (0, 1) if name == "dapo" else (0,):
            out[f"{name}_s{s}"] = pools.script(3, *common, *dis1, *extra,
                                                f"rollout.max_staleness={s}",
                                                f"logging.dir={root / f'{name}_s{s}'}",
                                                timeout=600, own_world=True)
    for name in ("dapo_colocated", "dapo_s0", "dapo_s1", "env_colocated", "env_s0"):
        out[f"{name}_m"] = _metrics(root / name)
    return out


def test_dapo_dynamic_sampling_runs_on_the_rollout_side(more_runs):
    """DAPO: the rollout side generates until the batch is full (several generation batches
    for a step); s = 0 equals colocated, s = 1 lags one version."""
    for name in ("dapo_colocated", "dapo_s0", "dapo_s1"):
        assert _ok(more_runs[name]), _tail(more_runs[name])
    s0, s1 = more_runs["dapo_s0_m"], more_runs["dapo_s1_m"]
    assert _close(more_runs["dapo_colocated_m"], s0)
    assert max(m["dynamic_sampling/gen_batches"] for m in s0) > 1
    assert [m["dynamic_sampling/gen_batches"] for m in s0] == \
        [m["dynamic_sampling/gen_batches"] for m in more_runs["dapo_colocated_m"]]
    assert [m["rollout/staleness"] for m in s1] == [0.0, 1.0, 1.0]
    assert not _close(s0, s1)
    # rollout.sync_delta in bf16: deltas cross, and the engine's log-probs are bitwise those of
    # the colocated engine (which gets whole tensors)
    assert [m["rollout/logprob_diff"] for m in s0] == \
        [m["rollout/logprob_diff"] for m in more_runs["dapo_colocated_m"]]
    for m in (s0[0], s0[1], s1[0]):   # versions 1 and 2 (s = 1: version 1)
        assert 0 < m["sync/changed_fraction"] < 1, m
        assert m["sync/bytes"] < m["rollout/sync_bytes_per_engine"], m


def test_multi_turn_episodes_run_on_the_rollout_side(more_runs):
    for name in ("env_colocated", "env_s0"):
        assert _ok(more_runs[name]), _tail(more_runs[name])
    co, s0 = more_runs["env_colocated_m"], more_runs["env_s0_m"]
    assert _close(co, s0)
    for a, b in zip(co, s0):
        assert a["env/turns_mean"] == b["env/turns_mean"] and b["env/turns_max"] == 2
        assert a["rollout/observation_tokens"] == b["rollout/observation_tokens"] > 0


def test_every_logged_metric_is_documented(runs, more_runs):
    """Every key of these runs' metrics.jsonl rows (GRPO colocated and disaggregated with
    validation, DAPO with dynamic sampling, multi-turn episodes) is named in docs/metrics.md;
    negative control: an undocumented name is reported."""
    keys = {k for out in (runs, more_runs) for name, rows in out.items()
            if name.endswith("_m") for row in rows for k in row}
    assert {"val/pass@1", "env/turns_mean", "rollout/staleness"} <= keys   # the runs' variety
    assert undocumented(keys) == []
    assert undocumented(["policy/loss", "policy/no_such_metric"]) == ["policy/no_such_metric"]


def test_validate_prints_the_split_and_both_sides_memory(capsys):
    """`--validate` of a disaggregated layout: the split, the staleness, each side's memory and
    the engine owners' host memory (2 x Qwen3-8B's 8.19e9 bf16 parameters = 30.5 GiB)."""
    from engine.rl.recipe_check import rl_validate_main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "rl" / "qwen3_8b_grpo_h100.yaml"
    base = ["--config", str(recipe), "--validate", "--nodes", "4", "rollout.backend=hf",
            "rollout.sleep_during_train=false", "rollout.placement=disaggregated",
            "rollout.max_staleness=1"]
    assert rl_validate_main(base + ["rollout.num_ranks=8"]) == 0
    out = capsys.readouterr().out
    assert ("placement: disaggregated, training on ranks [0, 24) (3 node(s)), rollout on ranks "
            "[24, 32) (1 node(s)); rollout.max_staleness=1") in out
    assert "memory per training GPU (estimate, GiB): policy" in out
    assert "memory per rollout GPU (estimate, GiB): hf engine weights 15.3" in out
    assert "host memory per engine owner (estimate, GiB): 30.5" in out
    assert "rollout.check_behaviour_logprobs" not in out
    # the behaviour check's host copies: (s + 1) x a TP2 rank's half of the 8.19e9 bf16
    # parameters = 2 x 7.6 GiB
    assert rl_validate_main(base + ["rollout.num_ranks=8",
                                    "rollout.check_behaviour_logprobs=true"]) == 0
    assert ("host memory per training rank for rollout.check_behaviour_logprobs (estimate, "
            "GiB): 15.3 (1 kept version(s)") in capsys.readouterr().out
    assert rl_validate_main(base + ["rollout.num_ranks=6"]) == 2
    refused = capsys.readouterr()
    assert "rollout.num_ranks=6 must be whole nodes of 8 GPUs" in refused.out + refused.err


def test_version_schedule_is_what_both_sides_expect():
    """engine.rl.disaggregated.schedule: the versions the trainer sends (a batch or a validation needs
    them) and the version of each batch."""
    from engine.rl.collect.validation import validates_before_training
    from engine.rl.config import RLConfig
    from engine.rl.disaggregated.schedule import batch_version, version_needed, versions_after
    cfg = RLConfig()
    cfg.train.max_steps, cfg.rollout.max_staleness = 4, 1
    assert [batch_version(k, 1) for k in range(4)] == [0, 0, 1, 2]
    assert versions_after(cfg, 0) == [1, 2]          # version 3 and 4: no batch needs them
    cfg.data.val_files, cfg.train.val_interval = ["v.jsonl"], 2
    assert versions_after(cfg, 0) == [1, 2, 4] and versions_after(cfg, 2) == [4]
    assert not version_needed(cfg, 3) and version_needed(cfg, 4) and not version_needed(cfg, 5)
    cfg.rollout.max_staleness = 0
    assert versions_after(cfg, 0) == [1, 2, 3, 4]
    assert not validates_before_training(cfg, 0)
    cfg.val.before_train = True
    assert validates_before_training(cfg, 0) and not validates_before_training(cfg, 2)
