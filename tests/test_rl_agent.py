"""env.agent in RL runs (engine.rl.agent.rollout, docs/agents.md): agent functions written with
the real `openai` client drive the episodes of a GRPO step on the hf backend; what trains is
prompt + sampled + template-delta observation ids exactly as the agent received them; a
rewritten history gives two trajectories trained with the episode's advantage; 1 process
equals DP2; the keys are refused by name."""
from __future__ import annotations

import importlib
import json
import threading

import pytest
import torch
from transformers import AutoTokenizer

from engine.config.schema import ConfigError, load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import validate_rl
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.rl.agent.tokens import TemplateRules
from engine.rl.env.observation import observation_ids
from engine.rl.rewards import load_reward_fn
from tests.test_rl_env import InProcessPool
from tools.tiny_models import build_eos_model

RECEIVED: dict[str, list[dict]] = {}   # prompt -> what each call returned (in-process tests)
_LOCK = threading.Lock()


def _client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def _create(client, messages):
    reply = client.chat.completions.create(model="policy", messages=messages,
                                           extra_body={"return_token_ids": True})
    got = reply.model_dump()
    return reply.choices[0].message.content or "", {
        "prompt_token_ids": got["prompt_token_ids"],
        "token_ids": got["choices"][0]["token_ids"]}


def follow_up(base_url: str, row: dict) -> dict:
    """Three calls: the prompt, then a follow-up user message after each reply. Reward: the
    last reply's length mod 3 (something that varies in a group)."""
    client = _client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = []
    for k in range(3):
        text, ids = _create(client, messages)
        seen.append({**ids, "messages": list(messages), "text": text})
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"again {k}"}]
    with _LOCK:
        RECEIVED.setdefault(row["prompt"], []).append(seen)
    return {"reward": float(len(text) % 3), "metrics": {"chars": float(len(text))}}


def rewrite(base_url: str, row: dict) -> float:
    """Two calls, the second with a rewritten history (a new trajectory of the episode)."""
    client = _client(base_url)
    first, _ = _create(client, [{"role": "user", "content": row["prompt"]}])
    second, _ = _create(client, [{"role": "user", "content": "summary: " + first}])
    return float((len(first) + len(second)) % 2)


def flaky(base_url: str, row: dict) -> float:
    """Raises after its call for row 1, makes no call for row 2, else one call (reward 1)."""
    if "2 plus 2" in row["prompt"]:
        return 1.0
    _create(_client(base_url), [{"role": "user", "content": row["prompt"]}])
    if "3 plus 4" in row["prompt"]:
        raise RuntimeError("scaffold broke")
    return 1.0


def not_a_function():
    pass


NOT_CALLABLE = 3


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> str:
    return build_eos_model(str(tmp_path_factory.mktemp("eos_model") / "llama"))


ROWS = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (2, 2)]]


def _config(argv):
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def _collect(model_dir, agent, engines=1, dump=None):
    from engine.rl.rollout.hf_backend import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    argv = ["rollout.n=2", f"train.prompts_per_step={len(ROWS)}", "rollout.max_new_tokens=6",
            "train.seq_length=128", f"env.agent=tests.test_rl_agent:{agent}", "env.max_turns=4",
            "rollout.temperature=1.0", "data.shuffle=false"]
    if dump is not None:
        argv.append(f"logging.rollout_dir={dump}")
    cfg = _config(argv)
    pool = InProcessPool([HFRolloutEngine(model_dir, dtype=torch.float32)
                          for _ in range(engines)], cfg.rollout)
    collector = RolloutCollector(pool, ROWS, tok, load_reward_fn("math"), cfg)
    try:
        return collector.collect(dump_step=1 if dump is not None else None), tok
    finally:
        collector.agent.close()


