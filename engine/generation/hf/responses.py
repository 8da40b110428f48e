"""The eager decode loop's per-step tensors turned into Generations (engine.generation.hf.backend),
and the per-row stop rule of a call (SamplingParams.row_max_new_tokens)."""
from __future__ import annotations

import torch

from engine.generation.base import Generation


def row_limits(params, batch: int, device: torch.device) -> torch.Tensor | None:
    """int64 [batch]: each row's bound on response tokens (SamplingParams.row_max_new_tokens),
    None when every row has params.max_new_tokens."""
    if params.row_max_new_tokens is None:
        return None
    return torch.tensor([int(m) for m in params.row_max_new_tokens], dtype=torch.int64,
                        device=device)


def collect_generations(prompts, tokens_per_step: list[torch.Tensor],
                        logprobs_per_step: list[torch.Tensor],
                        active_per_step: list[torch.Tensor],
                        stops: list) -> list[Generation]:
    """One Generation per prompt from the loop's per-step [B] tensors: row i's response is its
    tokens of the steps it was active (up to and including its stop id); finish reason "stop"
    when the last one is in stops[i] (its stop ids: the engine's eos ids, or those of its
    sampling fields, engine.generation.processing.row_stops), else "length" (max_new_tokens or
    the row's own bound)."""
    tokens = torch.stack(tokens_per_step, dim=1).cpu()
    logprobs = torch.stack(logprobs_per_step, dim=1).cpu()
    active = torch.stack(active_per_step, dim=1).cpu()
    result = []
    for i, prompt in enumerate(prompts):
        n = int(active[i].sum())  # steps taken before (and including) this row's eos
        response = tokens[i, :n].tolist()
        stopped = bool(response) and response[-1] in stops[i]
        result.append(Generation(prompt_ids=list(prompt), response_ids=response,
                                 response_logprobs=logprobs[i, :n].tolist(),
                                 finish_reason="stop" if stopped else "length"))
    return result
