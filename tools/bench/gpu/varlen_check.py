"""Packed attention through torch's varlen kernel against the engine's per-segment loop.

    python -m tools.bench.gpu.varlen_check --json OUT           # on a CUDA host (bf16)
    python -m tools.bench.gpu.varlen_check --json OUT --smoke   # the CPU smoke (fp32)

One packed row per case, segment lengths log-normal (seed 0; median 256 tokens, sigma 1,
clamped to 16..4,096, the last cut to fill the row; smoke: median 24, 2..96):
  causal_gqa   16 query heads over 8 KV heads, head dim 128 (Qwen3-0.6B widths), causal
  window_gqa   the same with a sliding window (window_left 127: 128 keys per query)
  causal_mha   16 query heads over 16 KV heads
On CUDA (bf16, 16,384 tokens) the candidate is the engine's core attention itself
(`SDPACoreAttention.forward` with the row's PackedSeqParams on the device): its dispatch
(models.layers.attention.varlen.uses_varlen) sends the row to `varlen_attn` in one call, and
`path` records what it chose. The baseline is the per-segment loop the core attention keeps
for everything else (K/V repeated, one SDPA call per segment; the window case through the
sink/window attention). Both run forward and backward (grad_out fixed); reported per case:
max |candidate - loop| of the output and of dq, dk, dv; each side's max error against the
loop in fp32 (`err_candidate`, `err_loop`); `ok` when the core attention chose the kernel and
its error is at most twice the bf16 loop's plus 1e-4 for every tensor (flash-attn's own
tests' criterion), and the
median milliseconds of a forward + backward of each side (CUDA events, 20 runs after 3).
With --smoke (the CPU, fp32, 256 tokens, 4 heads over 2, head dim 16) the kernel cannot run:
the candidate is `varlen_reference`, the kernel's contract (a block-diagonal causal / window
mask from cu_seq_q, GQA through SDPA's enable_gqa) as one dense SDPA call, handed the
arguments `varlen.varlen_call` builds (`path` "reference"): it checks the arguments, not the
kernel; times are CPU wall times (time.perf_counter).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from models.layers.attention import varlen
from models.layers.attention.core import SDPACoreAttention, packed_causal_attention
from models.layers.attention.sinks import attend_fn
from parallel.packed_seqs import packed_seq_params


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    window_left: int | None


CASES = (Case("causal_gqa", 16, 8, None), Case("window_gqa", 16, 8, 127),
         Case("causal_mha", 16, 16, None))
SMOKE_CASES = (Case("causal_gqa", 4, 2, None), Case("window_gqa", 4, 2, 7),
               Case("causal_mha", 4, 4, None))


def varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                     window_size=(-1, -1), enable_gqa=False):
    """What `torch.nn.attention.varlen.varlen_attn` computes (its docstring's contract), as
    one dense SDPA call over the whole row: query i of segment s sees key j of s when
    j <= i + right and i - j <= left (-1: unbounded). Refuses what the kernel refuses or
    would misread: boundaries not int32 on the query's device, max lengths other than the
    longest segment, fewer KV heads without enable_gqa. Tokens outside every segment: 0."""
    for cu in (cu_seq_q, cu_seq_k):
        if cu.dtype != torch.int32 or cu.device != query.device:
            raise ValueError(f"cu_seq {cu.dtype} on {cu.device}: int32 on {query.device} wanted")
    bounds = cu_seq_q.tolist()
    if cu_seq_k.tolist() != bounds:
        raise ValueError("cu_seq_k differs from cu_seq_q in self-attention")
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    if (max_q, max_k) != (longest, longest) or not all(isinstance(m, int) for m in (max_q, max_k)):
        raise ValueError(f"max_q, max_k = {max_q!r}, {max_k!r}; the longest segment is {longest}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError("fewer KV heads than query heads without enable_gqa")
    t = query.shape[0]
    seg = torch.full((t,), -1)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[a:b] = i
    pos = torch.arange(t)
    back = pos[:, None] - pos[None, :]  # i - j
    left, right = window_size
    allowed = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if right >= 0:
        allowed &= back >= -right
    if left >= 0:
        allowed &= back <= left
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.to(query.device),
                                         scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
    return torch.where((seg >= 0).to(query.device)[:, None, None], out, 0.0)


def segment_lengths(tokens: int, median: int, shortest: int, longest: int,
                    seed: int = 0) -> list[int]:
    """Log-normal lengths (sigma 1, this median, clamped to shortest..longest, the last cut)
    summing to `tokens`."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < tokens:
        draw = math.exp(math.log(median) + torch.randn((), generator=gen).item())
        n = min(max(int(draw), shortest), longest, tokens - total)
        lengths.append(n)
        total += n
    return lengths


def loop_attention(q, k, v, bounds, scale, case: Case):
    """The per-segment path: K/V repeated to the query heads, one call per segment."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    attend = None if case.window_left is None else attend_fn(scale, case.window_left, None)
    return packed_causal_attention(q, k, v, bounds, scale, attend)


def core_attention(case: Case, head_dim: int) -> SDPACoreAttention:
    config = TransformerConfig(num_layers=1, hidden_size=case.heads * head_dim,
                               num_attention_heads=case.heads, num_query_groups=case.kv_heads,
                               kv_channels=head_dim,
                               window_size=None if case.window_left is None
                               else (case.window_left, 0))
    return SDPACoreAttention(config, 1, None, "self")


def forward_backward(fn, inputs, grad_out):
    """(output, (dq, dk, dv)) of fn(*inputs) with `grad_out`."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def timed_ms(fn, inputs, grad_out, cuda: bool, runs: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of a forward + backward."""
    times = []
    for i in range(warmup + runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward_backward(fn, inputs, grad_out)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            forward_backward(fn, inputs, grad_out)
            ms = 1e3 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def run_case(case: Case, tokens: int, head_dim: int, device: torch.device,
             dtype: torch.dtype, cuda: bool) -> dict:
    gen = torch.Generator().manual_seed(1)
    lengths = segment_lengths(tokens, *((256, 16, 4096) if cuda else (24, 2, 96)))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen).to(device, dtype)
               for h in (case.heads, case.kv_heads, case.kv_heads))
    grad_out = torch.randn(tokens, case.heads, head_dim, generator=gen).to(device, dtype)
    module = core_attention(case, head_dim).to(device)
    scale = module.scale
    if cuda:
        params = packed_seq_params(bounds)
        params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.to(device)
        path = varlen.varlen_refusal(q, k, v, module.softmax_offset is not None) or "varlen"

        def candidate(q_, k_, v_):
            out = module(q_, k_, v_, packed_seq_params=params)
            return out.reshape(tokens, case.heads, head_dim)
    else:
        path = "reference"   # the CPU smoke: the kernel's contract, not the kernel

        def candidate(q_, k_, v_):
            call = varlen.varlen_call(q_, k_, bounds, scale, case.window_left)
            return varlen_reference(q_, k_, v_, call.cu_seq_q, call.cu_seq_k, call.max_q,
                                    call.max_k, **call.kwargs())

    def loop(q_, k_, v_):
        return loop_attention(q_, k_, v_, bounds, scale, case)

    inputs = (q, k, v)
    got = forward_backward(candidate, inputs, grad_out)
    base = forward_backward(loop, inputs, grad_out)
    ref = forward_backward(loop, tuple(x.float() for x in inputs), grad_out.float())
    names = ("out", "dq", "dk", "dv")
    flat = [(n, a[0] if n == "out" else a[1][names.index(n) - 1]) for a in (got, base, ref)
            for n in names]
    by = {side: dict(flat[i * 4:(i + 1) * 4]) for i, side in enumerate(("got", "base", "ref"))}

    def max_diff(a, b):
        return float((a.float() - b.float()).abs().max())

    diff = {n: max_diff(by["got"][n], by["base"][n]) for n in names}
    err_c = {n: max_diff(by["got"][n], by["ref"][n]) for n in names}
    err_l = {n: max_diff(by["base"][n], by["ref"][n]) for n in names}
    ok = all(err_c[n] <= 2 * err_l[n] + 1e-4 for n in names)
    ok = ok and (path == "varlen" or not cuda)  # on a card, the dispatch must pick the kernel
    candidate_ms = timed_ms(candidate, inputs, grad_out, cuda)
    loop_ms = timed_ms(loop, inputs, grad_out, cuda)
    return {"case": case.name, "path": path, "tokens": tokens, "segments": len(lengths),
            "longest": max(lengths), "heads": case.heads, "kv_heads": case.kv_heads,
            "head_dim": head_dim, "window_left": case.window_left, "max_abs_diff": diff,
            "err_candidate": err_c, "err_loop": err_l, "ok": ok, "candidate_ms": candidate_ms,
            "loop_ms": loop_ms, "speedup": loop_ms / candidate_ms if candidate_ms else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.gpu.varlen_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="the results go here")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke (module docstring)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per row (16,384; smoke 256)")
    args = p.parse_args(argv)
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device (--smoke runs on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens or (16384 if cuda else 256)
    head_dim = 128 if cuda else 16
    results = []
    for case in CASES if cuda else SMOKE_CASES:
        res = run_case(case, tokens, head_dim, device, dtype, cuda)
        print(json.dumps(res), flush=True)
        results.append(res)
    data = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
            "torch": torch.__version__, "smoke": args.smoke, "results": results}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
