"""Multi-turn RL episodes (engine.rl.env): the env.fn contract and its config checks, token-in/
token-out trajectories (masks, log-probs, observations as the template's suffix), environment
errors and timeouts, finish reasons and limits, rollout dumps read back, and 2 engines == 1
engine for multi-turn episodes (HF backend, per-(response, turn) seeds)."""
from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
from transformers import AutoTokenizer

from engine.config.schema import ConfigError, load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import validate_rl
from engine.rl.collect.batch import build_sequences
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.rl.env.episodes import turn_seed
from engine.rl.rewards import load_reward_fn
from engine.generation import Generation
from engine.generation.placement import EnginePlacement
from engine.generation.pool import RolloutPool, generate_with_retries
from tests.generate_only import GenerateOnlyEngine
from tools.tiny_models import build_eos_model, build_tiny_model


class CountEnv:
    """Done after `turns` steps; each step rewards 0.25 and observes "repeat <k>" as a user
    message. row["mode"]: "raise" raises in step 2, "sleep" sleeps 5 s in step 1, "bad" returns
    a non-dict, "ctor" raises in the constructor."""

    def __init__(self, row, turns=3):
        if row.get("mode") == "ctor":
            raise RuntimeError("cannot build")
        self.row, self.turns, self.k = row, turns, 0

    def step(self, action):
        self.k += 1
        mode = self.row.get("mode")
        if mode == "raise" and self.k == 2:
            raise ValueError("environment broke")
        if mode == "sleep":
            time.sleep(5)
        if mode == "bad":
            return "nonsense"
        return {"observations": [{"role": "user", "content": f"repeat {self.k}"}],
                "reward": 0.25, "done": self.k >= self.turns, "metrics": {"steps": 1}}


