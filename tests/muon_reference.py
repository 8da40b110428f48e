"""A plain single-process Muon + AdamW step written from the formulas (no megatron-core, no
emerging-optimizers), the reference tests/test_muon.py and tests/multirank/sft_invariance.py
(flag `muonref`) hold the engine's optim.name=muon to.

Muon (megatron-core's TensorParallelMuon over emerging-optimizers' OrthogonalizedOptimizer, at
its defaults: decoupled weight decay, EMA momentum, Nesterov off):
    p <- p * (1 - lr * wd)
    m <- beta * m + (1 - beta) * g
    O <- NewtonSchulz(m), 5 quintic steps on X = m / ||m||_F (transposed when rows > cols):
         A = X X^T, B = b A + c A A, X = a X + B X      with (a, b, c) per step below
    p <- p - lr * O * sqrt(max(rows, cols)) * extra_scale      (scale_mode spectral)
with split QKV: the fused QKV weight [groups x (q + k + v), hidden] is cut per query group into
its Q, K and V rows, each orthogonalized and scaled by its own shape.
AdamW (torch.optim.AdamW, the rest of the parameters):
    p <- p * (1 - lr * wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2
    p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
Gradient clipping before both: g <- g * min(1, clip / (||g_all||_2 + 1e-6)).
"""
from __future__ import annotations

import math

import torch

# the "quintic" coefficients (Keller Jordan's modded-nanogpt, emerging-optimizers' default
# for megatron-core's Muon), used in this order, cycling after the fifth
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalization of the 2-D fp32 matrix `g` (fp32 throughout)."""
    x = g.float()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / x.norm().clamp_min(eps)
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transpose else x


def orthogonalized_update(u: torch.Tensor, steps: int = 5, extra_scale: float = 1.0,
                          qkv_split: tuple[int, int, int] | None = None) -> torch.Tensor:
    """NewtonSchulz(u) x sqrt(max(shape)) x extra_scale, per Q/K/V block with `qkv_split`."""
    def one(x):
        return newton_schulz(x, steps) * math.sqrt(max(x.shape)) * extra_scale

    if qkv_split is None:
        return one(u)
    rows, cols = u.shape
    groups = rows // sum(qkv_split)
    parts = torch.split(u.view(groups, sum(qkv_split), cols), list(qkv_split), dim=1)
    return torch.cat([one(p.reshape(-1, cols)).view(groups, -1, cols) for p in parts],
                     dim=1).view(rows, cols)


class ReferenceOptimizer:
    """Muon for the parameters named in `muon` (name -> Q/K/V split or None), AdamW for the
    rest. `step(params, grads, lr, wd)` updates `params` (name -> tensor) in place; `lr` and
    `wd` map names to that parameter's learning rate and weight decay. Returns the grad norm."""

    def __init__(self, muon: dict, momentum=0.95, betas=(0.9, 0.95), eps=1e-8, clip=1.0,
                 ns_steps=5, extra_scale=1.0):
        self.muon, self.momentum, self.betas, self.eps = muon, momentum, betas, eps
        self.clip, self.ns_steps, self.extra_scale = clip, ns_steps, extra_scale
        self.state: dict = {}
        self.t = 0

    def step(self, params: dict, grads: dict, lr: dict, wd: dict) -> float:
        self.t += 1
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        coeff = min(1.0, self.clip / (norm + 1e-6)) if self.clip else 1.0
        b1, b2 = self.betas
        for name, p in params.items():
            g = grads[name] * coeff if coeff < 1.0 else grads[name]
            p.mul_(1 - lr[name] * wd[name])
            if name in self.muon:
                m = self.state.setdefault(name, torch.zeros_like(p))
                m.mul_(self.momentum).add_(g, alpha=1 - self.momentum)
                p.sub_(lr[name] * orthogonalized_update(m, self.ns_steps, self.extra_scale,
                                                        self.muon[name]))
            else:
                m, v = self.state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                mhat, vhat = m / (1 - b1 ** self.t), v / (1 - b2 ** self.t)
                p.sub_(lr[name] * mhat / (vhat.sqrt() + self.eps))
        return norm