def test_agent_trajectories_are_the_ids_the_agent_received(eos_model_dir, tmp_path):
    """Three openai-client calls per episode: each episode is ONE trajectory = the first
    prompt + every call's sampled ids + the template-delta ids of the follow-up messages
    (never re-tokenised), loss mask 1 exactly on the sampled ids; the dump has it with
    turns = 3 and trajectory 0; rewards, env metrics and advantages count episodes."""
    received = importlib.import_module("tests.test_rl_agent").RECEIVED  # env.agent's module
    received.clear()
    batch, tok = _collect(eos_model_dir, "follow_up", dump=tmp_path)
    assert len(batch) == 6 and batch.metrics["env/agent_errors"] == 0
    assert batch.metrics["env/turns_mean"] == 3 and batch.metrics["env/trajectories"] == 6
    assert batch.metrics["env/chars"] >= 0
    dump = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"], r["trajectory"], r["turns"]) for r in dump] \
        == [(i, s, 0, 3) for i in range(3) for s in range(2)]
    by_ids = {tuple(r["token_ids"]): r for r in dump}
    assert sorted(received) == sorted(r["prompt"] for r in ROWS)
    rules, closed = TemplateRules(tok), 0
    for prompt, episodes in received.items():
        assert len(episodes) == 2
        for calls in episodes:
            ids = list(calls[0]["prompt_token_ids"])
            mask = [0] * len(ids)
            for k, call in enumerate(calls):
                if k:  # a turn cut at max_tokens is closed by the end-of-turn marker first
                    obs = rules.closing_ids(calls[k - 1]["token_ids"]) + observation_ids(
                        tok, call["messages"][:-1], call["messages"][-1:])
                    assert call["prompt_token_ids"] == ids + obs   # template delta only
                    ids, mask = ids + obs, mask + [0] * len(obs)
                    closed += calls[k - 1]["token_ids"][-1:] != rules.close_ids[-1:]
                ids, mask = ids + call["token_ids"], mask + [1] * len(call["token_ids"])
            record = by_ids[tuple(ids)]
            assert record["loss_mask"] == mask
            assert record["reward"] == float(len(calls[-1]["text"]) % 3)
    assert closed > 0   # some turns were cut (rollout.max_new_tokens=6) and closed
    i = batch.prompt_ids.index(received[ROWS[0]["prompt"]][0][0]["prompt_token_ids"])
    assert batch.response_masks[i] == by_ids[tuple(batch.prompt_ids[i] + batch.response_ids[i])
                                             ]["loss_mask"][len(batch.prompt_ids[i]):]
    scores = torch.tensor(batch.scores).view(3, 2)
    assert batch.metrics["reward/mean"] == pytest.approx(float(scores.mean()))


