"""Chunked vocab-parallel loss head: the output projection fused with the vocab-parallel
log-softmax (log-probs of the labels) and entropy, chunk by chunk over tokens.

Memory: at most one chunk's logits live at a time ([chunk_tokens, V_padded/tp] float32, two
such buffers at the peak of backward) instead of [tokens, V_padded/tp] float32 for the whole
micro-batch (which today's path holds twice: the logits and the cross-entropy's copy). The
backward recomputes each chunk's logits from the saved hidden states; it needs no collective
(the per-token log-partition and entropy saved by the forward are already TP-global).

Numbers (tested against the unchunked path in tests/test_loss_head.py and
tests/test_fp32_wgrad.py): the math of megatron's output layer + `vocab_parallel_cross_entropy`
+ engine.training.token_losses, with one difference in bf16: the logits come out of the GEMM
in float32 (models.build.wgrad_fp32.matmul_fp32: fp32 products and sums) where megatron
rounds them to bf16 and then casts; each chunk's logits are written once and read by the
softmax passes, with no dtype round trip. `/ temperature`; padded vocab rows (ids >=
vocab_size) masked to -inf; max all-reduced (MAX) over TP; sum of exp, label logit and (with
entropy) sum of p*z all-reduced (SUM) over TP. Gradients: d/dz of g_logp * log p(label) +
g_H * H, /temperature, computed in float32 and rounded to the weight dtype once (by the last
multiplication), then grad_hidden = grad_z @ W (this TP rank's partial sum: the caller's TP
region op sums it over TP, models.layers.heads.output) and grad_W = grad_z^T @ hidden as GEMMs
with float32 output accumulated over the chunks: for a bf16 weight under megatron DDP with a
float32 buffer straight into `weight.main_grad` (DDP's hook told so, as megatron's own
fused linears do: `wgrad_fp32.main_grad_autograd_result`), so neither a chunk's nor a
micro-batch's output-weight gradient is ever rounded to bf16 and no [V/tp, h] gradient buffer
is allocated; otherwise into a float32 buffer handed to autograd in the weight's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.build.wgrad_fp32 import (accumulate_matmul_fp32_, accumulates_into_main_grad,
                                     gemm_operand, main_grad_autograd_result, matmul_fp32)
from engine.training.loss import DEFAULT_LOSS_CHUNK_TOKENS  # noqa: F401 (re-exported)


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
    """Float32 logits [c, V/tp] of one chunk, written by the GEMM itself (no logits in the
    input dtype, no cast pass; `weight` as models.build.wgrad_fp32.gemm_operand gives it),
    / temperature, padded vocab rows -inf."""
    z = matmul_fp32(x, weight.t())
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
    zmax = z.amax(dim=1)
    if shard.group is not None:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=shard.group)
    z.sub_(zmax[:, None])
    inside, cols = _label_columns(labels, shard, z.shape[1])
    picked = torch.where(inside, z.gather(1, cols[:, None]).squeeze(1), 0.0)
    if with_entropy:
        e = z.exp()
        sums = [e.sum(dim=1), picked]
        if shard.real < z.shape[1]:
            z[:, shard.real:] = 0.0  # exp is 0 there: 0 * 0 instead of 0 * -inf
        sums.append(e.mul_(z).sum(dim=1))
        del e
    else:
        sums = [z.exp_().sum(dim=1), picked]  # z is not needed any more: exp in place
    del z
    sums = torch.stack(sums, dim=1)
    if shard.group is not None:
        dist.all_reduce(sums, group=shard.group)
    log_z = torch.log(sums[:, 0])
    entropy = log_z - sums[:, 2] / sums[:, 0] if with_entropy else None
    # sums[:, 1]: the label's logit minus the TP-global max logit
    return sums[:, 1] - log_z, entropy, zmax + log_z, sums[:, 1] >= 0


def _backward_chunk(x, weight, labels, temperature, shard, lse, entropy, g_logp, g_ent,
                    dtype):
    """d(sum g_logp * log p(label) + g_ent * H)/d logits for one chunk, [c, V/tp] in `dtype`
    (the weight's), already divided by the temperature: computed in float32 (the sign folded
    into the multiplications, which is exact, so fp32 gives bitwise the numbers of a separate
    negation) and rounded to `dtype` once, by the last operation."""
    z = _chunk_logits(x, weight, temperature, shard)
    z.sub_(lse[:, None])  # log p
    if g_ent is None:  # -(g_logp p) + g_logp at the label column
        grad = z.exp_().mul_(-g_logp[:, None])
    else:  # dH/dz_j = -p_j (log p_j + H): -(g_logp p + g_ent p (log p + H)) + g_logp onehot
        p = z.exp()
        if shard.real < z.shape[1]:
            z[:, shard.real:] = 0.0  # p is 0 there: 0 * 0 instead of 0 * -inf
        z.add_(entropy[:, None]).mul_(p).mul_(g_ent[:, None])  # g_ent p (log p + H)
        grad = p.mul_(-g_logp[:, None]).sub_(z)
    del z
    inside, cols = _label_columns(labels, shard, grad.shape[1])
    grad.scatter_add_(1, cols[:, None], torch.where(inside, g_logp, 0.0)[:, None])
    if dtype == torch.float32:
        return grad.div_(temperature) if temperature != 1.0 else grad
    return torch.div(grad, temperature, out=torch.empty(grad.shape, dtype=dtype,
                                                          device=grad.device))


def _weight_grad_target(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the float32 [V/tp, h] buffer the chunks' weight gradients are accumulated in, whether
    it is megatron DDP's `main_grad` itself): main_grad where
    models.build.wgrad_fp32.accumulates_into_main_grad (a bf16 weight, fp32 DDP buffer); else
    a zeroed buffer returned to autograd in the weight's dtype (an fp32 weight: DDP's hook adds
    it, as for any parameter)."""
    if accumulates_into_main_grad(weight):
        return weight.main_grad, True
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device), False


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
        w_gemm = gemm_operand(weight)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            lp, ent, lz, hit = _forward_chunk(hidden[a:b], w_gemm, labels[a:b], temperature,
                                              shard, with_entropy)
            logp[a:b], lse[a:b], hits[a:b] = lp, lz, hit
            if with_entropy:
                entropy[a:b] = ent
        del w_gemm
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
        grad_w, into_main = _weight_grad_target(weight) if want_w else (None, False)
        w_gemm = gemm_operand(weight)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = hidden[a:b]
            grad = _backward_chunk(x, w_gemm, labels[a:b], temperature, shard, lse[a:b],
                                   entropy[a:b] if with_entropy else None, g_logp[a:b],
                                   g_ent[a:b] if g_ent is not None else None, weight.dtype)
            if want_h:
                torch.matmul(grad, weight, out=grad_h[a:b])
            if want_w and grad.dtype == torch.float32:
                grad_w.addmm_(grad.t(), x)
            elif want_w:  # a GEMM with fp32 output: no chunk's weight gradient rounded
                accumulate_matmul_fp32_(grad_w, grad.t(), x)
        if want_w:
            grad_w = (main_grad_autograd_result(weight) if into_main
                      else grad_w.to(weight.dtype))
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
