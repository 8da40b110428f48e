"""The reference the vLLM tests hold rollout log-probs to: transformers' fp32 logits of the
whole sequence, / T, log_softmax, at each response token (the engine's contract)."""
from __future__ import annotations

import torch


def max_logprob_diff(model, generations, temperature: float) -> float:
    """max |engine log-prob - log_softmax(logits / T)[token]| over every response token of
    `generations` (engine.generation.base.Generation), `model` a transformers causal LM."""
    worst = 0.0
    for g in generations:
        ids = g.prompt_ids + g.response_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        start = len(g.prompt_ids) - 1
        ref = logp[start:start + len(g.response_ids)].gather(
            1, torch.tensor(g.response_ids)[:, None])[:, 0]
        worst = max(worst, float((ref - torch.tensor(g.response_logprobs)).abs().max()))
    return worst
