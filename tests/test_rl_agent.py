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

from engine.api.tokens import TemplateRules
from engine.config.schema import ConfigError, load_config
from engine.data.observation import observation_ids
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import validate_rl
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.rl.rewards import load_reward_fn
from engine.generation import Generation
from tests.generate_only import GenerateOnlyEngine
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


def rewrite_but_2_plus_2(base_url: str, row: dict) -> float:
    """rewrite, with reward 1 whatever the replies for "2 plus 2" (a group without signal)."""
    reward = rewrite(base_url, row)
    return 1.0 if "2 plus 2" in row["prompt"] else reward


def flaky(base_url: str, row: dict) -> float:
    """Raises after its call for row 1, makes no call for row 2, else one call (reward 1)."""
    if "2 plus 2" in row["prompt"]:
        return 1.0
    _create(_client(base_url), [{"role": "user", "content": row["prompt"]}])
    if "3 plus 4" in row["prompt"]:
        raise RuntimeError("scaffold broke")
    return 1.0


CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'
TOOL_CALLS: dict[str, list[dict]] = {}   # prompt -> what each tool_agent episode received


def tool_agent(base_url: str, row: dict) -> float:
    """`tools` (the calculator): the first reply's tool call is answered by a tool message
    and a second call gives the answer (reward 1 for "42"); rows with `stop_after_tool` end
    after the tool call (their episode finishes with tool_calls, reward 0.5)."""
    from tools.demo import calculator_tools

    client, tools = _client(base_url), calculator_tools()
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    choice = first.choices[0]
    seen = {"first": choice.finish_reason, "calls": [c.function.name for c in
                                                    choice.message.tool_calls or []]}
    with _LOCK:
        TOOL_CALLS.setdefault(row["prompt"], []).append(seen)
    if row.get("stop_after_tool"):
        return 0.5
    call = choice.message.tool_calls[0]
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    final = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    seen.update(messages=messages, final=final.choices[0].finish_reason,
                text=final.choices[0].message.content)
    return float(final.choices[0].message.content == "42")


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


def _collector(model_dir, agent, engines=1, dump=None, argv=(), pool_engines=None,
               rows=ROWS, tok=None):
    """A RolloutCollector of env.agent=tests.test_rl_agent:<agent> over an in-process pool of
    `engines` HF engines of model_dir (or `pool_engines`); `argv` replaces the defaults."""
    tok = tok or AutoTokenizer.from_pretrained(model_dir)
    keys = dict(a.split("=", 1) for a in (
        "rollout.n=2", f"train.prompts_per_step={len(rows)}", "rollout.max_new_tokens=6",
        "train.seq_length=128", f"env.agent=tests.test_rl_agent:{agent}", "env.max_turns=4",
        "rollout.temperature=1.0", "data.shuffle=false",
        *([f"logging.rollout_dir={dump}"] if dump is not None else []), *argv))
    cfg = _config([f"{k}={v}" for k, v in keys.items()])
    if pool_engines is None:
        from engine.generation.hf.backend import HFRolloutEngine

        pool_engines = [HFRolloutEngine(model_dir, dtype=torch.float32) for _ in range(engines)]
    return RolloutCollector(InProcessPool(pool_engines, cfg.rollout), rows, tok,
                            load_reward_fn("math"), cfg), tok


def _collect(model_dir, agent, engines=1, dump=None, argv=(), pool_engines=None, rows=ROWS,
             tok=None):
    """One rollout batch of `_collector`'s (dumped as step 1 into `dump`), and the tokenizer."""
    collector, tok = _collector(model_dir, agent, engines, dump, argv, pool_engines, rows, tok)
    try:
        return collector.collect(dump_step=1 if dump is not None else None), tok
    finally:
        collector.agent.close()


