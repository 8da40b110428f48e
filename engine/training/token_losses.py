"""Per-token quantities from vocab-parallel logits (TP shards of the vocabulary).

Logits arrive as [b, s, V_padded/tp] on each TP rank, or, with the chunked loss head (the
default, engine.training.loss_head), as a `HiddenStates` from which the same quantities are
computed chunk by chunk over tokens without materialising the logits; every function below
accepts either and returns the same numbers (within float32 rounding). Rows of the padded
vocabulary (ids >= the real vocab size) are masked to -inf, so losses and log-probs equal those
of the HF model.
All functions are collective over the tensor-parallel group (megatron's vocab-parallel ops).

No function here modifies its `logits` argument: megatron's `vocab_parallel_cross_entropy`
subtracts the max and exponentiates in place, so it only ever sees a private copy. Callers may
read the same logits again (entropy after log-probs, an output hook before the loss).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from engine.training.loss_head import HiddenStates


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padded vocab rows held by this TP rank to -inf (out of place)."""
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    ids = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def token_logprobs(logits: torch.Tensor | HiddenStates, labels: torch.Tensor, vocab_size: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(label) per token, [b, s] float32, from vocab-parallel logits [b, s, V/tp].
    `logits` is left unchanged (the in-place cross-entropy works on a private copy)."""
    if isinstance(logits, HiddenStates):
        return logits.logprobs(labels, vocab_size, temperature)[0]
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    scaled = mask_padded_vocab(scaled, vocab_size)
    if scaled.data_ptr() == logits.data_ptr():  # no op above copied: copy before mutating
        scaled = scaled.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled.contiguous(), labels)


def token_entropy(logits: torch.Tensor | HiddenStates, vocab_size: int, temperature: float = 1.0
                  ) -> torch.Tensor:
    """Entropy of the next-token distribution per position, [b, s] float32 (differentiable).
    Finite where some logits are -inf (banned tokens contribute 0)."""
    if isinstance(logits, HiddenStates):
        labels = torch.zeros(logits.hidden.shape[:-1], dtype=torch.long,
                             device=logits.hidden.device)  # any label: only H is used
        return logits.logprobs(labels, vocab_size, temperature, with_entropy=True)[1]
    logits = mask_padded_vocab(logits.float() / temperature, vocab_size)
    group = ps.get_tensor_model_parallel_group()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max
    exp = torch.exp(shifted)
    sum_exp = exp.sum(dim=-1, keepdim=True)
    weighted = (exp * torch.nan_to_num(shifted, neginf=0.0)).sum(dim=-1, keepdim=True)
    if dist.get_world_size(group) > 1:
        # all-reduce forward, identity backward: every TP rank computes the same loss from
        # these sums, so the gradient must not be summed over TP again
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    # H = log Z - E[x], with x shifted by the max
    return (torch.log(sum_exp) - weighted / sum_exp).squeeze(-1)


def token_logprobs_and_entropy(logits, labels: torch.Tensor, vocab_size: int,
                               temperature: float = 1.0, entropy_grad: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_logprobs, token_entropy) of the same logits (or HiddenStates), [b, s] float32
    each; with the chunked head in one pass over the vocabulary. The entropy is differentiable
    only when `entropy_grad` (else no graph is kept for it)."""
    if isinstance(logits, HiddenStates):
        logp, entropy = logits.logprobs(labels, vocab_size, temperature, with_entropy=True)
        return logp, entropy if entropy_grad else entropy.detach()
    logp = token_logprobs(logits, labels, vocab_size, temperature)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = token_entropy(logits, vocab_size, temperature)
    return logp, entropy
