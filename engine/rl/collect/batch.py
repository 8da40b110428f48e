"""The rollout batch one RL step trains on, and the training sequences built from it.
Identical on every rank (engine.rl.collect.transport shares it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.training.micro_batches import SequenceData
from engine.training.routing import ROUTED_EXPERTS
from models.vision.inputs import ImagePrompt


@dataclass
class RolloutBatch:
    """The responses one RL step trains on (possibly none: dynamic sampling found no group
    with signal), group-major, plus the rollout metrics. Identical on every rank."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)  # token-level estimators: 0 here
    metrics: dict[str, float] = field(default_factory=dict)
    # multi-turn (engine.rl.env): 1 on sampled tokens, 0 on observations; empty: all sampled
    response_masks: list[list[int]] = field(default_factory=list)
    # R3 routing replay: per response Generation.routed_experts [tokens fed, layers * k]
    routed_experts: list = field(default_factory=list)
    # per response, its record's index in the step's rollout dump (engine.rl.env.dump)
    dump_rows: list[int] = field(default_factory=list)
    # per response, its reward (score + overlong penalty): GAE's terminal reward
    rewards: list[float] = field(default_factory=list)
    # per response, its score (reward.fn or the env's, plus reward.model.weight x the reward
    # model's score once it is scored; engine.rl.policy.reward_model), without the penalty
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)


def build_sequences(batch: RolloutBatch) -> list[SequenceData]:
    """Training sequences of a rollout batch: tokens = prompt + response[:-1], labels = the next
    tokens, loss_mask 1 on the response positions. Extras (aligned with labels, 0 on prompt
    positions): "advantages" (the response's advantage on every response token) and
    "rollout_logprobs" (the engine's log-probs of the sampled tokens). Multi-turn responses
    (batch.response_masks) train only their sampled tokens: loss mask and advantage 0 on
    observation tokens (their rollout log-prob is 0.0). A prompt with images
    (models.vision.inputs.ImagePrompt) gives its sequence the images (SequenceData.vision):
    one ImageSet per prompt object, shared by its group, so that its pixels are produced once
    a step."""
    seqs = []
    images: dict[int, object] = {}   # id(prompt) -> its ImageSet for this batch
    masks = batch.response_masks or [None] * len(batch)
    for prompt, response, logprobs, adv, mask in zip(
            batch.prompt_ids, batch.response_ids, batch.rollout_logprobs, batch.advantages,
            masks):
        ids = list(prompt) + list(response)
        head = len(prompt) - 1
        mask = [1] * len(response) if mask is None else [int(m) for m in mask]
        seqs.append(SequenceData(
            tokens=ids[:-1], labels=ids[1:], loss_mask=[0] * head + mask,
            extras={"advantages": [0.0] * head + [float(adv) if m else 0.0 for m in mask],
                    "rollout_logprobs": [0.0] * head + [float(x) for x in logprobs]},
            vision=_vision(prompt, ids[:-1], images)))
        if batch.routed_experts:  # R3: the rollout engine's routing of every fed token
            seqs[-1].extras[ROUTED_EXPERTS] = batch.routed_experts[len(seqs) - 1]
    return seqs


def _vision(prompt, tokens: list[int], images: dict):
    if not isinstance(prompt, ImagePrompt):
        return None
    if id(prompt) not in images:
        images[id(prompt)] = prompt.images
    return prompt.vision(tokens, images[id(prompt)])
