"""Chunked vocab-parallel loss head: the output projection fused with the vocab-parallel
log-softmax (log-probs of the labels) and entropy, chunk by chunk over tokens.

Memory: at most one chunk's logits live at a time ([chunk_tokens, V_padded/tp] float32, two
such buffers at the peak of backward) instead of [tokens, V_padded/tp] float32 for the whole
micro-batch (which today's path holds twice: the logits and the cross-entropy's copy). The
backward recomputes each chunk's logits from the saved hidden states; it needs no collective
(the per-token log-partition and entropy saved by the forward are already TP-global).

Numbers (tested against the unchunked path in tests/test_loss_head.py): the same operations as
megatron's output layer + `vocab_parallel_cross_entropy` + engine.training.token_losses, i.e.
logits = hidden @ W^T in the hidden/weight dtype, then float32; `/ temperature`; padded vocab
rows (ids >= vocab_size) masked to -inf; max all-reduced (MAX) over TP; sum of exp, label
logit and (with entropy) sum of p*z all-reduced (SUM) over TP. Gradients: d/dz of
g_logp * log p(label) + g_H * H, /temperature, cast to the weight dtype, then
grad_hidden = grad_z @ W (this TP rank's partial sum: the caller's TP region op sums it over TP,
models.layers.heads.output) and grad_W = grad_z^T @ hidden accumulated in float32 over chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

# Tokens per chunk (train.loss_chunk_tokens' default), chosen by measurement: docs/benchmarks.md
# "Loss head memory".
DEFAULT_LOSS_CHUNK_TOKENS = 1024


class _Shard(NamedTuple):
    start: int         # vocab id of this TP rank's first row
    real: int          # rows of the shard holding real vocab ids (the rest is padding)
    group: object      # the TP process group (None: no reduction)


def _shard(weight: torch.Tensor, vocab_size: int) -> _Shard:
    width = weight.shape[0]
    start = ps.get_tensor_model_parallel_rank() * width
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        group = None
    return _Shard(start, max(0, min(width, vocab_size - start)), group)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, temperature: float,
                  shard: _Shard) -> torch.Tensor:
    """Float32 logits [c, V/tp] of one chunk: matmul in the input dtype (as megatron's output
    layer), / temperature, padded vocab rows -inf."""
    z = torch.matmul(x, weight.t()).float()
    if temperature != 1.0:
        z = z.div_(temperature)
    if shard.real < z.shape[1]:
        z[:, shard.real:] = float("-inf")
    return z


def _label_columns(labels: torch.Tensor, shard: _Shard, width: int):
    """(rows whose label lies in this shard [bool c], their column in the shard [c])."""
    local = labels - shard.start
    inside = (local >= 0) & (local < width)
    return inside, local.clamp(0, width - 1)


def _forward_chunk(x, weight, labels, temperature, shard, with_entropy):
    """(log p(label) [c], entropy [c] or None, log-partition [c], whether the label's logit is
    the largest [c] bool (ties count)), all TP-global."""
    z = _chunk_logits(x, weight, temperature, shard)
    zmax = z.max(dim=1).values
    if shard.group is not None:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=shard.group)
    z.sub_(zmax[:, None])
    inside, cols = _label_columns(labels, shard, z.shape[1])
    picked = torch.where(inside, z.gather(1, cols[:, None]).squeeze(1), 0.0)
    e = z.exp()
    sums = [e.sum(dim=1), picked]
    if with_entropy:
        if shard.real < z.shape[1]:
            z[:, shard.real:] = 0.0  # exp is 0 there: 0 * 0 instead of 0 * -inf
        sums.append(e.mul_(z).sum(dim=1))
    del z, e
    sums = torch.stack(sums, dim=1)
    if shard.group is not None:
        dist.all_reduce(sums, group=shard.group)
    log_z = torch.log(sums[:, 0])
    entropy = log_z - sums[:, 2] / sums[:, 0] if with_entropy else None
    # sums[:, 1]: the label's logit minus the TP-global max logit
    return sums[:, 1] - log_z, entropy, zmax + log_z, sums[:, 1] >= 0


def _backward_chunk(x, weight, labels, temperature, shard, lse, entropy, g_logp, g_ent):
    """d(sum g_logp * log p(label) + g_ent * H)/d logits for one chunk, [c, V/tp] in the
    weight dtype (already divided by the temperature)."""
    z = _chunk_logits(x, weight, temperature, shard)
    z.sub_(lse[:, None])  # log p
    p = z.exp()
    if g_ent is not None:  # dH/dz_j = -p_j (log p_j + H)
        if shard.real < z.shape[1]:
            z[:, shard.real:] = 0.0  # p is 0 there: 0 * 0 instead of 0 * -inf
        z.add_(entropy[:, None]).mul_(p).mul_(g_ent[:, None])  # g_ent p (log p + H)
        grad = p.mul_(g_logp[:, None]).add_(z)
    else:
        grad = p.mul_(g_logp[:, None])
    del z
    grad.neg_()  # -(g_logp p + g_ent p (log p + H)); + g_logp at the label column:
    inside, cols = _label_columns(labels, shard, grad.shape[1])
    grad.scatter_add_(1, cols[:, None], torch.where(inside, g_logp, 0.0)[:, None])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(weight.dtype)


class _ChunkedHead(torch.autograd.Function):
    """(hidden [n, h], weight [V/tp, h], labels [n]) -> (log p(label) [n], entropy [n] or [0],
    label is the argmax [n] bool, no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, temperature, chunk, with_entropy):
        shard = _shard(weight, vocab_size)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            lp, ent, lz, hit = _forward_chunk(hidden[a:b], weight, labels[a:b], temperature,
                                              shard, with_entropy)
            logp[a:b], lse[a:b], hits[a:b] = lp, lz, hit
            if with_entropy:
                entropy[a:b] = ent
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.settings = (shard, temperature, chunk, with_entropy)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(hits)
        return logp, entropy, hits

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_hits):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        shard, temperature, chunk, with_entropy = ctx.settings
        n = hidden.shape[0]
        if g_logp is None:
            g_logp = lse.new_zeros(n)
        g_ent = g_ent if with_entropy else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = hidden[a:b]
            grad = _backward_chunk(x, weight, labels[a:b], temperature, shard, lse[a:b],
                                   entropy[a:b] if with_entropy else None, g_logp[a:b],
                                   g_ent[a:b] if g_ent is not None else None)
            if want_h:
                torch.matmul(grad, weight, out=grad_h[a:b])
            if want_w:
                if grad.dtype == torch.float32:
                    grad_w.addmm_(grad.t(), x)
                else:
                    grad_w.add_(torch.matmul(grad.t(), x).float())
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     vocab_size: int, temperature: float, chunk_tokens: int,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label) [...], entropy [...] or None), float32, for hidden states [..., h]
    replicated over TP (gradient: this rank's partial sum, see models.layers.heads.output), this TP
    rank's weight shard [V_padded/tp, h] and labels [...]. Collective over the TP group
    (forward only). `chunk_tokens` > 0 tokens per chunk."""
    logp, entropy, _ = _head(hidden, weight, labels, vocab_size, temperature, chunk_tokens,
                             with_entropy)
    return logp, entropy


def chunked_logprobs_and_hits(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              vocab_size: int, chunk_tokens: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked_logprobs at temperature 1 without entropy, plus bool [...]: whether each
    label's logit is the largest over the real vocabulary (ties count as right; no gradient),
    from the same pass (engine.training.mtp's accuracy)."""
    logp, _, hits = _head(hidden, weight, labels, vocab_size, 1.0, chunk_tokens, False)
    return logp, hits


def _head(hidden, weight, labels, vocab_size, temperature, chunk_tokens, with_entropy):
    """(log p, entropy or None, hits), each shaped like `labels` (chunked_logprobs)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be > 0")
    shape = labels.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy, hits = _ChunkedHead.apply(flat, weight, labels.reshape(-1), int(vocab_size),
                                             float(temperature), int(chunk_tokens),
                                             bool(with_entropy))
    return (logp.view(shape), entropy.view(shape) if with_entropy else None, hits.view(shape))


@dataclass
class HiddenStates:
    """What a loss function receives from the chunked head (engine.training.schedule) in place
    of logits: the last stage's final hidden states and this TP rank's output weight shard."""

    hidden: torch.Tensor   # [b, s, h], full sequence, replicated over TP (models.layers.heads.output)
    weight: torch.Tensor   # [V_padded/tp, h]
    chunk_tokens: int      # tokens per chunk of the head

    def logprobs(self, labels: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                 with_entropy: bool = False):
        """(log p(labels) [b, s], entropy [b, s] or None), float32, differentiable."""
        return chunked_logprobs(self.hidden, self.weight, labels, vocab_size, temperature,
                                self.chunk_tokens, with_entropy)
