"""How a partial rollout (engine.rl.collect.partial) scores its replies: reward.fn in the
reward pool (engine.rl.rewards.scorer), each reply submitted the moment it finishes
(`reply_finished`, called by the step-driver session) so scoring overlaps generation.

A complete group (every reply finished) is queued at once when its scores decide nothing
about it (no dapo.dynamic_sampling) and no reward model scores it; its values (scores, the
overlong penalty) are read at the step's end (`settle_scores`), so the rollout only waits for
the replies still being scored after the last one finished (time/reward_wait_s). Otherwise
(dynamic sampling keeps or drops the group by its scores; a reward model scores through the
engine pool) it is scored when it completes, as before. Every reply is one reward.fn call
either way, keyed by its row and tokens: the scores, the queue order and so the training are
bitwise the same as scoring after generation (`overlap_scoring = False`).

A group holding a reply whose reward.fn call failed leaves the update when reward.failure_score
is null (engine.rl.collect.failed_groups): it is never queued, or, queued before its scores were
read, taken out of the queue when they are (`settle_scores`); it goes to log["failed"] (the
step's dump names its errors; reward/dropped_groups counts it). Under dynamic sampling the
session or rounds go on until prompts_per_step groups wait, so the step is refilled; without,
the step trains the groups left.
"""
from __future__ import annotations

import torch

from engine.rl.algo.advantages import zero_std_groups
from engine.rl.algo.overlong import overlong_penalty
from engine.rl.collect.failed_groups import failed_groups
from engine.rl.collect.partial_state import Group, Reply
from engine.rl.collect.reward_items import reward_item


class PartialScoring:
    """Mixed into PartialCollector (uses its cfg, rows, tokenizer, pool, scorer, groups,
    ready, `_prompt_ids` and `_model_scores`)."""

    overlap_scoring = True     # False: score each group when it completes, nothing earlier
    unscored: list[Group]      # queued groups whose values `settle_scores` fills

    def reply_finished(self, reply: Reply) -> None:
        """Submit a reply that just finished to the reward pool (with overlap_scoring)."""
        group = next((g for g in self.groups if any(r is reply for r in g.replies)), None)
        if self.overlap_scoring and group is not None:   # (its group completes it otherwise)
            self._submit(group, reply)

    def complete_groups(self, groups: list[Group], log: dict) -> None:
        """Score complete groups (reward.fn, the reward model, the overlong penalty), drop the
        ones without signal under dapo.dynamic_sampling, queue the rest by number; with
        overlap_scoring and neither dynamic sampling nor a reward model, queue them now and
        read their scores in `settle_scores` (module docstring)."""
        if not self.overlap_scoring or self.cfg.dapo.dynamic_sampling \
                or self.pool.scorer is not None:
            self._value_groups(groups, log, queue=True)
            return
        for group in groups:
            for reply in group.replies:
                self._submit(group, reply)
        self.unscored = getattr(self, "unscored", []) + groups
        self.ready = sorted(self.ready + groups, key=lambda g: g.number)

    def settle_scores(self, log: dict) -> None:
        """Fill the values of the queued groups still unscored (waiting for their scores),
        then drop the pool's results of the step but those of the finished replies of groups
        still in flight (carried: read when their group completes, not scored again)."""
        pending = getattr(self, "unscored", [])
        self.unscored = []
        queued = [g for g in pending if any(g is q for q in self.ready)]   # not rolled back
        if queued:
            self._value_groups(queued, log, queue=False)
        self.scorer.forget(keep=[self._reply_key(g, r) for g in self.groups
                                 for r in g.replies if r.finish is not None])

    def _submit(self, group: Group, reply: Reply) -> None:
        self.scorer.submit(self._reply_key(group, reply), reward_item(
            self.rows[group.row], self._prompt_ids(group.row), reply.tokens, self.tokenizer))

    @staticmethod
    def _reply_key(group: Group, reply: Reply) -> tuple:
        """What a reply's score depends on: its row and its tokens."""
        return (group.row, tuple(reply.tokens))

    def _value_groups(self, groups: list[Group], log: dict, queue: bool) -> None:
        """Scores (waiting for the pool), the overlong penalty and the reward model's scores
        of `groups` into their `values`, failures into their `errors`; with `queue`, the kept
        ones queued by number; the ones a failed reward call drops (module docstring) to
        log["failed"], out of the queue."""
        cfg, n = self.cfg, self.cfg.rollout.n
        replies = [r for g in groups for r in g.replies]
        if self.overlap_scoring:
            for g in groups:
                for r in g.replies:
                    self._submit(g, r)
            report = self.scorer.wait([self._reply_key(g, r) for g in groups for r in g.replies])
        else:
            report = self.score([self.rows[g.row] for g in groups for _ in range(n)],
                                [self._prompt_ids(g.row) for g in groups for _ in range(n)],
                                [r.tokens for r in replies])
        scores, failed = report.scores, report.per_item_failures()
        log["errors"] += report.errors
        dropped = failed_groups(failed, n, cfg.reward.failure_score is None).tolist()
        scores_t = torch.tensor(scores, dtype=torch.float32)
        penalty = torch.zeros_like(scores_t)
        if cfg.dapo.overlong_buffer > 0:
            lengths = torch.tensor([len(r.tokens) for r in replies], dtype=torch.float32)
            penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens,
                                       cfg.dapo.overlong_buffer, cfg.dapo.overlong_penalty)
        part = self._model_scores({"data": {
            "prompt_ids": [self._prompt_ids(g.row) for g in groups for _ in range(n)],
            "response_ids": [r.tokens for r in replies],
            "scores": scores_t, "rewards": scores_t + penalty}})
        data = part["data"]
        keys = ["scores", "rewards"] + (["rm_scores"] if "rm_scores" in data else [])
        flat = {k: data[k].tolist() for k in keys}
        flat["penalty"] = penalty.tolist()
        keep = (~zero_std_groups(data["scores"], n)).tolist() if cfg.dapo.dynamic_sampling \
            else [True] * len(groups)
        for i, g in enumerate(groups):
            g.values = {k: v[i * n:(i + 1) * n] for k, v in flat.items()}
            g.errors = failed[i * n:(i + 1) * n]
            if dropped[i]:
                log["failed"].append(g)
                self.ready = [w for w in self.ready if w is not g]
                continue
            if not queue:
                continue
            if keep[i]:
                self.ready.append(g)
            else:
                log["dropped"] += 1
        self.ready.sort(key=lambda g: g.number)
