"""What partial rollouts carry from one RL step to the next (engine.rl.collect.partial): the
groups in flight, each reply's tokens so far with the log-prob and the policy version of every
token, and the completed groups waiting to train; as plain JSON for the checkpoint's `extra`.

Policy version v = the weights after v RL steps (the weights that sampled step v's rollout in a
colocated run). A reply's version span = its newest token's version - its oldest's (0: one
version).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Reply:
    """One response of a group. `finish` is None while unfinished, then "stop" (an end of
    sequence) or "length" (rollout.max_new_tokens tokens in all)."""

    seed: int                      # its sampling seed (work_split.response_seed), kept on restarts
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)   # the sampling version's, per token
    versions: list[int] = field(default_factory=list)     # the version that sampled each token
    finish: str | None = None
    restarts: int = 0              # times it was restarted from its prompt (staleness bound)

    def span(self) -> int:
        """Versions its tokens span (0: one version or none)."""
        return max(self.versions) - min(self.versions) if self.versions else 0

    def restart(self) -> None:
        """Back to its prompt: its tokens are dropped; the seed stays."""
        self.tokens, self.logprobs, self.versions = [], [], []
        self.restarts += 1


@dataclass
class Group:
    """The rollout.n replies to one prompt. `number`: the run's group counter (its prompt and
    seeds: generation batch number // prompts_per_step, position number % prompts_per_step);
    `row`: the prompt row; `values`: once complete, per reply "scores", "rewards", "penalty"
    (and "rm_scores" with a reward model); `errors`: once scored, per reply its failed
    reward.fn call ("<kind>: <detail>", engine.rl.rewards.outcome) or None."""

    number: int
    row: int
    replies: list[Reply]
    values: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str | None] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.replies)


def outlives_bound(reply: Reply, version: int, bound: int) -> bool:
    """Whether `reply`, unfinished while policy version `version` samples, would span more
    than `bound` versions (rollout.partial_max_staleness) if it were carried to version + 1:
    such a reply is not cut; it finishes under `version` (engine.rl.collect.partial)."""
    return reply.finish is None and bool(reply.versions) and \
        version + 1 - reply.versions[0] > bound


def to_plain(groups: list[Group]) -> list[dict]:
    """Groups as plain JSON values (floats round-trip exactly through JSON)."""
    return [asdict(g) for g in groups]


def from_plain(items: list[dict]) -> list[Group]:
    """The inverse of to_plain."""
    return [Group(number=int(g["number"]), row=int(g["row"]),
                  replies=[Reply(**r) for r in g["replies"]],
                  values={k: [float(x) for x in v] for k, v in g["values"].items()},
                  errors=list(g.get("errors", [])))
            for g in items]


def span_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Over the replies of `groups` (the trained ones, at policy version `version`):
    rollout/partial_share (share of the replies whose tokens span more than one version),
    rollout/version_span_mean and rollout/version_span_max, and rollout/partial_staleness_mean
    and _max (version - the reply's oldest token's version: how far behind the weights it
    trains against its behaviour policy reaches, a waiting group's lag included); zeros for
    none."""
    spans = [r.span() for g in groups for r in g.replies]
    lags = [version - min(r.versions) for g in groups for r in g.replies if r.versions]
    if not spans:
        spans = [0]
    return {"rollout/partial_share": sum(s > 0 for s in spans) / len(spans),
            "rollout/version_span_mean": sum(spans) / len(spans),
            "rollout/version_span_max": float(max(spans)),
            "rollout/partial_staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/partial_staleness_max": float(max(lags, default=0))}