class ScriptedTurns(GenerateOnlyEngine):
    """Answers every trajectory with "<k>" + eos, k = the number of <|im_start|> tokens in it
    (so each turn differs); log-probs -0.1 * (position + 1). Prompts containing "copy" get
    5 tokens without eos (a turn cut by the budget)."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok = tokenizer

    def _generate(self, prompts, params):
        out = []
        start = self.tok.convert_tokens_to_ids("<|im_start|>")
        for p in prompts:
            if "copy" in self.tok.decode(p):
                ids, reason = self.tok.encode("1 2 3 4 5", add_special_tokens=False), "length"
            else:
                ids = self.tok.encode(str(p.count(start) % 10), add_special_tokens=False)
                ids, reason = ids + [self.tok.eos_token_id], "stop"
            ids = ids[:params.max_new_tokens]
            out.append(Generation(p, ids, [-0.1 * (i + 1) for i in range(len(ids))], reason))
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("env_model")
    return build_tiny_model(str(root / "qwen3"), "qwen3", hidden=32, layers=2, heads=4,
                            kv_heads=2, seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> str:
    """tools.tiny_models.build_eos_model: sampled turns end, so episodes go on."""
    return build_eos_model(str(tmp_path_factory.mktemp("eos_model") / "llama"))


def _config(argv):
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


ROWS = [{"prompt": "what is 1 plus 2 ?", "answer": "3"},
        {"prompt": "what is 3 plus 4 ?", "answer": "7", "mode": "raise"},
        {"prompt": "what is 2 plus 2 ?", "answer": "4", "mode": "sleep"},
        {"prompt": "what is 5 plus 1 ?", "answer": "6", "mode": "bad"},
        {"prompt": "what is 5 plus 2 ?", "answer": "7", "mode": "ctor"},
        {"prompt": "copy what is 5 plus 3 ?", "answer": "8"}]


def _collector(model_dir, argv, rows=ROWS, engine=None):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = _config(["rollout.n=2", f"train.prompts_per_step={len(rows)}", "data.shuffle=false",
                   "rollout.max_new_tokens=4", "train.seq_length=96",
                   "env.fn=tests.test_rl_env:CountEnv", "env.step_timeout_s=1.5",
                   "env.num_workers=4", "kl.beta=0"] + argv)
    return RolloutCollector(engine or ScriptedTurns(tok), rows, tok, load_reward_fn("math"),
                            cfg), tok


def test_config_checks_name_the_env_keys(model_dir, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 2 ?", "answer": 3}) + "\n")
    base = [f"model.hf_path={model_dir}", f"data.train_files=[{data}]"]
    validate_rl(_config(base + ["env.fn=tests.test_rl_env:CountEnv", "+env.kwargs.turns=2"]),
                1)
    cases = {"env.fn=nomodule": "env.fn='nomodule' is not 'package.module:name' (choose "
                                "null, tools, or package.module:Class)",
             "env.fn=tests.test_rl_env:Nope": "module 'tests.test_rl_env' has no attribute",
             "env.fn=tests.test_rl_env:_config": "is not a class with a step(action) method",
             "env.tools=[math:sqrt]": "env.tools=['math:sqrt'] needs env.fn=tools",
             "env.max_turns=0": "env.max_turns=0 must be an integer >= 1",
             "env.num_workers=0": "env.num_workers=0 must be an integer >= 1",
             "env.step_timeout_s=0": "env.step_timeout_s=0.0 must be > 0 or null",
             # the tiny template has no tool-call format: refused before any process starts
             "env.fn=tools": "env.fn=tools: the chat template of model.hf_path has no "
                             "known tool-call format"}
    for override, message in cases.items():
        argv = base + (["env.fn=tests.test_rl_env:CountEnv"] if override.startswith(
            ("env.max", "env.num", "env.step")) else []) + (
            ["env.tools=[engine.rl.env.example_tools:calculate]"]
            if override == "env.fn=tools" else []) + [override]
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_rl(_config(argv), 1)


def test_episodes_masks_rewards_errors_and_finish_reasons(model_dir):
    collector, tok = _collector(model_dir, ["env.max_turns=3"])
    batch = collector.collect()
    m = batch.metrics
    # per row (2 samples each): ok 3 turns (0.75) | raise in step 2 | sleep: timeout |
    # bad result | constructor raised | turn cut by the budget (stepped once, 0.25)
    assert m["env/errors"] == 8 and m["env/finish_error"] == 8
    assert m["env/finish_stop"] == 2 and m["env/finish_length"] == 2
    assert m["env/turns_max"] == 3 and m["env/steps"] == 2 * 3 + 2 * 1 + 2 * 1
    assert m["reward/mean"] == pytest.approx((2 * 0.75 + 2 * 0.25) / 12)
    assert m["rollout/generate_calls"] == 3          # one call per turn (one engine)
    assert m["time/env_s"] >= 1.5                     # the sleeping env waited its timeout
    ok = 0  # the first row's episodes: prompt, 3 sampled turns, 2 observations
    prompt = batch.prompt_ids[ok]
    resp, mask = batch.response_ids[ok], batch.response_masks[ok]
    assert len(resp) == len(mask) == len(batch.rollout_logprobs[ok])
    text = tok.decode(prompt + resp)
    assert text.count("repeat") == 2 and text.endswith("<|im_end|>")
    sampled = [t for t, k in zip(resp, mask) if k]
    eos = tok.eos_token_id
    assert sampled.count(eos) == 3 and len(sampled) == 6     # "<k>" + eos, three times
    obs = tok.encode("\n<|im_start|>user\nrepeat 1<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)
    # 2 observations in each "ok" episode, 1 in each "raise" episode (before step 2 raised)
    assert m["rollout/observation_tokens"] == (2 * 2 + 2 * 1) * len(obs)
    assert resp[2:2 + len(obs)] == obs and mask[2:2 + len(obs)] == [0] * len(obs)
    assert [x for x, k in zip(batch.rollout_logprobs[ok], mask) if not k] == \
        [0.0] * (len(mask) - sum(mask))
    seq = build_sequences(batch)[ok]
    head = len(prompt) - 1
    assert seq.loss_mask == [0] * head + mask
    adv = seq.extras["advantages"][head:]
    assert adv == [batch.advantages[ok] if k else 0.0 for k in mask]


def test_episode_length_limits_and_max_turns(model_dir):
    rows = [{"prompt": "what is 1 plus 2 ?", "answer": "3"}]
    many, _ = _collector(model_dir, ["env.max_turns=2", "+env.kwargs.turns=5"], rows)
    m = many.collect().metrics
    assert m["env/finish_max_turns"] == 2 and m["env/turns_mean"] == 2
    # seq_length leaves room for the prompt, one turn and not the observation
    short, tok = _collector(model_dir, ["env.max_turns=3", "train.seq_length=24"], rows)
    batch = short.collect()
    assert batch.metrics["env/finish_length"] == 2 and batch.metrics["env/turns_max"] == 1
    assert len(batch.prompt_ids[0]) + len(batch.response_ids[0]) <= 25


def test_rollout_dump_masks_read_back(model_dir, tmp_path):
    collector, tok = _collector(model_dir, ["env.max_turns=3",
                                            f"logging.rollout_dir={tmp_path / 'dump'}"])
    batch = collector.collect(dump_step=7)
    lines = [json.loads(x) for x in (tmp_path / "dump" / "step_7.jsonl").read_text().split(
        "\n") if x]
    assert len(lines) == 12
    assert [(r["prompt_index"], r["sample_index"]) for r in lines] == [
        (g, j) for g in range(6) for j in range(2)]
    obs_text = "user\nrepeat"
    for r, prompt, resp in zip(lines, batch.prompt_ids, batch.response_ids):
        ids, mask, lp = r["token_ids"], r["loss_mask"], r["rollout_logprobs"]
        assert ids == prompt + resp and len(mask) == len(ids) == len(lp)
        assert mask[:len(prompt)] == [0] * len(prompt)
        # every sampled token has mask 1 and its rollout log-prob; every other token 0
        runs = re.findall(r"1+", "".join(map(str, mask)))
        assert len(runs) == r["turns"]       # one run of sampled tokens per turn
        assert [x != 0.0 for x in lp] == [k == 1 for k in mask]
        assert r["text"] == tok.decode(ids, skip_special_tokens=False)
        assert r["text"].count(obs_text) == sum(1 for _ in re.finditer("01", "".join(
            map(str, mask[len(prompt):]))))
    first = lines[0]
    assert (first["turns"], first["reward"], first["finish_reason"]) == (3, 0.75, "stop")
    assert lines[2]["finish_reason"] == "error" and "environment broke" in lines[2]["error"]
    assert lines[4]["reward"] == 0 and "timed out" in lines[4]["error"]
    assert lines[10]["finish_reason"] == "length"


def test_single_turn_dump(model_dir, tmp_path):
    from tests.test_rl_loop import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)} for a, b in [(1, 2)]]
    cfg = _config(["rollout.n=2", "train.prompts_per_step=1", "rollout.max_new_tokens=4",
                   "train.seq_length=64", f"logging.rollout_dir={tmp_path}"])
    collector = RolloutCollector(ScriptedEngine(tok), rows, tok, load_reward_fn("math"), cfg)
    batch = collector.collect(dump_step=1)
    lines = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert [r["turns"] for r in lines] == [1, 1]
    for r, prompt, resp in zip(lines, batch.prompt_ids, batch.response_ids):
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(resp)
        assert r["token_ids"] == prompt + resp and r["finish_reason"] == "stop"


def test_turn_seeds():
    assert turn_seed(123, 0) == 123
    seeds = {turn_seed(s, t) for s in (1, 2) for t in range(4)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)


class InProcessPool(RolloutPool):
    """The real RolloutPool split/reassembly with every engine in this process."""

    def __init__(self, engines, rollout_cfg):
        k = len(engines)
        super().__init__(EnginePlacement(k, 1, 1, k, tuple(range(k))), engines[0], rollout_cfg)
        self.engines = engines

    def _serve_generate(self, gen_batch, work):
        return [dataclasses.replace(generate_with_retries(self.engines[e], p, params, self.cfg,
                                                          "test"), engine=e)
                for e, (p, params) in work.items()]


def test_two_engines_equal_one_engine_for_multi_turn(eos_model_dir):
    """HF backend, sampled turns at T=1: the episodes (every token and mask; log-probs to
    float rounding of the different batch shapes) of a 2-engine pool equal the 1-engine
    pool's; each engine got at most one call per turn."""
    import torch

    from engine.generation.hf.backend import HFRolloutEngine

    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2)]]
    out = []
    for k in (1, 2):
        engines = [HFRolloutEngine(eos_model_dir, dtype=torch.float32) for _ in range(k)]
        tok = AutoTokenizer.from_pretrained(eos_model_dir)
        cfg = _config(["rollout.n=2", "train.prompts_per_step=3", "rollout.max_new_tokens=8",
                       "train.seq_length=96", "env.fn=tests.test_rl_env:CountEnv",
                       "env.max_turns=3", "rollout.temperature=1.0", "data.shuffle=false"])
        collector = RolloutCollector(InProcessPool(engines, cfg.rollout), rows, tok,
                                     load_reward_fn("math"), cfg)
        batch = collector.collect()
        out.append(batch)
        calls = [e.num_generate_calls for e in engines]
        assert max(calls) <= batch.metrics["env/turns_max"] and sum(calls) >= 3
    one, two = out
    assert one.response_ids == two.response_ids and one.response_masks == two.response_masks
    for a, b in zip(one.rollout_logprobs, two.rollout_logprobs):  # batch shapes differ
        assert a == pytest.approx(b, abs=1e-5)
    assert one.metrics["env/turns_max"] >= 2 and len({len(r) for r in one.response_ids}) > 1

