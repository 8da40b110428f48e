"""The RL collector with an LLM judge (reward.judge.base_url set): every generation batch's
responses are judged right after reward.fn (or the environment) and the reward model scored
them, and reward.judge.weight x the judge's score joins each response's score and reward before
the overlong shaping, dynamic sampling, the advantages and the dump, as a reward model's does
(engine.rl.collect.collector). Judged: training batches, single-turn and multi-turn (the
response's text is the trajectory after the prompt, observations included), colocated or on
disaggregated rollout ranks; not validation (it scores with reward.fn alone, as without a
judge). Metrics: reward/judge_mean (the mean judge score of the step's responses, failed ones
0), failed judge requests counted in reward/errors; dumps: judge_score per episode.

The deadline: the judge's calls of one collect (every generation batch of the step together)
spend at most reward.judge.deadline_s seconds; each call gets what the earlier ones left, and
responses not scored within it score 0 and count in reward/errors (a batch judged after the
budget is spent sends nothing). So the other ranks, waiting in a collective, wait for the
judge at most deadline_s per step, below the process-group timeout.
"""
from __future__ import annotations

import time

import torch

from engine.config.redaction import redact_text
from engine.rl.collect.collector import RolloutCollector
from engine.rl.collect.partial import PartialCollector
from engine.rl.judge.scorer import JudgeScorer
from engine.rl.rewards.settings import reward_fn_for, scoring_header


class JudgedCollector(RolloutCollector):
    """RolloutCollector (same arguments) plus `judge` (module docstring): it extends the
    collector's `_model_scores`, where a generation batch's reward-model scores join, and
    `collect`, whose metrics gain reward/judge_mean."""

    def __init__(self, *args, judge: JudgeScorer, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.judge = judge
        self.judged: list[torch.Tensor] = []   # the judge scores of the collect in progress
        self.judge_left_s = float(judge.cfg.deadline_s)   # the step's judging time left

    def _model_scores(self, part: dict) -> dict:
        part = super()._model_scores(part)
        data = part["data"]
        items = []
        for index, prompt, response in zip(part["row_indices"], data["prompt_ids"],
                                            data["response_ids"]):
            row = self.rows[index]
            text = row["prompt"] if isinstance(row["prompt"], str) else self.tokenizer.decode(
                prompt, skip_special_tokens=True)
            items.append((text, self.tokenizer.decode(response, skip_special_tokens=True)))
        t0 = time.monotonic()
        result = self.judge.score(items, deadline_s=self.judge_left_s)
        self.judge_left_s -= time.monotonic() - t0
        if result.num_errors:
            first = next(e for e in result.errors if e is not None)
            print(f"[rl] warning: the judge failed on {result.num_errors} of {len(items)} "
                  f"responses (scored 0); first: {redact_text(str(first))}", flush=True)
        judged = torch.tensor(result.scores, dtype=torch.float32)
        weight = float(self.judge.cfg.weight)
        data.update(judge_scores=judged, scores=data["scores"] + weight * judged,
                    rewards=data["rewards"] + weight * judged)
        part["errors"] += result.num_errors
        self.judged.append(judged)
        return part

    def collect(self, dump_step: int | None = None):
        self.judged = []
        self.judge_left_s = float(self.judge.cfg.deadline_s)
        batch = super().collect(dump_step)
        batch.metrics["reward/judge_mean"] = float(torch.cat(self.judged).mean())
        return batch


def make_collector(pool, rows: list[dict], tokenizer, cfg,
                   prompt_ids: list[list[int]] | None = None,
                   carried: dict | None = None) -> RolloutCollector:
    """Rank 0's collector of the run (the rollout leader's on a disaggregated run):
    PartialCollector with rollout.partial (engine.rl.collect.partial), restored from `carried`
    (its state() from the checkpoint; None: a fresh run), JudgedCollector with
    reward.judge.base_url, else RolloutCollector; reward.fn by
    engine.rl.rewards.settings.reward_fn_for; prints the run header's scoring line."""
    reward_fn = reward_fn_for(cfg.reward)
    print(f"[rl] {scoring_header(cfg.reward)}", flush=True)
    if cfg.rollout.partial:   # partial_problems refuses it with a judge
        collector = PartialCollector(pool, rows, tokenizer, reward_fn, cfg, prompt_ids)
        collector.restore(carried)
        return collector
    if not cfg.reward.judge.base_url:
        return RolloutCollector(pool, rows, tokenizer, reward_fn, cfg, prompt_ids)
    return JudgedCollector(pool, rows, tokenizer, reward_fn, cfg, prompt_ids,
                           judge=JudgeScorer(cfg.reward.judge))
