"""The gated delta rule of Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention), in torch.

Per head, with a state S [dk, dv] that starts at zero (or `initial_state`) and tokens t:

    S <- exp(g_t) S                     (decay; g_t <= 0 is a log factor)
    u_t = beta_t (v_t - S^T k_t)         (the delta: what the state mispredicts for k_t)
    S <- S + k_t u_t^T                   (write the correction)
    o_t = S^T (q_t / sqrt(dk))

`recurrent_gated_delta_rule` runs exactly that loop (the reference). `chunk_gated_delta_rule`
computes the same numbers chunk by chunk: inside a chunk with cumulative log decays G_i the
deltas solve the unit lower-triangular system (I + A) U = beta V - beta e^G K S_0 with
A_ij = beta_i e^(G_i - G_j) k_i.k_j (j < i), so each chunk costs a few matmuls and one
triangular solve, and the state is carried from chunk to chunk. `segmented_gated_delta_rule`
restarts the state at every segment start (packed sequences) and uses flash-linear-attention's
kernel for CUDA tensors when the `fla` package imports.

Shapes (any float dtype; the math runs in fp32, outputs return in the input dtype):
  q, k [b, t, h, dk] (same head count as v: repeat grouped heads first), v [b, t, h, dv],
  g, beta [b, t, h]; output [b, t, h, dv]; states [b, h, dk, dv].
q and k are used as given (l2-normalise them first, `l2norm`); the 1/sqrt(dk) query scale is
applied here.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (HF's and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """[b, t, h, ...] -> fp32 [b, h, t, ...]."""
    return [x.transpose(1, 2).float().contiguous() for x in xs]


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The token-by-token reference. Returns (output [b, t, h, dv], final state)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, t, dk = k.shape
    state = (torch.zeros(b, h, dk, v.shape[-1], device=q.device) if initial_state is None
             else initial_state.float())
    q = q * dk ** -0.5
    out = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        predicted = (state * k[:, :, i, :, None]).sum(-2)
        delta = (v[:, :, i] - predicted) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, i, :, None]).sum(-2))
    o = torch.stack(out, dim=2) if out else v.new_zeros(b, h, 0, v.shape[-1])
    return o.transpose(1, 2).to(dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK):
    """The chunked form of `recurrent_gated_delta_rule` (same arguments and results, equal
    within fp32 rounding)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk_size
    if pad:  # padded tokens: g = 0, beta = 0 (they neither decay nor write the state)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size
    q = q * dk ** -0.5
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk_size) for x in (g, beta))
    cum = g.cumsum(-1)                                               # G_i
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    strictly_lower = upper.T                                         # j < i
    system = (beta[..., :, None] * kk * decay).masked_fill(~strictly_lower, 0.0)
    system = system + torch.eye(chunk_size, device=q.device)         # I + A, unit lower
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, u_state = solved[..., :dv], solved[..., dv:]              # U = u_free - u_state S0
    scores = (q @ k.transpose(-1, -2)) * decay                        # j <= i (decay is 0 above)
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    state = (torch.zeros(b, h, dk, dv, device=q.device) if initial_state is None
             else initial_state.float())
    out = []
    for c in range(n):
        u = u_free[:, :, c] - u_state[:, :, c] @ state
        out.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * cum[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(
            -1, -2) @ u
    o = torch.cat(out, dim=2)[:, :, :t]
    return o.transpose(1, 2).to(dtype), state


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def segmented_gated_delta_rule(q, k, v, g, beta, bounds: list[int] | None = None):
    """The chunked rule over [b, t, ...] rows; `bounds` (packed rows, b = 1): segment
    boundaries [0, ..., t], the state restarting at zero at each. CUDA tensors go to fla's
    chunk_gated_delta_rule (cu_seqlens) when it is installed. Returns the output only."""
    if q.is_cuda and fla_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule  # optional (gpu)

        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=q.device)
        out, _ = fla_rule(q, k, v, g.float(), beta, scale=q.shape[-1] ** -0.5, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=False)
        return out
    if bounds is None:
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]
    pieces = [chunk_gated_delta_rule(*(x[:, a:e] for x in (q, k, v, g, beta)))[0]
              for a, e in zip(bounds[:-1], bounds[1:]) if e > a]
    return torch.cat(pieces, dim=1)
