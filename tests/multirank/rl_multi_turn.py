"""Multi-turn batches for the RL invariance harness (tests/multirank/rl_invariance.py, spec
flag "mt"): responses made of sampled turns and observations, so the loss masks have holes
(engine.rl.env; RolloutBatch.response_masks)."""
from __future__ import annotations

import dataclasses
import random


def synthetic_multi_turn(vocab: int, groups: int, n: int, seed: int = 5):
    """A fixed group-major RolloutBatch of episodes: prompts of 3..10 tokens; responses of 1..3
    sampled turns (1..8 tokens, mask 1) with an observation (2..6 tokens, mask 0) between
    turns; GRPO advantages of random 0/1 rewards (the last group all equal)."""
    import torch

    from engine.rl.algo.advantages import group_advantages
    from engine.rl.collect.batch import RolloutBatch

    rng = random.Random(seed)
    prompts, responses, masks, rewards = [], [], [], []
    for g in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))]
        for _ in range(n):
            ids, mask = [], []
            turns = rng.randint(1, 3)
            for t in range(turns):
                k = rng.randint(1, 8)
                ids += [rng.randrange(4, vocab) for _ in range(k)]
                mask += [1] * k
                if t + 1 < turns:
                    k = rng.randint(2, 6)
                    ids += [rng.randrange(4, vocab) for _ in range(k)]
                    mask += [0] * k
            prompts.append(prompt)
            responses.append(ids)
            masks.append(mask)
            rewards.append(1.0 if g == groups - 1 else float(rng.random() < 0.5))
    adv = group_advantages(torch.tensor(rewards), n).tolist()
    logprobs = [[0.0] * len(r) for r in responses]  # replaced by perturbed recomputed values
    batch = RolloutBatch(prompts, responses, logprobs, adv)
    batch.response_masks = masks
    assert sum(m.count(0) for m in masks) > 0, "the batch must hold observation tokens"
    return batch


def observations_trained(batch):
    """The negative control's batch: the same episodes with every response token trained
    (the bug of ignoring response_masks: observation tokens in the loss)."""
    return dataclasses.replace(batch, response_masks=[])
