"""Validation during RL (engine.rl.collect.validation): the pass@k estimator against its closed forms,
the metrics per data_source, the key checks, and runs through the command line.

Runs (tiny qwen3, 2 ranks, 2 rollout engines, 4 RL steps; gloo on CPU):
  N   no validation;
  V   the same run with data.val_files, train.val_interval=2, val.n=4, val.temperature=1,
      val.before_train: validation at steps 0, 2, 4;
  S   V stopped after step 2 (train.exit_interval=2, saved), then S2 resumes it for steps 3-4.
Checks: N and V train identically (every non-timing metric of every step equal); V's step-0
validation equals an independent recomputation (the initial model in this process, the same
seeds, the reward, the closed-form pass@k); the resumed run logs the same validation metrics at
the same steps.
"""
from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.rl.checks import val_problems
from engine.rl.collect.validation import pass_at_k, pass_ks, val_seeds, validation_metrics
from tests.launch import run_torchrun
from tests.generate_only import GenerateOnlyEngine
from tools.tiny_models import build_tiny_model
from tests.rl_rewards import digit_reward

STEPS = 4
THRESHOLD = 0.25


def test_pass_at_k_matches_its_closed_forms():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # fraction of the k-subsets of n samples holding at least one pass
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                product = 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(brute, abs=1e-12)
                assert got == pytest.approx(product, abs=1e-12)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)   # pass@1 = c / n
    assert pass_ks(1) == [1] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(7) == [1, 2, 4]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_validation_metrics_overall_and_per_data_source():
    scores = [1.0, 0.0, 0.0, 0.0,    # prompt 0 (source a): c = 1
              1.0, 1.0, 0.0, 1.0,    # prompt 1 (source b): c = 3
              0.0, 0.0, 0.0, 0.0]    # prompt 2 (source a): c = 0
    m = validation_metrics(scores, 4, 1.0, ["a", "b", "a"])
    assert m["val/reward_mean"] == pytest.approx(4 / 12)
    assert m["val/pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert m["val/pass@2"] == pytest.approx((1 - 3 / 6 + 1 - 0 + 0) / 3)  # C(3,2)/C(4,2)
    assert m["val/pass@4"] == pytest.approx(2 / 3)
    assert m["val/a/pass@1"] == pytest.approx(1 / 8) and m["val/b/pass@1"] == pytest.approx(0.75)
    assert m["val/a/reward_mean"] == pytest.approx(1 / 8) and m["val/b/pass@4"] == 1.0
    assert not any(k.startswith("val/None") for k in validation_metrics(
        scores, 4, 1.0, [None, "b", None]))
    assert validation_metrics(scores, 4, 0.5, [None] * 3)["val/pass@1"] == m["val/pass@1"]


def test_validation_seeds_are_a_separate_stream():
    from engine.generation.work_split import batch_seeds

    seeds = val_seeds(1234, 3, 4)
    assert len(set(seeds)) == 12 and all(0 <= s < 2 ** 63 for s in seeds)
    assert seeds == val_seeds(1234, 3, 4) and seeds != val_seeds(1235, 3, 4)
    assert not set(seeds) & {s for b in range(50) for s in batch_seeds(1234, b, 3, 4)}


def test_validation_keys_are_checked(tmp_path):
    from engine.rl.config import RLConfig

    def problems(**kw) -> list[str]:
        cfg = RLConfig()
        for key, value in kw.items():
            group, name = key.split("__")
            setattr(getattr(cfg, group), name, value)
        return val_problems(cfg)

    assert problems() == []
    assert problems(data__val_files=["v.jsonl"], train__val_interval=2, val__n=4,
                    val__temperature=0.8) == []
    assert "train.val_interval=-1 must be an integer >= 0 (0: off)" in problems(
        train__val_interval=-1)
    assert any(p.startswith("train.val_interval / val.before_train need data.val_files")
               for p in problems(train__val_interval=2))
    assert any(p.startswith("data.val_files is set but validation never runs")
               for p in problems(data__val_files=["v.jsonl"]))
    assert any(p.startswith("val.n=4 with val.temperature=0 (greedy)") for p in problems(
        data__val_files=["v.jsonl"], val__before_train=True, val__n=4))
    assert "val.n=0 must be an integer >= 1" in problems(val__n=0)
    assert "val.temperature=-1.0 must be >= 0 (0: greedy)" in problems(val__temperature=-1.0)


def test_a_missing_val_file_is_refused_before_any_process_group(tmp_path):
    from engine.config.schema import ConfigError, load_config
    from engine.rl.checks import validate_rl
    from engine.rl.config import RLConfig

    model = build_tiny_model(str(tmp_path / "m"), "qwen3", hidden=64, layers=2, heads=8,
                             kv_heads=2, seed=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 ?", "answer": "2"}) + "\n")
    cfg, _ = load_config(RLConfig, [f"model.hf_path={model}", f"data.train_files=[{prompts}]",
                                    f"data.val_files=[{tmp_path / 'nope.jsonl'}]",
                                    "train.val_interval=1"])
    with pytest.raises(ConfigError, match="data.val_files: file not found"):
        validate_rl(cfg, 1)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict:
    """N, S and V on the session's 2-rank pool (tests/pool.py); S2, the resume of S's
    checkpoint, a real torchrun launch (a new process reads the checkpoint)."""
    root = tmp_path_factory.mktemp("rl_val")
    model = build_tiny_model(str(root / "qwen3"), "qwen3", hidden=64, layers=4, heads=8,
                             kv_heads=2, seed=0, initializer_range=0.2)
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                         "answer": i % 10 + (3 * i + 1) % 10}) + "\n"
                             for i in range(16)))
    val = root / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"compute {i} times {i + 2}",
                                       "answer": i * (i + 2),
                                       "data_source": "mul" if i % 2 else "times"}) + "\n"
                           for i in range(5)))
    base = ["-m", "engine.rl", f"model.hf_path={model}", f"data.train_files=[{train}]",
            "train.seq_length=64", "optim.lr=1e-3", "logging.progress_bar=false",
            "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=2",
            f"train.max_steps={STEPS}", "kl.beta=0.05", "rollout.num_engines=2",
            "reward.fn=tests.rl_rewards:digit_reward", f"data.cache_dir={root / 'cache'}"]
    with_val = [*base, f"data.val_files=[{val}]", "train.val_interval=2", "val.n=4",
                "val.temperature=1.0", "val.before_train=true",
                f"val.pass_threshold={THRESHOLD}"]
    out = {"root": root, "model": model, "val": val}

    def run(name: str, argv: list[str], *extra: str, resume: bool = False):
        log = root / name
        args = (*argv, f"logging.dir={log}", f"checkpoint.dir={log / 'ckpt'}", *extra)
        if resume:
            return run_torchrun(2, *args, timeout=400)
        return pools.script(2, *args, timeout=400)

    def plain_then_stopped() -> None:
        out["N"] = run("N", base)
        out["S"] = run("S", with_val, "train.exit_interval=2")
        out["S2"] = run("S", with_val, resume=True)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(plain_then_stopped), pool.submit(lambda: out.update(
            V=run("V", with_val)))]
        for future in futures:
            future.result()
    return out


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_validation_does_not_change_training(runs):
    for name in ("N", "V"):
        _ok(runs[name])
    plain = _read_jsonl(runs["root"] / "N" / "metrics.jsonl")
    val = _read_jsonl(runs["root"] / "V" / "metrics.jsonl")
    assert [m["step"] for m in plain] == [1, 2, 3, 4]
    assert [m["step"] for m in val] == [0, 1, 2, 3, 4]
    compared = 0
    for a, b in zip(plain, val[1:]):
        for key, value in a.items():
            if key.startswith("time/") or key.endswith(("tokens_per_s", "gbps", "imbalance")):
                continue
            assert b[key] == value, (a["step"], key)
            compared += 1
    assert compared >= 4 * 15
    assert plain[-1]["policy/kl"] != plain[0]["policy/kl"]  # the policy really trained