def check_trained_as_received(batch, tok, dump_dir, received, rows=ROWS) -> list[dict]:
    """follow_up's episodes (2 per row): each ONE trajectory = the first prompt + every call's
    sampled ids + the template-delta ids of the follow-up messages (never re-tokenised), loss
    mask 1 exactly on the sampled ids, as the client received them (`received`, filled by
    follow_up); the dump has it with turns = 3 and trajectory 0, and the batch trains the
    dump's ids and masks. Returns the dump's records."""
    dump = [json.loads(x) for x in (dump_dir / "step_1.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"], r["trajectory"], r["turns"]) for r in dump] \
        == [(i, s, 0, 3) for i in range(len(rows)) for s in range(2)]
    by_ids = {tuple(r["token_ids"]): r for r in dump}
    assert sorted(received) == sorted(r["prompt"] for r in rows)
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
    assert len(batch) == len(dump)
    for k, row in enumerate(batch.dump_rows):   # what trains is the dump's trajectory
        record = dump[row]
        assert batch.prompt_ids[k] + batch.response_ids[k] == record["token_ids"]
        assert batch.response_masks[k] == record["loss_mask"][len(batch.prompt_ids[k]):]
        lp = record["rollout_logprobs"][len(batch.prompt_ids[k]):]
        assert batch.rollout_logprobs[k] == pytest.approx(lp, abs=0)
    return dump


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
    dump = check_trained_as_received(batch, tok, tmp_path, received)
    by_ids = {tuple(r["token_ids"]): r for r in dump}
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
    (["env.agent=tests.test_rl_agent:follow_up", "rollout.backend=sglang"],
     "env.agent with rollout.backend=sglang is not wired"),
    (["env.agent=tests.test_rl_agent:follow_up", "reward.model.path=/nonexistent"],
     "env.agent with reward.model.path=/nonexistent is refused"),
])
def test_agent_keys_are_refused_by_name(eos_model_dir, tmp_path, argv, expected):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    cfg = _config([f"model.hf_path={eos_model_dir}", f"data.train_files=[{data}]",
                   "rollout.n=2", "train.prompts_per_step=1"] + argv)
    with pytest.raises(ConfigError) as err:
        validate_rl(cfg, 1)
    assert expected in str(err.value)


def test_sampling_backend_keeps_each_call_within_max_len():
    """SamplingBackend(max_len=64): a request whose prompt plus the shared budget (6) would
    pass 64 ids goes in a call of its own max_tokens; the samples equal those of one shared
    call (a seeded sample's first t ids do not depend on the budget). Negative control: without
    max_len the shared call holds a prompt of 60 with 6 new tokens."""
    from engine.api.backend import GenerateRequest
    from engine.generation.sampling_backend import SamplingBackend

    def backend(max_len):
        calls = []

        def generate(prompts, params):
            calls.append((sorted(len(p) for p in prompts), params.max_new_tokens))
            return [Generation(p, [(seed * 7 + j) % 97 for j in range(params.max_new_tokens)],
                               [-0.5] * params.max_new_tokens, "length")
                    for p, seed in zip(prompts, params.seeds)]
        return SamplingBackend(generate, max_len=max_len), calls

    requests = [GenerateRequest((1,) * 10, 6, 1.0, 1.0, 11),
                GenerateRequest((1,) * 60, 4, 1.0, 1.0, 12),
                GenerateRequest((1,) * 58, 6, 1.0, 1.0, 13),
                GenerateRequest((1,) * 61, 3, 1.0, 1.0, 14)]
    (split, calls), (shared, shared_calls) = backend(64), backend(None)
    assert split.generate(requests) == shared.generate(requests)
    assert calls == [([10, 58], 6), ([61], 3), ([60], 4)]
    assert shared_calls == [([10, 58, 60, 61], 6)]


def test_the_wired_keys_pass_the_agent_checks(tmp_path):
    """rollout.backend=vllm, disaggregated placement, dynamic sampling, the overlong penalty
    and validation are wired for env.agent: agent_problems has nothing to say about them
    (positive control of the refusals above)."""
    from engine.rl.agent.checks import agent_problems

    cfg = _config(["env.agent=tests.test_rl_agent:follow_up", "rollout.backend=vllm",
                   "rollout.placement=disaggregated", "rollout.num_ranks=1",
                   "dapo.dynamic_sampling=true", "dapo.overlong_buffer=2",
                   f"data.val_files=[{tmp_path / 'v.jsonl'}]"])
    assert agent_problems(cfg) == []


