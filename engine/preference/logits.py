"""TRL's `mean_logits` metric (`logits/chosen`, `logits/rejected` of DPO and KTO): the mean of
the logits over the real vocabulary at every position, from vocab-parallel logits or from the
chunked head's hidden states (the logits are never built)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from engine.training.loss_head import HiddenStates

_ROW_CHUNK = 4096   # vocabulary rows (or tokens) per float64 chunk of token_mean_logits


def _vocab_rows(local: int, vocab_size: int, device) -> torch.Tensor:
    """[local] bool: which of this TP rank's vocabulary rows are real (not megatron's
    padding)."""
    start = ps.get_tensor_model_parallel_rank() * local if ps.model_parallel_is_initialized() \
        else 0
    return torch.arange(start, start + local, device=device) < vocab_size


def _tp_sum(t: torch.Tensor) -> torch.Tensor:
    if ps.model_parallel_is_initialized():
        group = ps.get_tensor_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
    return t


def token_mean_logits(logits: torch.Tensor | HiddenStates, vocab_size: int) -> torch.Tensor:
    """[b, s] float64, no gradient: the mean of the logits over the real vocabulary (the first
    `vocab_size` ids, the HF model's) at every position, TRL's `mean_logits`. From
    vocab-parallel logits [b, s, V/tp], or from the chunked head's HiddenStates as the hidden
    state times the mean of the output weight's real rows (the logits are never built).
    Float64 in chunks of _ROW_CHUNK rows or tokens. Collective over the TP group."""
    chunked = isinstance(logits, HiddenStates)
    with torch.no_grad():
        if chunked:   # sum_v (h . w_v) / V = h . (sum_v w_v / V), summed over TP first
            w = logits.weight
            keep = _vocab_rows(w.shape[0], vocab_size, w.device)
            mean_row = torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)
            for i in range(0, w.shape[0], _ROW_CHUNK):
                mean_row += (w[i:i + _ROW_CHUNK].double() * keep[i:i + _ROW_CHUNK, None]).sum(0)
            vec, source = _tp_sum(mean_row) / vocab_size, logits.hidden
        else:         # this rank's share of the mean, summed over TP after
            keep = _vocab_rows(logits.shape[-1], vocab_size, logits.device)
            vec, source = keep.to(torch.float64) / vocab_size, logits
        flat = source.reshape(-1, source.shape[-1])
        out = torch.zeros(flat.shape[0], dtype=torch.float64, device=flat.device)
        for i in range(0, flat.shape[0], _ROW_CHUNK):
            out[i:i + _ROW_CHUNK] = flat[i:i + _ROW_CHUNK].double() @ vec
        if not chunked:
            out = _tp_sum(out)
        return out.reshape(source.shape[:-1])


def side_mean_logits(mean_logits: torch.Tensor, mask: torch.Tensor, side: torch.Tensor,
                     tokens: float) -> torch.Tensor:
    """This micro-batch's share of the mean of `mean_logits` over one side's completion tokens
    of the global batch: the sum over its tokens (`side` [b, s] bool, times the loss `mask`)
    divided by that side's global token count `tokens` (1 when there is none)."""
    return (mean_logits * mask.to(torch.float64))[side].sum() / max(tokens, 1.0)