def test_validation_metrics_appear_at_the_right_steps(runs):
    val = {m["step"]: m for m in _read_jsonl(runs["root"] / "V" / "metrics.jsonl")}
    keys = {"val/reward_mean", "val/pass@1", "val/pass@2", "val/pass@4", "val/mul/pass@4",
            "val/times/pass@1", "val/times/reward_mean", "val/response_length_mean"}
    for step in (0, 2, 4):
        assert keys <= set(val[step]), (step, sorted(val[step]))
    for step in (1, 3):
        assert not any(k.startswith("val/") for k in val[step])
    assert set(val[0]) == keys | {"val/mul/reward_mean", "val/mul/pass@1", "val/mul/pass@2",
                                  "val/times/pass@2", "val/times/pass@4", "val/reward_errors",
                                  "time/val_s", "step"}
    assert val[4]["val/reward_mean"] != val[0]["val/reward_mean"]  # the policy changed
    assert "[rl] validation before training: 5 prompts x 4" in runs["V"].stdout


def test_initial_validation_equals_an_independent_recomputation(runs):
    from transformers import AutoTokenizer

    from engine.data.render import render_prompt
    from engine.generation import SamplingParams
    from engine.generation.hf.backend import HFRolloutEngine

    rows = _read_jsonl(runs["val"])
    tokenizer = AutoTokenizer.from_pretrained(runs["model"])
    prompts = [render_prompt(r["prompt"], tokenizer, where="val") for r in rows]
    engine = HFRolloutEngine(runs["model"], device="cpu")
    gens = engine.generate([p for p in prompts for _ in range(4)], SamplingParams(
        max_new_tokens=8, temperature=1.0, seeds=val_seeds(1234, len(rows), 4)))
    scores = [digit_reward("", tokenizer.decode(g.response_ids, skip_special_tokens=True), "")
              for g in gens]
    expected = validation_metrics(scores, 4, THRESHOLD, [r["data_source"] for r in rows])
    logged = _read_jsonl(runs["root"] / "V" / "metrics.jsonl")[0]
    assert logged["step"] == 0
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert 0 < expected["val/pass@1"] < expected["val/pass@4"] <= 1  # not degenerate


