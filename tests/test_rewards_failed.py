"""Failed reward calls never train (engine.rl.collect.failed_groups, docs/rewards.md#failed-
reward-calls): with reward.failure_score null (the default) a group holding a reply whose
reward.fn call failed leaves the update (reward/dropped_groups), its dump records name the
error, and dynamic sampling refills; reward.failure_score=<number> trains them with that score
as before. On the plain collector, partial rollouts and a real GRPO run on 2 ranks.

The reward pool's workers import this module to unpickle its reward functions, so the heavy
imports (torch, transformers, the engine) are inside the tests."""
from __future__ import annotations

import json
import re

import pytest


@pytest.fixture(scope="module")
def model_dir(qwen3_dir) -> str:
    """The session's tiny Qwen3 (tests/conftest.py)."""
    return qwen3_dir


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("failed_data") / "add.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                        "answer": i % 10 + (3 * i + 1) % 10}) + "\n"
                            for i in range(32)))
    return str(path)


def scripted_reward(prompt, response, answer, fail_at=None, **fields):
    """The reply's number (the scripted engines answer reply j of a group with "j"); raises
    for the reply whose number is the row's `fail_at`."""
    if fail_at is not None and response.strip() == str(fail_at):
        raise ValueError(f"no score for reply {response.strip()}")
    return float(response.strip() or 0)


def raising_reward(prompt, response, answer, **fields):
    """The real run's reward: digits' share + length / 100 (varies within a group); raises on a
    reply whose length in characters is a multiple of 7."""
    if len(response) % 7 == 0:
        raise ValueError(f"cannot score a reply of {len(response)} characters")
    return sum(c.isdigit() for c in response) / max(len(response), 1) + len(response) / 100


def _engine(tokenizer, n: int):
    """A scripted engine: reply j of each group (rows group-major, `n` a group) is "j" and an
    end of sequence."""
    from engine.generation import Generation
    from tests.generate_only import GenerateOnlyEngine

    class Numbered(GenerateOnlyEngine):
        def _generate(self, prompts, params):
            out = []
            for i, prompt in enumerate(prompts):
                ids = tokenizer.encode(str(i % n), add_special_tokens=False)
                ids += [tokenizer.eos_token_id]
                out.append(Generation(prompt, ids, [-0.5] * len(ids), "stop"))
            return out

    return Numbered()


def _collector(model_dir, tmp_path, fail_at: list, argv: list[str], partial: bool = False):
    """A collector of 4 rows (row r fails at reply fail_at[r], None: never), 3 replies each,
    scored in the trainer (reward.num_workers=0), dumping to tmp_path/dump."""
    from transformers import AutoTokenizer

    from engine.rl.collect.collector import RolloutCollector
    from engine.rl.collect.partial import PartialCollector
    from tests.test_rl_loop import _config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {r} plus 1 ?", "answer": str(r + 1), "fail_at": f}
            for r, f in enumerate(fail_at)]
    cfg = _config(["rollout.n=3", "rollout.max_new_tokens=4", "data.shuffle=false",
                   "train.seq_length=64", "reward.num_workers=0",
                   f"logging.rollout_dir={tmp_path / 'dump'}"] + argv)
    cls = PartialCollector if partial else RolloutCollector
    return cls(_engine(tokenizer, 3), rows, tokenizer, scripted_reward, cfg)