class ToolScript(GenerateOnlyEngine):
    """A rollout engine replying one id per character (so re-tokenising the text would
    change the ids: "<tool_call>" is one token of the tokenizer): the calculator call CALL to
    a context without a tool response, else "42"; then <|im_end|>. Log-probs -0.01 * (i+1)."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok

    def _generate(self, prompts, params):
        out = []
        for p in prompts:
            text = "42" if "<tool_response>" in self.tok.decode(p) else CALL
            ids = [self.tok.convert_tokens_to_ids(c) for c in text] + [self.tok.eos_token_id]
            ids = ids[:params.max_new_tokens]
            out.append(Generation(list(p), ids, [-0.01 * (i + 1) for i in range(len(ids))],
                                  "stop" if ids[-1] == self.tok.eos_token_id else "length"))
        return out


def test_tool_calls_train_exactly_and_count_as_finish_reasons(tmp_path):
    """A scaffold with `tools` (the real openai client): the reply comes back as a parsed tool
    call (finish_reason tool_calls), the tool result extends the call; what trains is prompt +
    the sampled ids of the tool call exactly (one id per character, never re-tokenised: the
    tokenizer's own ids of the text differ) + the tool message's template delta + the answer's
    ids, loss mask 1 exactly on sampled ids, the engine's log-probs. Episodes that end after
    the tool call count in env/finish_tool_calls, the others in env/finish_stop."""
    from tools.char_tokenizer import build_char_tokenizer
    from tools.demo import TOOLS_TEMPLATE, calculator_tools

    tok = build_char_tokenizer(None, "qwen2.5", template=TOOLS_TEMPLATE)
    rows = [{"prompt": "what is 6*7 ?", "answer": "42"},
            {"prompt": "what is 7*6 ?", "answer": "42", "stop_after_tool": True}]
    received = importlib.import_module("tests.test_rl_agent").TOOL_CALLS
    received.clear()
    batch, _ = _collect(None, "tool_agent", dump=tmp_path, rows=rows, tok=tok,
                        pool_engines=[ToolScript(tok)],
                        argv=["rollout.max_new_tokens=100", "train.seq_length=400"])
    m = batch.metrics
    assert (m["env/finish_tool_calls"], m["env/finish_stop"], m["env/agent_errors"],
            m["env/tool_call_replies"]) == (2.0, 2.0, 0.0, 4.0)
    assert m["reward/mean"] == pytest.approx(0.75)
    assert all(e["first"] == "tool_calls" and e["calls"] == ["calculate"]
               for eps in received.values() for e in eps)
    assert [e["final"] for e in received[rows[0]["prompt"]]] == ["stop", "stop"]
    eot, tools = tok.eos_token_id, calculator_tools()
    call_ids = [tok.convert_tokens_to_ids(c) for c in CALL] + [eot]
    assert tok.encode(CALL, add_special_tokens=False) != call_ids[:-1]  # negative control
    answer = [tok.convert_tokens_to_ids(c) for c in "42"] + [eot]
    prompts = [render_ids(tok, [{"role": "user", "content": r["prompt"]}], tools) for r in rows]
    messages = received[rows[0]["prompt"]][0]["messages"]
    obs = observation_ids(tok, messages[:1], messages[2:], tools)
    expected = [(prompts[0], call_ids + obs + answer,
                 [1] * len(call_ids) + [0] * len(obs) + [1] * len(answer))] * 2 + \
        [(prompts[1], call_ids, [1] * len(call_ids))] * 2
    assert list(zip(batch.prompt_ids, batch.response_ids, batch.response_masks)) == expected
    lps = [-0.01 * (i + 1) for i in range(len(call_ids))]
    assert batch.rollout_logprobs[0] == lps + [0.0] * len(obs) + [-0.01, -0.02, -0.03]
    dump = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    assert [r["finish_reason"] for r in dump] == ["stop", "stop", "tool_calls", "tool_calls"]
    assert [r["token_ids"] for r in dump] == [p + r for p, r, _ in expected]


def render_ids(tok, messages, tools=None) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def _mask_runs(mask) -> int:
    longest = run = 0
    for x in mask:
        run = run + 1 if x else 0
        longest = max(longest, run)
    return longest


def test_dynamic_sampling_keeps_groups_of_episodes_and_the_overlong_penalty(eos_model_dir,
                                                                           tmp_path):
    """dapo.dynamic_sampling with env.agent: groups of EPISODES (rollout.n episodes of a
    prompt) are kept when their episode scores differ, every trajectory of a kept episode
    trains, none of a dropped one; dapo.overlong_buffer: an episode's penalty is the soft
    overlong punishment of its LONGEST CALL (the per-call budget is what cuts a reply), in
    its reward and advantage (every trajectory of the episode), not in its score (the
    filter, reward/mean) and in the dump's overlong_penalty. Checked against the dump of
    every generation batch; negative control: the advantages without the penalty differ."""
    from engine.rl.algo.overlong import overlong_penalty

    batch, _ = _collect(eos_model_dir, "rewrite_but_2_plus_2", dump=tmp_path, argv=[
        "dapo.dynamic_sampling=true", "dapo.max_gen_batches=2", "dapo.overlong_buffer=3",
        "rollout.max_new_tokens=6", "rollout.n=3"])
    dump = [json.loads(x) for x in (tmp_path / "step_1.jsonl").read_text().splitlines()]
    episodes: dict = {}   # (gen_batch, prompt_index, sample_index) -> its records' rows
    for k, r in enumerate(dump):
        episodes.setdefault((r["gen_batch"], r["prompt_index"], r["sample_index"]), []).append(k)
    keys = list(episodes)
    score = {e: dump[rows[0]]["reward"] for e, rows in episodes.items()}
    penalty = {e: float(overlong_penalty(torch.tensor([float(max(
        _mask_runs(dump[k]["loss_mask"]) for k in rows))]), 6, 3)[0])
               for e, rows in episodes.items()}
    assert all(dump[k]["overlong_penalty"] == pytest.approx(penalty[e], abs=1e-7)
               for e, rows in episodes.items() for k in rows)
    groups = [keys[g:g + 3] for g in range(0, len(keys), 3)]
    kept = [g for g in groups if len({score[e] for e in g}) > 1][:3]
    m = batch.metrics
    assert m["dynamic_sampling/groups_generated"] == len(groups) == 6   # 2 batches of 3
    assert [g[0][1] for g in groups if len({score[e] for e in g}) == 1] == [2, 2], groups
    assert m["train/groups"] == len(kept) == 3   # "2 plus 2" dropped twice, 3 of 4 kept
    assert batch.dump_rows == [k for g in kept for e in g for k in episodes[e]]
    rewards = torch.tensor([[score[e] + penalty[e] for e in g] for g in kept])
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    expected = [float(adv[i, j]) for i, g in enumerate(kept) for j, e in enumerate(g)
                for _ in episodes[e]]
    assert batch.advantages == pytest.approx(expected, abs=1e-5)
    assert batch.scores == [score[e] for g in kept for e in g for _ in episodes[e]]
    assert m["reward/mean"] == pytest.approx(sum(score.values()) / len(score))
    plain = torch.tensor([[score[e] for e in g] for g in kept])
    plain = (plain - plain.mean(1, keepdim=True)) / (plain.std(1, keepdim=True) + 1e-6)
    assert plain.flatten().tolist() != pytest.approx(adv.flatten().tolist(), abs=1e-3), (
        plain, adv)   # negative control: the penalty is in the advantages


def test_validation_episodes_are_the_agents_at_val_temperature(eos_model_dir):
    """data.val_files with env.agent: generate_for_validation runs the agent function's
    episodes (one per prompt x val.n, the val seeds), scores = their rewards, turns_mean =
    calls; the calls sample at val.temperature (0: greedy, so a prompt's val.n episodes are
    identical whatever their seeds; negative control: at 1.0 they differ), and the training
    sampling settings are back afterwards."""
    from engine.rl.collect.validation import generate_for_validation, val_seeds
    from engine.generation import SamplingParams

    received = importlib.import_module("tests.test_rl_agent").RECEIVED
    collector, tok = _collector(eos_model_dir, "follow_up")
    try:
        rows = [r for r in ROWS for _ in range(2)]
        out = {}
        for temperature in (0.0, 1.0):
            received.clear()
            params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=1.0,
                                    seeds=val_seeds(0, 3, 2))
            out[temperature] = generate_for_validation(collector, rows, [[]] * 6, params, 2,
                                                       "validation (test)")
            assert collector.agent.server.limits.temperature == 1.0   # training's again
            got = {p: [[c["token_ids"] for c in calls] for calls in eps]
                   for p, eps in received.items()}
            same = [eps[0] == eps[1] for eps in got.values()]
            assert all(same) if temperature == 0.0 else not any(same), (temperature, got)
            expected = [float(len(eps[j][-1]["text"]) % 3) for r in ROWS
                        for eps in [received[r["prompt"]]] for j in range(2)]
            assert sorted(out[temperature]["scores"]) == sorted(expected)
            assert out[temperature]["counts"] == {"agent_errors": 0, "turns_mean": 3.0}
    finally:
        collector.agent.close()


def _cli_run(pools, model_dir, data, log_dir, world: int):
    """2 GRPO steps of `engine.rl` with env.agent=follow_up on the `world`-rank pool (4: DP2 x
    TP2 with 2 engines, ranks 0 and 2; 3: disaggregated, 2 training ranks and 1 rollout rank
    whose leader serves the endpoint, max_staleness 0), validated after step 2 (data.val_files = the first 2
    prompts, val.n=2 at val.temperature=0.5, driven by the same function)."""
    layout = {4: ["parallel.tp=2", "rollout.num_engines=2"],
              3: ["rollout.placement=disaggregated", "rollout.num_ranks=1",
                  "rollout.max_staleness=0", "rollout.peer_timeout_s=120"]}.get(
        world, [f"rollout.num_engines={world}"])
    val = log_dir.parent / "val.jsonl"
    val.write_text("".join(data.read_text().splitlines(keepends=True)[:2]))
    proc = pools.script(
        world, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{data}]",
        "env.agent=tests.test_rl_agent:follow_up", "env.max_turns=3", "rollout.n=2", *layout,
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=2",
        "train.max_steps=2", "train.seq_length=128", "optim.lr=1e-3", "kl.beta=0.01",
        f"data.val_files=[{val}]", "train.val_interval=2", "val.n=2", "val.temperature=0.5",
        f"logging.dir={log_dir}", f"logging.rollout_dir={log_dir / 'rollouts'}",
        "logging.progress_bar=false", timeout=400, own_world=world == 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    dumps = [[json.loads(x) for x in (log_dir / "rollouts" / f"step_{k}.jsonl")
              .read_text().splitlines()] for k in (1, 2)]
    return steps, dumps


def test_cli_agent_grpo_dp2_tp2_and_disaggregated_equal_one_process(pools, eos_model_dir, tmp_path):
    """`python -m engine.rl` with env.agent (3 openai-client calls per episode), GRPO on the hf
    backend, 2 steps at 1 process, at DP2 x TP2 (4 ranks, 2 engines) and disaggregated (2
    training ranks, 1 rollout rank, max_staleness 0): the same episodes (tokens, masks,
    rewards) and the same losses and metrics (rel 1e-5), validation after step 2 included (the agent's episodes at val.temperature). Negative control: the two
    steps' metrics and episodes differ by more than that tolerance."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                            + "\n" for i in range(8)))
    runs = {w: _cli_run(pools, eos_model_dir, data, tmp_path / f"w{w}", w) for w in (1, 4, 3)}
    (s1, d1), (s4, d4), (s3, d3) = runs[1], runs[4], runs[3]
    for steps, dumps in runs.values():
        for m, dump in zip(steps, dumps):
            assert m["env/agent_errors"] == 0 and m["env/turns_mean"] == 3
            assert m["rollout/logprob_diff"] < 1e-3
            assert len(dump) == 4 and {r["turns"] for r in dump} == {3}
        assert "val/reward_mean" not in steps[0]
        assert steps[1]["val/turns_mean"] == 3 and steps[1]["val/agent_errors"] == 0
    for a, b, c in zip(d1, d4, d3):
        assert [(r["token_ids"], r["loss_mask"], r["reward"]) for r in a] == \
            [(r["token_ids"], r["loss_mask"], r["reward"]) for r in b] == \
            [(r["token_ids"], r["loss_mask"], r["reward"]) for r in c]
    assert [r["token_ids"] for r in d1[0]] != [r["token_ids"] for r in d1[1]]
    assert s4[0]["rollout/engines"] == 2 and s1[0]["rollout/engines"] == 1
    keys = ("policy/loss", "policy/pg_loss", "policy/kl", "policy/entropy", "grad_norm",
            "reward/mean", "reward/std", "env/turns_mean", "env/chars",
            "rollout/observation_tokens", "train/groups")
    assert [m["rollout/staleness"] for m in s3] == [0.0, 0.0]   # disaggregated, s = 0
    for m1, m4, m3 in zip(s1, s4, s3):
        for key in keys:
            assert m4[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
            assert m3[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert m1["grad_norm"] > 0 and m1["train/groups"] == 2
    for key in ("val/reward_mean", "val/pass@1", "val/pass@2", "val/response_length_mean"):
        assert s4[1][key] == pytest.approx(s1[1][key], rel=1e-5, abs=1e-7), key
        assert s3[1][key] == pytest.approx(s1[1][key], rel=1e-5, abs=1e-7), key
    # negative control: the tolerance tells steps apart
    assert any(s1[1][k] != pytest.approx(s1[0][k], rel=1e-5, abs=1e-7)
               for k in ("policy/loss", "grad_norm", "policy/entropy"))