def test_resumed_run_repeats_the_validation(runs):
    _ok(runs["S"])
    _ok(runs["S2"])
    assert "[rl] resumed at step 2 of 4" in runs["S2"].stdout
    assert "validation before training" not in runs["S2"].stdout
    straight = {m["step"]: m for m in _read_jsonl(runs["root"] / "V" / "metrics.jsonl")}
    resumed = _read_jsonl(runs["root"] / "S" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    for m in resumed:
        for key, value in m.items():
            if key.startswith("val/"):
                assert value == pytest.approx(straight[m["step"]][key], rel=1e-6), key
    assert sum(k.startswith("val/") for k in resumed[-1]) >= 8


class TwoStepEnv:
    """Done after 2 steps; step rewards 0.5 when the action is "7", else 0."""

    def __init__(self, row):
        self.k = 0

    def step(self, action):
        self.k += 1
        return {"observations": [{"role": "user", "content": f"again {self.k}"}],
                "reward": 0.5 if action.strip() == "7" else 0.0, "done": self.k >= 2}


def test_multi_turn_validation_runs_the_training_episodes(tmp_path):
    """With env.fn, validation runs the same episodes as training (EpisodeRunner with the
    collector's environment factory), at the validation sampling settings, and leaves the
    training generation-batch counter alone."""
    from transformers import AutoTokenizer

    from engine.config.schema import load_config
    from engine.rl.collect.collector import RolloutCollector
    from engine.rl.collect.validation import generate_for_validation
    from engine.rl.config import RLConfig
    from engine.rl.rewards import load_reward_fn
    from engine.generation import Generation, SamplingParams

    class Sevens(GenerateOnlyEngine):
        """Answers "7" + eos to every trajectory; records the sampling temperatures."""

        def __init__(self, tok):
            super().__init__()
            self.tok, self.temperatures = tok, []

        def _generate(self, prompts, params):
            self.temperatures.append(params.temperature)
            ids = self.tok.encode("7", add_special_tokens=False) + [self.tok.eos_token_id]
            return [Generation(p, ids, [-0.5] * len(ids), "stop") for p in prompts]

    model = build_tiny_model(str(tmp_path / "m"), "qwen3", hidden=32, layers=2, heads=4,
                             kv_heads=2, seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    cfg, _ = load_config(RLConfig, ["rollout.n=2", "train.seq_length=96",
                                    "rollout.max_new_tokens=4", "kl.beta=0",
                                    "env.fn=tests.test_rl_validation:TwoStepEnv"])
    rows = [{"prompt": f"what is {i} plus 7 ?", "answer": "7"} for i in range(3)]
    engine = Sevens(tok)
    collector = RolloutCollector(engine, rows, tok, load_reward_fn("math"), cfg)
    prompts = [collector._prompt_ids(i) for i in range(3) for _ in range(3)]
    params = SamplingParams(max_new_tokens=4, temperature=0.5, seeds=val_seeds(1, 3, 3))
    out = generate_for_validation(collector, [r for r in rows for _ in range(3)], prompts,
                                  params, 3, "validation (test)")
    assert out["scores"] == [1.0] * 9              # two steps of 0.5 each
    assert out["counts"] == {"env_errors": 0, "turns_mean": 2.0}
    assert out["lengths"] == [4] * 9               # two sampled turns of 2 tokens
    assert engine.temperatures == [0.5, 0.5]       # one generate call per turn, val settings
    assert collector.next_gen_batch == 0
    m = validation_metrics(out["scores"], 3, 1.0, [None] * 3)
    assert m["val/pass@2"] == 1.0 and m["val/reward_mean"] == 1.0