def test_a_turn_with_little_room_left_gets_a_call_of_its_own(eos_model_dir, monkeypatch):
    """HF backend under vLLM's rule (an engine that refuses a prompt whose length plus the
    call's max_new_tokens passes its max_model_len = train.seq_length + 1): episodes whose
    room is below the turn's largest budget are sampled in calls with their own budget, and
    every episode samples what an engine without that rule samples when all of them share one
    call with the largest budget, the old rule (the ids, masks and log-probs).
    Negative control: that one call passes the limit."""
    import torch

    from engine.rl.env import episodes
    from engine.generation.hf.backend import HFRolloutEngine

    max_new, seq_length = 16, 60

    class MaxLenEngine(HFRolloutEngine):
        def __init__(self, *a, limit=None, **k):
            super().__init__(*a, **k)
            self.limit, self.budgets = limit, []

        def generate(self, prompts, params):
            longest = max(len(p) for p in prompts) + params.max_new_tokens
            self.budgets.append(params.max_new_tokens)
            self.longest = max(getattr(self, "longest", 0), longest)
            assert self.limit is None or longest <= self.limit, (longest, self.limit)
            return super().generate(prompts, params)

    rows = [{"prompt": f"what is {a} plus {b} ?" + " now" * (4 * a), "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (2, 2)]]
    tok = AutoTokenizer.from_pretrained(eos_model_dir)
    out, engines = [], []
    for limit in (seq_length + 1, None):
        if limit is None:   # the old rule: one call with the largest budget
            monkeypatch.setattr(episodes, "budget_calls", lambda lengths, budgets, limit: {
                max(budgets): list(range(len(budgets)))})
        engine = MaxLenEngine(eos_model_dir, dtype=torch.float32, limit=limit)
        cfg = _config(["rollout.n=2", "train.prompts_per_step=3",
                       f"rollout.max_new_tokens={max_new}", f"train.seq_length={seq_length}", "env.fn=tests.test_rl_env:CountEnv",
                       "env.max_turns=3", "rollout.temperature=1.0", "data.shuffle=false"])
        collector = RolloutCollector(InProcessPool([engine], cfg.rollout), rows, tok,
                                     load_reward_fn("math"), cfg)
        out.append(collector.collect())
        engines.append(engine)
    limited, free = out
    assert limited.response_ids == free.response_ids
    assert limited.response_masks == free.response_masks
    for a, b in zip(limited.rollout_logprobs, free.rollout_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    # turn 2: two episodes at 16 and one at its own 12 (16 would pass the limit)
    assert engines[0].budgets == [16, 16, 12, 2] and engines[1].budgets == [16, 16, 2]
    assert engines[1].longest > seq_length + 1 >= engines[0].longest


def _cli_run(pools, model_dir, data, log_dir, engines: int):
    proc = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{data}]",
        "env.fn=tests.test_rl_env:CountEnv", "env.max_turns=3", "rollout.n=2",
        f"rollout.num_engines={engines}", "rollout.max_new_tokens=6",
        "train.prompts_per_step=2", "train.micro_batch_size=2", "train.max_steps=2",
        "train.seq_length=96", "optim.lr=1e-3", "kl.beta=0.01", f"logging.dir={log_dir}",
        f"logging.rollout_dir={log_dir / 'rollouts'}", "logging.progress_bar=false",
        timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    dumps = [[json.loads(x) for x in (log_dir / "rollouts" / f"step_{k}.jsonl")
              .read_text().splitlines()] for k in (1, 2)]
    return steps, dumps


def test_cli_multi_turn_two_engines_equal_one(pools, eos_model_dir, tmp_path):
    """`python -m engine.rl` with env.fn on 2 ranks (DP2) with 1 and with 2 rollout engines:
    episodes of up to 3 turns train through the usual path (the batch with its masks is
    broadcast to every rank), each engine gets one generate call per turn, env metrics are
    logged, each step's dump has the masks and log-probs of every episode, and the 2-engine
    run's episodes (tokens, masks, rewards, turns) equal the 1-engine run's at every step."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                            + "\n" for i in range(8)))
    runs = {k: _cli_run(pools, eos_model_dir, data, tmp_path / f"e{k}", k) for k in (1, 2)}
    for steps, dumps in runs.values():
        assert len(steps) == 2
        for m, dump in zip(steps, dumps):
            assert m["env/errors"] == 0 and m["grad_norm"] > 0
            assert m["rollout/generate_calls"] <= m["env/turns_max"]
            assert m["rollout/logprob_diff"] < 1e-3   # sampled tokens only: engine == trainer
            assert len(dump) == 4 and sum(r["turns"] for r in dump) / 4 == m["env/turns_mean"]
            # observation tokens: the 0s after the first sampled token
            obs = sum(r["loss_mask"][r["loss_mask"].index(1):].count(0) for r in dump)
            assert obs == m["rollout/observation_tokens"]
        assert max(m["env/turns_max"] for m in steps) >= 2
    (s1, d1), (s2, d2) = runs[1], runs[2]
    for a, b in zip(d1, d2):
        assert [(r["token_ids"], r["loss_mask"], r["reward"], r["turns"]) for r in a] == \
            [(r["token_ids"], r["loss_mask"], r["reward"], r["turns"]) for r in b]
    assert [m["reward/mean"] for m in s1] == [m["reward/mean"] for m in s2]
    assert s2[0]["rollout/engines"] == 2 and s1[0]["rollout/engines"] == 1
