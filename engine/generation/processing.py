"""vLLM's sampling fields (engine.api.sampling_fields.SamplingFields, SamplingParams.sampling)
applied by the hf backend's sampler, in vLLM 0.32's order and with its formulas
(vllm.v1.sample.sampler.Sampler, vllm.model_executor.layers.utils.apply_penalties,
vllm.v1.sample.logits_processor.builtin):

1. `shape` (before the temperature), per row with fields: the end-of-sequence ids and
   stop_token_ids set to -inf while the row has fewer than min_tokens sampled ids; logit_bias
   added; repetition_penalty r over the ids of prompt + reply (logit l -> l * (1 / r) when
   l > 0, else l * r); frequency_penalty f and presence_penalty p over the reply's ids
   (l -= f * count, then l -= p * (count > 0)).
2. `Shaping.probs` (random draws only; greedy takes the argmax of the shaped logits): the
   shaped logits divided by the temperature, min_p (tokens whose probability is below min_p
   times the largest one set to -inf), top_k (tokens below the k-th largest logit set to -inf;
   ties kept), then softmax; engine.generation.sampling.draw applies top-p to these
   probabilities and draws by inverse CDF with the row's own uniform.

The reported log-prob of the drawn token stays log_softmax(logits / T) of the UNSHAPED logits
(engine.generation.base's contract; vLLM's default raw_logprobs likewise ignores every step
above). Rows without fields (None) are untouched, so a call whose rows are all None samples
bitwise as without this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Shaping:
    """The shaped logits of a batch of rows and the per-row draw restrictions."""

    logits: torch.Tensor             # fp32 [B, V]: step 1 of the module docstring applied
    top_k: torch.Tensor | None       # int64 [B] (0: off); None when no row has one
    min_p: torch.Tensor | None       # fp32 [B] (0: off); None when no row has one

    def probs(self, temperature: float) -> torch.Tensor:
        """The probabilities [B, V] of the random draw at `temperature` > 0 (module
        docstring, step 2), before top-p."""
        z = self.logits / temperature
        if self.min_p is not None:
            p = torch.softmax(z, dim=-1)
            floor = p.amax(dim=-1, keepdim=True) * self.min_p[:, None].to(p.dtype)
            z = z.masked_fill(p < floor, float("-inf"))
        if self.top_k is not None:
            k = self.top_k.clamp(max=z.shape[-1])
            on = k > 0
            kth = z.sort(dim=-1, descending=True).values.gather(
                -1, (k.clamp(min=1) - 1)[:, None])
            z = z.masked_fill(on[:, None] & (z < kth), float("-inf"))
        return torch.softmax(z, dim=-1)


def row_stops(fields: list | None, eos_ids, batch: int) -> list[frozenset[int]]:
    """The ids that end each row: its fields' stop ids (SamplingFields.stop_ids), else the
    end-of-sequence ids."""
    eos = frozenset(eos_ids)
    if fields is None:
        return [eos] * batch
    return [eos if f is None else f.stop_ids(eos) for f in fields]


def shape(logits: torch.Tensor, fields: list | None, prompts: list[list[int]],
          outputs: list[list[int]], eos_ids) -> Shaping | None:
    """Step 1 of the module docstring for fp32 `logits` [B, V] of rows with `fields` [B]
    (None entries: untouched), each row's prompt ids and sampled ids so far; None when no row
    has fields. `logits` itself is not changed."""
    if fields is None or all(f is None for f in fields):
        return None
    out, vocab = logits.clone(), logits.shape[-1]
    for b, f in enumerate(fields):
        if f is None:
            continue
        row = out[b]
        if len(outputs[b]) < f.min_tokens:
            masked = [t for t in sorted(f.min_tokens_masked(eos_ids)) if t < vocab]
            row[masked] = float("-inf")
        if f.logit_bias:
            ids = torch.tensor([t for t, _ in f.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([x for _, x in f.logit_bias],
                                                dtype=row.dtype, device=row.device))
        if f.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompts[b]) | set(outputs[b])), dtype=torch.long,
                                device=row.device)
            r = torch.tensor(f.repetition_penalty, dtype=row.dtype, device=row.device)
            values = row[seen]
            row[seen] = values * torch.where(values > 0, 1.0 / r, r)
        if f.frequency_penalty or f.presence_penalty:
            counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.long,
                                                 device=row.device), minlength=vocab)[:vocab]
            row -= f.frequency_penalty * counts.to(row.dtype)
            row -= f.presence_penalty * (counts > 0).to(row.dtype)
    top_k = [0 if f is None else f.top_k for f in fields]
    min_p = [0.0 if f is None else f.min_p for f in fields]
    return Shaping(out, torch.tensor(top_k, device=out.device) if any(top_k) else None,
                   torch.tensor(min_p, dtype=torch.float32, device=out.device)
                   if any(min_p) else None)
