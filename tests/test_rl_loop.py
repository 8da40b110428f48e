"""The GRPO/DAPO loop: configuration, rollout batches, the command line end to end (one
generate call per rollout batch, weight sync parity), and policy-loss layout invariance.

Multi-rank parts run with gloo on the tiny qwen3 model (4 layers, hidden 64): the runs of the
command line (end to end) and the invariance scripts on the session's rank pool
(tests/pool.py) as torchrun would run them (real `torchrun -m engine.rl` launches: see
test_cli_generates_once_per_step_and_syncs_weights); the refusal of an unknown algorithm in
this process (tests.launch.run_main)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.config.schema import ConfigError, load_config
from engine.data.files import DataError
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import validate_rl
from engine.rl.collect.batch import RolloutBatch, build_sequences
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.rl.policy.update import split_mini_batches
from engine.generation import Generation
from tests.launch import result_lines, run_cli
from tests.generate_only import GenerateOnlyEngine
from tests.multirank.muon_check import MUON_RUNS
# reward.fn=tests.test_rl_loop:digit_reward (many tests): defined in a module without imports, so
# the reward pool's worker processes import that module, not this one (tests/rl_rewards.py)
from tests.rl_rewards import digit_reward  # noqa: E402,F401
from tools.tiny_models import build_tiny_model

INVARIANCE = "tests/multirank/rl_invariance.py"
REQUIRED_METRICS = (
    "reward/mean", "reward/std", "reward/frac_zero_std_groups", "reward/errors",
    "response/length_mean", "response/clip_ratio", "policy/loss", "policy/clipfrac_low",
    "policy/clipfrac_high", "policy/kl", "policy/entropy", "grad_norm", "rollout/generate_calls",
    "rollout/num_gen_batches", "rollout/logprob_diff", "rollout/tokens_per_s", "time/rollout_s",
    "time/train_s", "time/weight_sync_s", "time/step_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("rl_model")
    return build_tiny_model(str(root / "qwen3"), "qwen3", hidden=64, layers=4, heads=8,
                            kv_heads=2, seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE policy (8 experts, top 2) with the dense model's tokenizer size."""
    root = tmp_path_factory.mktemp("rl_moe")
    return build_tiny_model(str(root / "qwen3_moe"), "qwen3_moe", hidden=64, layers=2, heads=8,
                            kv_heads=2, seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rl_data") / "add.jsonl"
    with open(path, "w") as f:
        for i in range(32):
            a, b = i % 10, (3 * i + 1) % 10
            f.write(json.dumps({"prompt": f"what is {a} plus {b} ?", "answer": a + b}) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- config

def _config(argv: list[str]) -> RLConfig:
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def test_dapo_sets_paper_defaults_and_explicit_overrides_win(tmp_path):
    grpo = _config(["rollout.max_new_tokens=100"])
    assert (grpo.clip.eps_low, grpo.clip.eps_high, grpo.kl.beta) == (0.2, 0.2, 0.001)
    assert not grpo.dapo.dynamic_sampling and grpo.dapo.overlong_buffer == 0
    assert grpo.loss.agg_mode == "token-mean"

    dapo = _config(["algorithm=dapo", "rollout.max_new_tokens=100"])
    assert (dapo.clip.eps_low, dapo.clip.eps_high, dapo.kl.beta) == (0.2, 0.28, 0.0)
    assert dapo.dapo.dynamic_sampling and dapo.dapo.overlong_buffer == 20  # 100 // 5
    assert dapo.loss.agg_mode == "token-mean" and dapo.optim.lr == 1e-6

    yaml = tmp_path / "run.yaml"
    yaml.write_text("kl:\n  beta: 0.5\nloss:\n  agg_mode: seq-mean-token-mean\n")
    mixed = _config(["algorithm=dapo", "clip.eps_high=0.3", "dapo.dynamic_sampling=false",
                     "--config", str(yaml)])
    assert mixed.clip.eps_high == 0.3 and not mixed.dapo.dynamic_sampling
    assert mixed.kl.beta == 0.5 and mixed.loss.agg_mode == "seq-mean-token-mean"
    assert mixed.clip.eps_low == 0.2 and mixed.dapo.overlong_buffer == 256 // 5


def test_validate_names_key_and_choices(model_dir, prompts_file):
    base = [f"model.hf_path={model_dir}", f"data.train_files=[{prompts_file}]"]
    assert validate_rl(_config(base), 1)["num_hidden_layers"] == 4
    cases = {"kl.estimator=k4": "kl.estimator='k4' is not valid; choose one of k1, k2, k3",
             "rollout.backend=trtllm": "rollout.backend='trtllm' is not known; choose one of "
                                       "hf, vllm, sglang or give your own as "
                                       "package.module:ClassName",
             "rollout.n=1": "rollout.n=1 must be >= 2",
             "clip.dual_c=0.5": "clip.dual_c=0.5 must be > 1",
             "reward.fn=nomodule": "reward.fn: reward function spec 'nomodule'",
             "train.seq_length=64": "train.seq_length=64 must exceed rollout.max_new_tokens=256",
             "train.recompute=all": "train.recompute='all' is not valid; choose one of none, "
                                    "selective, full",
             "train.recompute_num_layers=3": "train.recompute_num_layers=3 applies only to "
                                             "train.recompute=full",
             "train.old_logprobs=never": "train.old_logprobs='never' is not valid; choose one "
                                         "of auto, recompute"}
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_rl(_config(base + [override]), 1)


def test_old_logprobs_source_is_a_function_of_the_config():
    """The old log-probs come from the training forward exactly where nothing can move the
    policy before, or read pi_old ahead of, the step's one update; each other case names its
    reason (the run header's line); recompute with bypass mode is refused by name."""
    from engine.rl.policy.old_logprobs import old_logprobs_plan, old_logprobs_problems

    plan = old_logprobs_plan(RLConfig())
    assert plan.from_forward and plan.describe().startswith(
        "old log-probs: from the training forward (on-policy: one mini-batch, one epoch")
    for keys, reason in [({"train.old_logprobs": "recompute"}, "train.old_logprobs=recompute"),
                         ({"train.epochs_per_rollout": 2}, "train.epochs_per_rollout=2"),
                         ({"train.mini_batches_per_step": 4}, "train.mini_batches_per_step=4"),
                         ({"rollout_correction.rollout_is": "token"}, "rollout_correction."),
                         ({"distill.teacher_path": "/t"}, "distill.teacher_path"),
                         ({"moe.routing_replay": "R2"}, "moe.routing_replay=R2"),
                         ({"moe.routing_replay": "R3"}, "moe/rollout_replay_mismatch")]:
        cfg = RLConfig()
        for key, value in keys.items():
            group, name = key.split(".")
            setattr(getattr(cfg, group), name, value)
        plan = old_logprobs_plan(cfg)
        assert plan.source == "recompute" and reason in plan.reason, (keys, plan)
        assert plan.describe().startswith("old log-probs: separate pass because ")
    cfg = RLConfig()
    cfg.rollout_correction.bypass_mode = True
    assert old_logprobs_plan(cfg).source == "rollout" and old_logprobs_problems(cfg) == []
    cfg.train.old_logprobs = "recompute"
    (problem,) = old_logprobs_problems(cfg)
    assert "train.old_logprobs=recompute" in problem and "bypass_mode=true" in problem


def test_unknown_algorithm_exits_2_listing_choices(model_dir, prompts_file):
    proc = run_cli("engine.rl", "algorithm=trpo", f"model.hf_path={model_dir}",
                   f"data.train_files=[{prompts_file}]")
    assert proc.returncode == 2
    assert "algorithm='trpo' is not valid; choose one of grpo, ppo, dapo" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- rollout batch

class ScriptedEngine(GenerateOnlyEngine):
    """Answers "what is a plus b ?" prompts from a script: call 1 answers "0" everywhere (every
    group all wrong), later calls answer right at even positions and "0 0 0 0" (4 tokens, no
    eos: a length-clipped response) at odd ones."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def _generate(self, prompts, params):
        out = []
        for i, prompt in enumerate(prompts):
            a, b = (int(d) for d in re.findall(r"\d", self.tokenizer.decode(prompt)))
            if self.num_generate_calls == 1:
                text, stop = "0", True
            else:
                text, stop = (str(a + b), True) if i % 2 == 0 else ("0 0 0 0", False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids += [self.tokenizer.eos_token_id] if stop else []
            out.append(Generation(prompt, ids, [-0.5] * len(ids), "stop" if stop else "length"))
        return out


def _collector(model_dir, argv):
    from transformers import AutoTokenizer

    from engine.rl.rewards import load_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    cfg = _config(["rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=4",
                   "data.shuffle=false", "train.seq_length=64"] + argv)
    return RolloutCollector(ScriptedEngine(tokenizer), rows, tokenizer, load_reward_fn("math"),
                            cfg)


def test_dynamic_sampling_generates_until_full(model_dir):
    collector = _collector(model_dir, ["algorithm=dapo", "dapo.overlong_buffer=2"])
    batch = collector.collect()
    m = batch.metrics
    assert m["rollout/generate_calls"] == 2 and m["rollout/num_gen_batches"] == 2
    assert len(batch) == 4 and m["train/groups"] == 2
    # call 1: 4 wrong (2 groups with zero std); call 2: 2 right, 2 wrong -> 2 of 8 right
    assert m["reward/mean"] == pytest.approx(0.25)
    assert m["reward/frac_zero_std_groups"] == pytest.approx(0.5)
    assert m["response/clip_ratio"] == pytest.approx(0.25)
    # 4-token responses at max_new_tokens=4, buffer 2: penalty -1 each (2 of 8)
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-0.25)
    # group rewards [1, -1] (right / wrong and overlong): (r - 0) / (std=sqrt(2)) = +-0.7071
    assert batch.advantages == pytest.approx([0.70710678, -0.70710678] * 2, abs=1e-5)
    assert batch.prompt_ids[0] == batch.prompt_ids[1] != batch.prompt_ids[2]


def test_grpo_generates_once_and_dapo_budget_can_run_out(model_dir):
    grpo = _collector(model_dir, []).collect()
    assert grpo.metrics["rollout/generate_calls"] == 1 and len(grpo) == 4
    assert grpo.advantages == [0.0] * 4  # every group all wrong: zero advantages
    empty = _collector(model_dir, ["algorithm=dapo", "dapo.max_gen_batches=1"]).collect()
    assert len(empty) == 0 and empty.metrics["train/groups"] == 0
    assert empty.metrics["rollout/num_gen_batches"] == 1


def test_over_long_prompts_follow_data_truncation(model_dir, tmp_path, capsys):
    """Checked for every prompt before training: "right" drops and counts, "error" names
    file:line, nothing left is an error."""
    from transformers import AutoTokenizer

    from engine.data.datasets import load_prompt_rows, render_prompt
    from engine.rl.collect.prompts import fit_prompt_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": 1}) + "\n" for p in
                            ["1 + 2 ?", "what is " + "9 plus " * 20 + "1 ?", "3 + 4 ?"]))
    locations: list[str] = []
    rows = load_prompt_rows([str(path)], locations)
    assert locations == [f"{path}:{i}" for i in (1, 2, 3)]
    limit_args = ["rollout.max_new_tokens=8", "train.seq_length=40"]
    kept, ids = fit_prompt_rows(rows, locations, tokenizer, _config(limit_args))
    assert [r["prompt"] for r in kept] == ["1 + 2 ?", "3 + 4 ?"]
    assert ids == [render_prompt(r["prompt"], tokenizer) for r in kept]
    assert f"dropped 1 of 3 prompts longer than 33 tokens (data.truncation=right), first at " \
        f"{path}:2" in capsys.readouterr().out
    with pytest.raises(DataError, match=re.escape(f"{path}:2: the prompt renders to")):
        fit_prompt_rows(rows, locations, tokenizer, _config(limit_args + ["data.truncation=error"]))
    # nothing fits: the refusal names the lengths it saw, the shortest and longest with their
    # file:line, and the train.seq_length the shortest needs (here 9 + 1 - 8 = 2 tokens fit)
    lengths = [len(render_prompt(r["prompt"], tokenizer)) for r in rows]
    assert lengths[0] == min(lengths) > 2 and lengths[1] == max(lengths)
    with pytest.raises(DataError) as refused:
        fit_prompt_rows(rows, locations, tokenizer, _config(["rollout.max_new_tokens=8",
                                                             "train.seq_length=9"]))
    assert str(refused.value).startswith("every prompt of data.train_files is longer than 2 ")
    assert (f"its 3 prompts render to {lengths[0]} ({path}:1) to {lengths[1]} ({path}:2) "
            f"tokens; raise train.seq_length to at least {lengths[0] + 7}") in str(refused.value)


def test_too_long_prompt_is_a_data_error(model_dir):
    collector = _collector(model_dir, ["train.seq_length=8"])
    with pytest.raises(DataError, match="prompt row .* renders to .* tokens"):
        collector.collect()


def test_sequences_align_extras_with_labels():
    batch = RolloutBatch([[5, 6, 7], [5, 6, 7]], [[8, 3], [9]], [[-0.1, -0.2], [-0.3]],
                         [0.5, -0.5])
    a, b = build_sequences(batch)
    assert (a.tokens, a.labels, a.loss_mask) == ([5, 6, 7, 8], [6, 7, 8, 3], [0, 0, 1, 1])
    assert a.extras == {"advantages": [0, 0, 0.5, 0.5], "rollout_logprobs": [0, 0, -0.1, -0.2]}
    assert (b.tokens, b.labels, b.loss_mask) == ([5, 6, 7], [6, 7, 9], [0, 0, 1])
    assert b.extras["advantages"] == [0, 0, -0.5]


def test_mini_batch_split_is_a_seeded_partition():
    parts = split_mini_batches(10, 3, seed=1, step=4, epoch=0)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert parts == split_mini_batches(10, 3, seed=1, step=4, epoch=0)
    assert parts != split_mini_batches(10, 3, seed=1, step=4, epoch=1)
    assert split_mini_batches(4, 2, 1, 0, 0, shuffle=False) == [[0, 1], [2, 3]]


# ----------------------------------------------------------------------------- end to end

def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_generates_once_per_step_and_syncs_weights(pools, model_dir, prompts_file,
                                                       tmp_path):
    """The engine.rl command line as a user starts it, on the 2-rank pool (as torchrun runs
    it; the real launches of engine.rl that check every rank's exit code are
    tests/test_rl_validation.py's resume and tests/test_rl_ppo.py's, and in the second tier
    tests/test_rl_async.py's)."""
    log_dir = tmp_path / "run"
    proc = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{prompts_file}]",
        "parallel.tp=2", "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4",
        "train.mini_batches_per_step=2", "train.micro_batch_size=2", "train.max_steps=2",
        "train.prefix_sharing=false",   # micro_batch_size counts sequences (not groups)
        "train.seq_length=64", "optim.lr=1e-3", "kl.beta=0.05", "entropy_coef=0.001",
        "reward.fn=tests.test_rl_loop:digit_reward", "rollout.check_weight_sync=true",
        f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0",
        f"logging.dir={log_dir}", "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0
    # the prompts were rendered once into data.cache_dir (both ranks read the one entry)
    assert len([p for p in (tmp_path / "cache").glob("prompts-*") if p.is_dir()]) == 1
    steps = _metrics(log_dir)
    assert len(steps) == 2
    for m in steps:
        assert all(k in m for k in REQUIRED_METRICS), set(REQUIRED_METRICS) - set(m)
        assert m["rollout/generate_calls"] == 1 and m["rollout/num_gen_batches"] == 1
        # 16 responses -> 2 mini-batches of 8 -> 4 micro-batches of 2 each (accumulation)
        assert m["train/optimizer_steps"] == 2 and m["train/micro_batches"] == 8
        assert m["reward/errors"] == 0 and m["reward/std"] > 0
        assert m["rollout/logprob_diff"] < 1e-3  # rollout engine == trainer weights
        assert m["debug/sync_logit_max_diff"] < 1e-4  # HF engine logits == Megatron's
        assert m["debug/sync_logit_change"] > 1e-2   # ... after the weights really moved
        assert m["grad_norm"] > 0 and m["policy/kl"] > 0
    assert "first reward" in proc.stdout
    assert list(log_dir.glob("events.out.tfevents*"))


def test_cli_moe_policy_with_expert_parallelism(pools, moe_dir, prompts_file, tmp_path):
    """GRPO on the Qwen3-MoE policy at DP2 x EP2 with the HF rollout backend: the weight sync
    gathers every expert over EP into the engine (its logits equal the trainer's after the
    weights moved), rollout/logprob_diff stays at the dense test's level, the frozen KL
    reference runs, and the router's load-balancing loss and load metric are logged."""
    log_dir = tmp_path / "moe"
    proc = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={moe_dir}", f"data.train_files=[{prompts_file}]",
        "parallel.ep=2", "moe.aux_loss_coeff=0.01", "rollout.n=4", "rollout.max_new_tokens=8",
        "train.prompts_per_step=4", "train.mini_batches_per_step=2",
        "train.micro_batch_size=2", "train.max_steps=2", "train.seq_length=64",
        "optim.lr=1e-3", "kl.beta=0.05", "reward.fn=tests.test_rl_loop:digit_reward",
        "rollout.check_weight_sync=true", f"logging.dir={log_dir}",
        "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _metrics(log_dir)
    assert len(steps) == 2
    for m in steps:
        assert all(k in m for k in REQUIRED_METRICS), set(REQUIRED_METRICS) - set(m)
        assert m["rollout/logprob_diff"] < 1e-3
        assert m["debug/sync_logit_max_diff"] < 1e-4
        assert m["debug/sync_logit_change"] > 1e-2
        assert m["policy/kl"] > 0 and m["grad_norm"] > 0
        assert m["moe/aux_loss"] > 0 and 1.0 <= m["moe/expert_load_max_over_mean"] <= 8.0
    assert "ep=2" in proc.stdout


# One reference launch and one 4-rank launch for every RL invariance spec: the dense policy
# at DP4, TP2, PP2 and CP2 x DP2 (packing); the Qwen3-MoE policy at EP2 x DP4 and EP2 x TP2
# (+SP) x DP2; the T=1 policy (flag t1) at DP4 and TP2 x DP2. Flag ov: gradient-reduce and
# parameter-gather overlap on (PP2 x DP2, CP2 x DP2, both MoE layouts, T=1 DP4), compared with
# the same overlap-off single-process reference, weight sync included.
# optim.name=muon (megatron-core's Muon): the dense policy at TP2 x DP2 against its own
# single-process Muon run.
RL_SPECS = ["1,1,1,1", "2,1,1,1,sp", "1,2,1,1,ov", "1,1,2,1,packing+ov",
            "1,1,1,1,moe+ep=2+ov", "2,1,1,1,moe+ep=2+sp+ov", "1,1,1,1,t1+ov", "2,1,1,1,t1",
            *(["2,1,1,1,muon"] if MUON_RUNS else [])]


@pytest.fixture(scope="module")
def rl_invariance(pools, model_dir, moe_dir, tmp_path_factory) -> dict:
    """{"ref": {(spec, mode): result}, "results": [...], "control": {...}}. The T=1 policy:
    vocabulary 256, so each TP slice holds 128 rows and no padding, entropy_coef != 0."""
    root = tmp_path_factory.mktemp("rl_inv")
    t1_dir = build_tiny_model(str(root / "qwen3_v256"), "qwen3", vocab_size=256, hidden=64,
                              layers=2, heads=8, kv_heads=2, seed=1, initializer_range=0.2)
    ref_file = str(root / "rl_ref.pt")
    env = {"INV_MOE_MODEL_DIR": moe_dir, "INV_T1_MODEL_DIR": t1_dir}
    ref = pools.script(1, INVARIANCE, model_dir, ref_file, "1,1,1,2", "1,1,1,2,moe",
                       "1,1,1,2,t1", *(["1,1,1,2,muon"] if MUON_RUNS else []), timeout=600,
                       env=env)
    assert ref.returncode == 0
    proc = pools.script(4, INVARIANCE, model_dir, ref_file, *RL_SPECS, timeout=900, env=env)
    assert proc.returncode == 0
    return {"ref": {(r["spec"], r.get("variant") or r["mode"]): r
                    for r in result_lines(ref.stdout)},
            "results": result_lines(proc.stdout),
            "control": result_lines(proc.stdout, "CONTROL ")[0],
            "control_cp": result_lines(proc.stdout, "CONTROL_CP ")[0],
            "onpolicy": result_lines(ref.stdout, "ONPOLICY ")
            + result_lines(proc.stdout, "ONPOLICY "),
            "control_old": result_lines(ref.stdout, "CONTROL_OLD ")[0]}


def _assert_matches_reference(r: dict) -> None:
    where = f"{r['spec']} {r['mode']}"
    assert r["loss_rel"] <= 1e-5, where
    assert r["grad_norm_rel"] <= 1e-5, where
    assert r["metrics_rel"] <= 1e-5, where
    assert r["param_rel"] <= 1e-5, where
    assert r["logprob_max_diff"] <= 1e-5, where


def test_policy_update_is_layout_invariant(rl_invariance):
    """The dense and the Qwen3-MoE policy at every layout give the single-process losses,
    grad norms, metrics, log-probs and synced weights (experts gathered over EP into the
    rollout engine)."""
    refs = {k: r for k, r in rl_invariance["ref"].items()
            if not r.get("variant") and "muon" not in k[0]}
    assert len(refs) == 6
    for (spec, _), r in refs.items():  # the fixed batch exercises every term of the loss
        m = r["metrics"]
        if "t1" in spec:
            assert min(m["policy/entropy"]) > 0
            continue
        assert min(m["policy/clipfrac_low"]) > 0 and min(m["policy/clipfrac_high"]) > 0
        assert min(m["policy/kl"]) > 0 and min(m["policy/entropy"]) > 0
    results = [r for r in rl_invariance["results"]
               if "t1" not in r["spec"] and "muon" not in r["spec"] and not r.get("variant")]
    assert len(results) == 6 * 2
    for r in results:
        _assert_matches_reference(r)
        # dense: 46 HF tensors; MoE: 2 layers x (8 attention/norm + router + 8 experts x 3)
        # + embeddings, final norm, output layer
        assert r["n_params"] == (2 * (8 + 1 + 8 * 3) + 3 if "moe" in r["spec"] else 46), r
    control = rl_invariance["control"]
    assert abs(control["mean_of_means"] - control["reference"]) > 1e-3 * abs(control["reference"])


@pytest.mark.skipif(not MUON_RUNS, reason="optim.name=muon does not run here")
def test_muon_policy_update_is_layout_invariant_and_differs_from_adamw(rl_invariance):
    """optim.name=muon for the RL policy update: TP2 x DP2 gives the single-process Muon
    run's losses, grad norms, metrics, log-probs and synced weights, in both modes; its second
    step's loss differs from AdamW's (same first step: same weights)."""
    results = [r for r in rl_invariance["results"] if "muon" in r["spec"]]
    assert len(results) == 2
    for r in results:
        _assert_matches_reference(r)
    for mode in ("token-mean", "seq-mean-token-mean"):
        m = rl_invariance["ref"][("1,1,1,2,muon", mode)]["loss"]
        a = rl_invariance["ref"][("1,1,1,2", mode)]["loss"]
        assert m[0] == pytest.approx(a[0], rel=1e-5)
        assert abs(m[1] - a[1]) > 1e-3 * abs(a[1]), (m, a)


def test_new_losses_estimators_and_corrections_are_layout_invariant(rl_invariance):
    """gspo, geo_mean, cispo, sapo, REINFORCE++ (+baseline), rloo, rollout IS (token, sequence,
    batch-normalised), rejection (token_k1, token_k2, seq_sum_k1, seq_mean_k3, seq_max_k3) and
    bypass mode (ppo_clip, reinforce) at DP4, TP2+SP and PP2, and the variants with whole-sequence
    quantities in the update forward (GSPO, GMPO, bypass sequence IS) at CP2+packing, give the
    single-process losses, grad norms, metrics (rollout_corr/*) and weights. One optimizer step on
    the whole batch from the loaded weights: the loss, metrics and grad norm at identical weights,
    the weights after the step (tests/multirank/rl_variants.py says why not a second step: its
    near-zero loss after an lr-1e-2 step is float32 noise at 1e-5). Negative control: GSPO's
    sequence ratio from each CP shard's own tokens changes the loss."""
    from tests.multirank.rl_variants import CP_VARIANTS, VARIANTS

    refs = {k: r for k, r in rl_invariance["ref"].items() if k[1] in VARIANTS}
    assert {k[1] for k in refs} == set(VARIANTS)
    for (_, variant), r in refs.items():  # every correction really rejects / reweights
        m = r["metrics"]
        assert max(abs(x) for x in m["policy/pg_loss"]) > 0, variant
        if "rollout_rs" in VARIANTS[variant][3]:
            assert any(0 < x < 1 for x in m["rollout_corr/masked_token_fraction"]), variant
    results = [r for r in rl_invariance["results"] if r.get("variant")]
    assert sorted({r["spec"] for r in results}) == sorted(RL_SPECS[:4])
    assert len(results) == 3 * len(VARIANTS) + len(CP_VARIANTS)
    assert all(len(r["loss"]) == 1 for r in results)
    for r in results:
        _assert_matches_reference(r)
    control = rl_invariance["control_cp"]
    assert _rel_diff(control["per_shard"], control["reference"]) > 1e-3


def test_old_logprobs_from_the_training_forward_equal_the_separate_pass(rl_invariance):
    """train.old_logprobs=auto on an exactly on-policy step (one mini-batch, one epoch, no
    rollout correction) takes the old log-probs from the training forward, detached, and skips
    the separate pass: 3 whole RL steps (log-prob stage with a frozen KL reference, then the
    update; tests/multirank/rl_old_logprobs.py) at 1 process, DP4, TP2+SP x DP2, PP2 x DP2 and
    CP2 x DP2 (packing) give the 1-process train.old_logprobs=recompute run's losses, grad
    norms, metrics (clip fractions 0 on both, rollout/logprob_diff[_max] measured by the
    training forward) and weights (rel 1e-5). Negative control: the separate pass on perturbed
    weights (stale old log-probs) changes the losses."""
    runs = rl_invariance["onpolicy"]
    (ref,) = [r for r in runs if r.get("reference")]
    assert ref["world"] == 1
    for key in ("policy/clipfrac_low", "policy/clipfrac_high"):
        assert max(ref["metrics"][key]) == 0, key
    assert min(ref["metrics"]["policy/kl"]) >= 0 and max(ref["metrics"]["policy/kl"]) > 0
    compared = [r for r in runs if not r.get("reference")]
    assert sorted((r["world"], r["spec"]) for r in compared) == sorted(
        [(1, "1,1,1,2")] + [(4, s) for s in RL_SPECS[:4]])
    for r in compared:
        where = f"{r['spec']} at {r['world']}"
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-5, where
        assert r["param_rel"] <= 1e-5, where
        assert max(r["metrics_rel"].values()) <= 1e-5, (where, r["metrics_rel"])
        for key in ("policy/clipfrac_low", "policy/clipfrac_high"):
            assert max(r["metrics"][key]) == 0, (where, key)
    control = rl_invariance["control_old"]
    assert _rel_diff(control["stale"], control["reference"]) > 1e-3


def _rel_diff(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_policy_update_is_layout_invariant_at_temperature_1_with_unpadded_vocab(rl_invariance):
    """fp32 logits at T = 1.0 with a vocabulary whose TP slices hold no padding rows and
    entropy_coef != 0: nothing copies the logits before megatron's in-place cross-entropy, the
    case where entropy used to be computed from mutated logits (loss and gradient wrong)."""
    results = [r for r in rl_invariance["results"] if "t1" in r["spec"]]
    t1_specs = {s for s in RL_SPECS if "t1" in s}   # DP4 (with overlap: ov) and TP2 x DP2
    assert {r["spec"] for r in results} == t1_specs and len(results) == 4
    for r in results:
        _assert_matches_reference(r)
        assert r["n_params"] == 2 * 11 + 2  # 2 layers of 11 tensors, tied embedding, norm


def test_cli_dapo_on_4_ranks_with_tp2_and_accumulation(pools, model_dir, prompts_file,
                                                       tmp_path):
    """DAPO end to end as a user launches it: 4 ranks (TP2 x DP2, sequence parallelism on by
    default at tp 2), accumulation, selective recomputation, dynamic sampling; every generation
    batch is one generate call."""
    log_dir = tmp_path / "dapo"
    proc = pools.script(
        4, "-m", "engine.rl", "algorithm=dapo", f"model.hf_path={model_dir}",
        f"data.train_files=[{prompts_file}]", "parallel.tp=2", "rollout.n=4",
        "rollout.max_new_tokens=8", "train.prompts_per_step=4", "train.mini_batches_per_step=1",
        "train.micro_batch_size=2", "train.max_steps=1", "train.seq_length=64", "optim.lr=1e-3",
        "train.prefix_sharing=false",   # micro_batch_size counts sequences (not groups)
        "dapo.max_gen_batches=3", "reward.fn=tests.test_rl_loop:digit_reward",
        "train.recompute=selective",
        f"logging.dir={log_dir}", "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0
    assert "policy model: sequence parallelism on, recompute selective (core_attn)" in proc.stdout
    assert "[rl] kernels: Transformer Engine not installed: torch layers" in proc.stdout
    (m,) = _metrics(log_dir)
    assert 1 <= m["rollout/num_gen_batches"] <= 3
    assert m["rollout/generate_calls"] == m["rollout/num_gen_batches"]
    assert m["train/micro_batches"] > m["train/optimizer_steps"] >= 1   # accumulation
    assert m["rollout/logprob_diff"] < 1e-3


# Multi-turn batches (flag mt: loss masks with holes, tests/multirank/rl_multi_turn.py) at DP4,
# TP2+SP, PP2, CP2 x DP2 with packing and dynamic micro-batches at DP4: their own two runs
# (the main RL invariance run is near its time limit on 2 cores).
MT_SPECS = ["1,1,1,1,mt", "2,1,1,1,mt+sp", "1,2,1,1,mt", "1,1,2,1,mt+packing",
            "1,1,1,4,mt+dyn=40"]


@pytest.fixture(scope="module")
def rl_invariance_mt(pools, model_dir, tmp_path_factory) -> dict:
    """{"ref": [...], "results": [...], "control": {...}} of the multi-turn specs."""
    ref_file = str(tmp_path_factory.mktemp("rl_inv_mt") / "rl_ref.pt")
    ref = pools.script(1, INVARIANCE, model_dir, ref_file, "1,1,1,2,mt", timeout=600)
    assert ref.returncode == 0
    proc = pools.script(4, INVARIANCE, model_dir, ref_file, *MT_SPECS, timeout=600)
    assert proc.returncode == 0
    return {"ref": result_lines(ref.stdout), "results": result_lines(proc.stdout),
            "control": result_lines(ref.stdout, "CONTROL_MT ")[0]}


def test_multi_turn_policy_update_is_layout_invariant(rl_invariance_mt):
    """Multi-turn episodes (sampled turns with observations between them: loss masks with
    holes) at DP4, TP2+SP, PP2, CP2 x DP2 with packing and dynamic micro-batches give the
    single-process losses, grad norms, metrics and synced weights (rel 1e-5) and log-probs
    (abs 2e-5).
    Negative control: the same batch with the observation tokens trained changes the loss."""
    mt = rl_invariance_mt
    assert {r["mode"] for r in mt["ref"]} == {"token-mean", "seq-mean-token-mean"}
    assert sorted({r["spec"] for r in mt["results"]}) == sorted(MT_SPECS)
    assert len(mt["results"]) == 2 * len(MT_SPECS)
    for r in mt["results"]:
        where = f"{r['spec']} {r['mode']}"
        for key in ("loss_rel", "grad_norm_rel", "metrics_rel", "param_rel"):
            assert r[key] <= 1e-5, (where, key, r[key])
        # absolute, on log-probs of magnitude ~5-15 (every position of the longer episodes;
        # measured up to 1.05e-5 at DP4): relative ~1e-6
        assert r["logprob_max_diff"] <= 2e-5, where
        assert r["n_params"] == 46
    control = mt["control"]
    assert max(abs(x - y) / abs(y) for x, y in zip(control["observations_trained"],
                                                    control["reference"])) > 1e-3
