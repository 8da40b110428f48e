"""On-policy distillation (`distill.teacher_path`, `distill.coef`; docs/algorithms.md).

The student samples; a frozen teacher scores every sampled token. Per token t of a response,
with log-probs at the rollout temperature and A_t the configured estimator's advantage:

    A'_t = A_t - coef * (log pi_old(y_t) - log pi_teacher(y_t))

(slime's formulation; `reward.fn=none` makes A_t = 0: pure distillation). Only sampled tokens
take part: prompt positions and multi-turn observation tokens keep their advantage (0) and do
not count. Metric `distill/reverse_kl`: the token mean of log pi_old - log pi_teacher over the
sampled tokens of the whole rollout batch (a per-token estimate of KL(student || teacher)).

Local and exact: every rank holds the whole rollout batch with the same log-probs (they are
summed over the world in engine.rl.policy.logprobs), so the result does not depend on the
parallel layout. No collective runs here.
"""
from __future__ import annotations

import torch

from engine.training.micro_batches import SequenceData


def apply_distillation(seqs: list[SequenceData], sampled: list[list[int]], coef: float
                       ) -> dict[str, float]:
    """Subtract coef * (old - teacher) from extras "advantages" on the sampled tokens
    (`sampled[i]`: 1 on sequence i's sampled positions, aligned with its labels; taken before
    rollout correction may zero the loss mask of rejected tokens). Needs extras "old_logprobs"
    and "teacher_logprobs". Returns {"distill/reverse_kl": token mean of old - teacher}."""
    total, count = 0.0, 0
    for seq, mask in zip(seqs, sampled):
        keep = torch.tensor(mask, dtype=torch.bool)
        gap = (torch.tensor(seq.extras["old_logprobs"], dtype=torch.float64)
               - torch.tensor(seq.extras["teacher_logprobs"], dtype=torch.float64))
        gap = torch.where(keep, gap, torch.zeros_like(gap))
        adv = torch.tensor(seq.extras["advantages"], dtype=torch.float64) - coef * gap
        seq.extras["advantages"] = adv.tolist()
        total += float(gap.sum())
        count += int(keep.sum())
    return {"distill/reverse_kl": total / count if count else 0.0}