def test_rewritten_history_trains_two_trajectories_with_the_episode_advantage(eos_model_dir,
                                                                             tmp_path):
    """A rewritten history: 2 trajectories per episode, both trained with the episode's
    reward and advantage; group statistics (reward/mean, GRPO's baseline) over episodes; the
    samples do not depend on the number of engines."""
    batch, _ = _collect(eos_model_dir, "rewrite", dump=tmp_path)
    assert len(batch) == 12 and batch.metrics["env/trajectories"] == 12
    dump = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"], r["trajectory"]) for r in dump] == \
        [(i, s, t) for i in range(3) for s in range(2) for t in range(2)]
    rewards = torch.tensor([dump[2 * e]["reward"] for e in range(6)])
    assert all(dump[2 * e]["reward"] == dump[2 * e + 1]["reward"] for e in range(6))
    grouped = rewards.view(3, 2)
    adv = ((grouped - grouped.mean(1, keepdim=True))
           / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
    assert batch.advantages == pytest.approx(adv.repeat_interleave(2).tolist(), abs=1e-5)
    assert batch.metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
    assert batch.dump_rows == list(range(12))
    two, _ = _collect(eos_model_dir, "rewrite", engines=2)
    assert two.response_ids == batch.response_ids and two.prompt_ids == batch.prompt_ids
    assert two.advantages == batch.advantages


def test_failed_episodes_are_dumped_counted_and_not_trained(eos_model_dir, tmp_path):
    """A scaffold that raises (its trajectory dumped with `error`, not trained) and one that
    makes no call (one record, no tokens): reward 0 in the group statistics,
    env/agent_errors counts both; the run goes on with the other episodes."""
    batch, _ = _collect(eos_model_dir, "flaky", dump=tmp_path)
    dump = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert batch.metrics["env/agent_errors"] == 4 and len(batch) == 2
    assert [(r["prompt_index"], r["error"] is not None, r["trajectory"]) for r in dump] == \
        [(0, False, 0), (0, False, 0), (1, True, 0), (1, True, 0), (2, True, None),
         (2, True, None)]
    assert "scaffold broke" in dump[2]["error"] and "made no call" in dump[4]["error"]
    assert dump[4]["token_ids"] == [] and dump[2]["reward"] == 0.0
    assert batch.metrics["reward/mean"] == pytest.approx(2 / 6)
    assert batch.dump_rows == [0, 1] and batch.advantages == [0.0, 0.0]  # group 0: 1, 1


@pytest.mark.parametrize("argv, expected", [
    (["env.agent=tests.test_rl_agent:follow_up", "env.fn=tests.test_rl_env:CountEnv"],
     "env.agent='tests.test_rl_agent:follow_up' and env.fn="),
    (["env.agent=tests.test_rl_agent:missing"], "env.agent='tests.test_rl_agent:missing'"),
    (["env.agent=nonexistent_mod:f"], "env.agent='nonexistent_mod:f': cannot import"),
    (["env.agent=tests.test_rl_agent:NOT_CALLABLE"], "is not a function(base_url, row)"),
    (["env.agent=tests.test_rl_agent:follow_up", "env.agent_concurrency=0"],
     "env.agent_concurrency=0 must be"),
    (["env.agent=tests.test_rl_agent:follow_up", "env.agent_port=70000"],
     "env.agent_port=70000 must be"),
    (["env.agent=tests.test_rl_agent:follow_up", "env.agent_timeout_s=0"],
     "env.agent_timeout_s=0.0 must be > 0"),
    (["env.agent=tests.test_rl_agent:follow_up", "rollout.backend=vllm"],
     "rollout.backend=vllm is set"),
    (["env.agent=tests.test_rl_agent:follow_up", "dapo.dynamic_sampling=true"],
     "dapo.dynamic_sampling=true is set"),
])
def test_agent_keys_are_refused_by_name(eos_model_dir, tmp_path, argv, expected):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    cfg = _config([f"model.hf_path={eos_model_dir}", f"data.train_files=[{data}]",
                   "rollout.n=2", "train.prompts_per_step=1"] + argv)
    with pytest.raises(ConfigError) as err:
        validate_rl(cfg, 1)
    assert expected in str(err.value)


def _cli_run(pools, model_dir, data, log_dir, world: int):
    proc = pools.script(
        world, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{data}]",
        "env.agent=tests.test_rl_agent:follow_up", "env.max_turns=3", "rollout.n=2",
        f"rollout.num_engines={world}",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=2",
        "train.max_steps=2", "train.seq_length=128", "optim.lr=1e-3", "kl.beta=0.01",
        f"logging.dir={log_dir}", f"logging.rollout_dir={log_dir / 'rollouts'}",
        "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    dumps = [[json.loads(x) for x in (log_dir / "rollouts" / f"step_{k}.jsonl")
              .read_text().splitlines()] for k in (1, 2)]
    return steps, dumps


def test_cli_agent_grpo_dp2_equals_one_process(pools, eos_model_dir, tmp_path):
    """`python -m engine.rl` with env.agent (3 openai-client calls per episode), GRPO on the hf
    backend, 2 steps at 1 process and at DP2 (2 engines): the same episodes (tokens, masks,
    rewards) and the same losses and metrics (rel 1e-5)."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                            + "\n" for i in range(8)))
    runs = {w: _cli_run(pools, eos_model_dir, data, tmp_path / f"w{w}", w) for w in (1, 2)}
    (s1, d1), (s2, d2) = runs[1], runs[2]
    for steps, dumps in runs.values():
        for m, dump in zip(steps, dumps):
            assert m["env/agent_errors"] == 0 and m["env/turns_mean"] == 3
            assert m["rollout/logprob_diff"] < 1e-3
            assert len(dump) == 4 and {r["turns"] for r in dump} == {3}
    for a, b in zip(d1, d2):
        assert [(r["token_ids"], r["loss_mask"], r["reward"]) for r in a] == \
            [(r["token_ids"], r["loss_mask"], r["reward"]) for r in b]
    assert s2[0]["rollout/engines"] == 2
    for m1, m2 in zip(s1, s2):
        for key in ("policy/loss", "policy/pg_loss", "policy/kl", "policy/entropy",
                    "grad_norm", "reward/mean", "reward/std", "env/turns_mean", "env/chars",
                    "rollout/observation_tokens", "train/groups"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert m1["grad_norm"] > 0 and m1["train/groups"] == 2
