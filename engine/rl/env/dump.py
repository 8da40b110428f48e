"""Rollout dumps (`logging.rollout_dir`): one JSON line per episode (single-turn responses are
one-turn episodes) in `<rollout_dir>/step_<k>.jsonl`, k the step number of metrics.jsonl.
Written by rank 0 only (the RolloutCollector's process), after the step's rollout.

Fields: prompt_index (the prompt row, 0-based in data order), sample_index (within its group),
gen_batch, token_ids (the whole trajectory: prompt, sampled turns, observations), loss_mask and
rollout_logprobs (same length as token_ids; mask 1 exactly on sampled tokens, log-prob 0.0
elsewhere), turns, reward (the score: reward.fn, or the sum of the env's step rewards; 0 after
an environment error; plus reward.model.weight x rm_score with a reward model; null when the
reward.fn call failed and reward.failure_score is null: its group did not train,
engine.rl.collect.failed_groups), rm_score (with
reward.model.path only: the reward model's score of token_ids, before the weight; on a
disaggregated run written by training rank 0 when it scored the batch, `add_model_scores`),
judge_score (with reward.judge.base_url only: the LLM judge's score of the response, before
reward.judge.weight; 0 when the judge failed; engine.rl.judge),
overlong_penalty (dapo.overlong_buffer), finish_reason (stop, length, max_turns, error), error
(the environment's error, else the failed reward.fn call's "<kind>: <detail>": "timeout: timed
out after 30 s", "crash: the worker died (exit status -9)", "error: ValueError('...')",
engine.rl.rewards.outcome; also when reward.failure_score scored it; else null), text
(token_ids decoded, special tokens kept). With rollout.partial (engine.rl.collect.partial) the
records are the step's trained replies, then the replies of the groups a failed reward call
dropped that step, and carry token_versions (same length as token_ids: the policy version, RL
steps done, whose weights sampled each token; -1 on prompt tokens). With on-policy
distillation, teacher_logprobs (same length as token_ids: the teacher's log-prob of each
sampled token, 0.0 elsewhere; null for an episode the step did not train, e.g. a group dynamic
sampling or a failed reward call dropped), added after the step's log-prob stage.
"""
from __future__ import annotations

import json
import math
import os


def episode_record(prompt_index: int, sample_index: int, gen_batch: int, prompt: list[int],
                   response: list[int], mask: list[int], logprobs: list[float], turns: int,
                   reward: float | None, penalty: float, finish_reason: str, error: str | None,
                   tokenizer, rm_score: float | None = None,
                   judge_score: float | None = None,
                   token_versions: list[int] | None = None) -> dict:
    ids = list(prompt) + list(response)
    model = {} if rm_score is None else {"rm_score": float(rm_score)}
    if judge_score is not None:
        model["judge_score"] = float(judge_score)
    if token_versions is not None:   # rollout.partial: the version that sampled each token
        model["token_versions"] = [-1] * len(prompt) + [int(v) for v in token_versions]
    return {"prompt_index": int(prompt_index), "sample_index": int(sample_index),
            "gen_batch": int(gen_batch), "token_ids": [int(t) for t in ids],
            "loss_mask": [0] * len(prompt) + [int(m) for m in mask],
            "rollout_logprobs": [0.0] * len(prompt) + [float(x) for x in logprobs],
            "turns": int(turns),
            "reward": None if reward is None or math.isnan(reward) else float(reward), **model,
            "overlong_penalty": float(penalty),
            "finish_reason": finish_reason, "error": error,
            "text": tokenizer.decode(ids, skip_special_tokens=False)}


def part_records(part: dict, row_indices: list[int], n: int, gen_batch: int,
                 tokenizer) -> list[dict]:
    """The records of one generation batch as RolloutCollector._generation_batch returns it
    (with "episodes" for multi-turn, else single-turn responses; "reward_errors": per response
    its failed reward call, or None)."""
    data = part["data"]
    scores, penalty = data["scores"].tolist(), part["penalty"].tolist()
    rm = data["rm_scores"].tolist() if "rm_scores" in data else [None] * len(scores)
    judge = data["judge_scores"].tolist() if "judge_scores" in data else [None] * len(scores)
    failed = part.get("reward_errors") or [None] * len(scores)
    out = []
    for i, (prompt, response, logprobs) in enumerate(zip(
            data["prompt_ids"], data["response_ids"], data["rollout_logprobs"])):
        if "episodes" in part:
            e = part["episodes"][i]
            turns, mask, reason, error = e.turns, e.mask, e.finish_reason, e.error or failed[i]
        else:
            turns, mask, error = 1, [1] * len(response), failed[i]
            reason = "length" if part["clipped"][i] else "stop"
        out.append(episode_record(row_indices[i], i % n, gen_batch, prompt, response, mask,
                                  logprobs, turns, scores[i], penalty[i], reason, error,
                                  tokenizer, rm[i], judge[i]))
    return out


def add_token_field(rollout_dir: str, step: int, name: str, rows: list[int],
                    label_values: list[list[float]]) -> str:
    """Add field `name` to every record of `<rollout_dir>/step_<step>.jsonl`: for record
    rows[i], label_values[i] (one value per label, i.e. per token after the first) placed on
    the record's sampled tokens (loss_mask 1), 0.0 elsewhere; null for the other records.
    Rewrites the file; returns its path."""
    path = os.path.join(rollout_dir, f"step_{step}.jsonl")
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    values = dict(zip(rows, label_values))
    for row, record in enumerate(records):
        found = values.get(row)
        record[name] = None if found is None else [0.0] + [
            float(v) if m else 0.0 for v, m in zip(found, record["loss_mask"][1:])]
    return write_dump(rollout_dir, step, records)


def add_model_scores(rollout_dir: str, step: int, rows: list[int], rm_scores: list[float],
                     rewards: list[float]) -> str | None:
    """A disaggregated run's reward-model scores, added by training rank 0 to the records the
    rollout side wrote (`<rollout_dir>/step_<step>.jsonl`): record rows[i] gets rm_score
    rm_scores[i] and reward rewards[i] (its score with the reward model's part); the other
    records rm_score null. Returns the path, or None when the file is not on this machine."""
    path = os.path.join(rollout_dir, f"step_{step}.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    found = dict(zip(rows, zip(rm_scores, rewards)))
    for row, record in enumerate(records):
        score, reward = found.get(row, (None, record["reward"]))
        record.update(rm_score=score, reward=float(reward))
    return write_dump(rollout_dir, step, records)


def write_dump(rollout_dir: str, step: int, records: list[dict]) -> str:
    """Write `<rollout_dir>/step_<step>.jsonl` (replaced if it exists); returns its path."""
    os.makedirs(rollout_dir, exist_ok=True)
    path = os.path.join(rollout_dir, f"step_{step}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