def _dump(tmp_path, step: int = 1) -> list[dict]:
    path = tmp_path / "dump" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _group_of(batch, n: int = 3) -> list[int]:
    return [batch.dump_rows[i] // n for i in range(0, len(batch), n)]


def test_a_group_with_a_failed_call_leaves_the_update(model_dir, tmp_path, capsys):
    """GRPO, 4 groups of 3; row 1's third reply and row 3's first raise: groups 1 and 3 leave
    (reward/dropped_groups 2), the batch is groups 0 and 2 with their own advantages, the dump
    keeps every reply and names the errors (reward null). The same with
    reward.failure_score=0: all 12 train, the failed replies scored 0, the errors still named.
    (Before: failure_score 0.0 was the default, all 12 trained, and the dumps said error
    null.)"""
    import torch

    from engine.rl.algo.advantages import group_advantages

    batch = _collector(model_dir, tmp_path, [None, 2, None, 0],
                       ["train.prompts_per_step=4"]).collect(dump_step=1)
    m = batch.metrics
    assert m["reward/dropped_groups"] == 2 and m["reward/errors"] == 2
    assert len(batch) == 6 and m["train/groups"] == 2 and _group_of(batch) == [0, 2]
    assert batch.scores == [0.0, 1.0, 2.0] * 2 and m["reward/mean"] == 1.0
    assert batch.advantages == group_advantages(torch.tensor(batch.rewards), 3).tolist()
    records = _dump(tmp_path)
    assert len(records) == 12
    errors = {i: r["error"] for i, r in enumerate(records) if r["error"] is not None}
    assert errors == {5: "error: ValueError('no score for reply 2')",
                      9: "error: ValueError('no score for reply 0')"}
    assert [records[i]["reward"] for i in (5, 9)] == [None, None]
    assert [r["reward"] for r in records[3:5]] == [0.0, 1.0]   # scored, not trained
    assert "2 of 4 groups left the update" in capsys.readouterr().out

    scored = _collector(model_dir, tmp_path, [None, 2, None, 0],
                        ["train.prompts_per_step=4", "reward.failure_score=0"]).collect(1)
    assert len(scored) == 12 and scored.metrics["reward/dropped_groups"] == 0
    assert scored.metrics["reward/errors"] == 2 and scored.metrics["train/groups"] == 4
    assert scored.scores == [0.0, 1.0, 2.0, 0.0, 1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    records = _dump(tmp_path)
    assert [r["error"] for r in records].count(None) == 10
    assert records[5]["error"] == "error: ValueError('no score for reply 2')"
    assert records[5]["reward"] == 0.0


def test_dynamic_sampling_refills_and_an_all_failed_step_trains_nothing(model_dir, tmp_path,
                                                                       capsys):
    """DAPO, 2 groups a step: generation batch 0 (rows 0, 1) keeps row 0 (row 1 fails), batch
    1 (rows 2, 3) refills with row 2 (row 3 fails). A step whose every group fails has nothing
    to train: an empty batch (the loop then skips the update, train/update_skipped) and a log
    line saying so."""
    dapo = _collector(model_dir, tmp_path, [None, 1, None, 2],
                      ["algorithm=dapo", "train.prompts_per_step=2", "dapo.max_gen_batches=3",
                       "dapo.overlong_buffer=0"]).collect(dump_step=1)
    m = dapo.metrics
    assert m["rollout/num_gen_batches"] == 2 and m["reward/dropped_groups"] == 2
    assert m["dynamic_sampling/groups_generated"] == 4
    assert m["dynamic_sampling/groups_with_signal"] == 2
    assert len(dapo) == 6 and _group_of(dapo) == [0, 2]
    assert len(_dump(tmp_path)) == 12
    capsys.readouterr()

    empty = _collector(model_dir, tmp_path, [0, 1, 2, 0],
                       ["train.prompts_per_step=4"]).collect(dump_step=1)
    assert len(empty) == 0 and empty.metrics["train/groups"] == 0
    assert empty.metrics["reward/dropped_groups"] == 4
    assert "no group is left to train: this step's update is skipped" in capsys.readouterr().out


def test_partial_rollouts_drop_failed_groups_and_dump_them(model_dir, tmp_path):
    """rollout.partial (rounds, overlapped scoring): rows 1 and 3 fail, so of the 4 groups
    started groups 0 and 2 train; the dump holds the trained replies, then the dropped groups'
    with their errors."""
    collector = _collector(model_dir, tmp_path, [None, 1, None, 0],
                           ["train.prompts_per_step=4", "rollout.partial=true",
                            "rollout.partial_max_new_tokens=4", "rollout.partial_oversample=1"],
                           partial=True)
    batch = collector.collect(dump_step=1)
    m = batch.metrics
    assert m["reward/dropped_groups"] == 2 and m["train/groups"] == 2 and len(batch) == 6
    assert batch.scores == [0.0, 1.0, 2.0] * 2
    records = _dump(tmp_path)
    assert [r["prompt_index"] for r in records] == [0] * 3 + [2] * 3 + [1] * 3 + [3] * 3
    assert [r["error"] for r in records[:6]] == [None] * 6
    assert records[7]["error"] == "error: ValueError('no score for reply 1')"
    assert records[9]["error"] == "error: ValueError('no score for reply 0')"
    assert records[7]["reward"] is None and records[8]["reward"] == 2.0


def test_a_grpo_run_drops_the_groups_whose_reward_raised(pools, model_dir, prompts_file,
                                                         tmp_path):
    """A real GRPO run on 2 ranks (scoring spread over both ranks' reward pools), reward.fn
    raising on replies whose length is a multiple of 7: reward/dropped_groups > 0, the dumps
    name the errors, and no dropped group reaches the update: every step's trained response
    tokens (train/response_tokens, counted by the update from the loss masks it trained) are
    exactly those of the dumped replies of the groups without an error."""
    log_dir = tmp_path / "run"
    proc = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{prompts_file}]",
        "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4",
        "train.micro_batch_size=4", "train.max_steps=1", "train.seq_length=64",
        "optim.lr=1e-3", "reward.fn=tests.test_rewards_failed:raising_reward",
        "reward.num_workers=1", f"logging.dir={log_dir}",
        f"logging.rollout_dir={log_dir / 'dump'}", "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1
    dropped_total = 0
    for step, m in enumerate(steps, start=1):
        records = [json.loads(line) for line in
                   (log_dir / "dump" / f"step_{step}.jsonl").read_text().splitlines()]
        groups = [records[g * 4:(g + 1) * 4] for g in range(4)]
        failed = [g for g in groups if any(r["error"] is not None for r in g)]
        kept = [g for g in groups if all(r["error"] is None for r in g)]
        for r in (r for g in failed for r in g if r["error"] is not None):
            assert re.fullmatch(r"error: ValueError\('cannot score a reply of \d+ characters'\)",
                                r["error"]) and r["reward"] is None
        assert m["reward/dropped_groups"] == len(failed) and m["train/groups"] == len(kept)
        trained = sum(sum(r["loss_mask"]) for g in kept for r in g)
        if kept:
            assert m["train/response_tokens"] == trained
        else:
            assert m["train/update_skipped"] == 1.0
        dropped_total += len(failed)
    assert dropped_total > 0 and any(m["train/groups"] > 0 for m in steps)
    assert "groups left the update (reward/dropped_groups)" in proc.stdout


class AnswerEnv:
    """One step, done, reward 1: a final answer as env.fn=tools' ToolEnv scores it, except on
    rows with "fail", where its reward call failed (`reward_failure` named, reward 0 as
    ToolEnv's placeholder)."""

    def __init__(self, row):
        self.row = row
        self.reward_failure = None

    def step(self, action):
        if self.row.get("fail"):
            self.reward_failure = "timeout: timed out after 30 s"
        return {"observations": [], "reward": 0.0 if self.row.get("fail") else 1.0,
                "done": True}


def test_env_episodes_whose_final_answer_failed_leave_the_update(model_dir, tmp_path):
    """Multi-turn collection (env.fn): the group of an episode whose final answer's reward call
    failed leaves the update, its dump records name the failure; with reward.failure_score set
    it trains."""
    from transformers import AutoTokenizer

    from engine.rl.collect.collector import RolloutCollector
    from engine.rl.rewards import load_reward_fn
    from tests.test_rl_env import ScriptedTurns
    from tests.test_rl_loop import _config

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"what is {r} plus 2 ?", "answer": "3", "fail": r == 1} for r in range(3)]

    def collect(argv):
        cfg = _config(["rollout.n=2", "train.prompts_per_step=3", "data.shuffle=false",
                       "rollout.max_new_tokens=4", "train.seq_length=96",
                       "env.fn=tests.test_rewards_failed:AnswerEnv", "reward.num_workers=0",
                       f"logging.rollout_dir={tmp_path / 'dump'}"] + argv)
        return RolloutCollector(ScriptedTurns(tok), rows, tok, load_reward_fn("math"),
                                cfg).collect(dump_step=1)

    batch = collect([])
    assert batch.metrics["reward/dropped_groups"] == 1 and len(batch) == 4
    assert batch.metrics["reward/errors"] == 2 and batch.dump_rows == [0, 1, 4, 5]
    records = _dump(tmp_path)
    assert [r["error"] for r in records] == [None, None] + [
        "timeout: timed out after 30 s"] * 2 + [None, None]
    assert [r["reward"] for r in records] == [1.0, 1.0, None, None, 1.0, 1.0]
    scored = collect(["reward.failure_score=0"])
    assert scored.metrics["reward/dropped_groups"] == 0 and len(scored) == 6
    assert [r["reward"] for r in _dump(tmp_path)][2:4] == [0.0, 0.0]
