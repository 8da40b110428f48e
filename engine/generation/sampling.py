"""Seeded next-token sampling for a whole batch in a few tensor ops (the HF backend's sampler).

Every row b of a generate call has its own 63-bit seed s_b (SamplingParams.seeds, else derived
from SamplingParams.seed and the row index, else fresh randomness). At decode step t the row
draws ONE uniform u(s_b, t) in (0, 1), a counter-based hash of (s_b, t) only, and takes the
token by inverse CDF: the first vocabulary index i with cdf_b[i] > u * cdf_b[V-1], where cdf_b
is the float64 running sum of the row's (temperature-scaled, top-p filtered) probabilities. A
row's tokens therefore depend on its seed, its own logits and the step only: never on the other
rows of the call, the batch size or the engine count; and no per-row torch.Generator is needed
(one Generator per row cost one multinomial call per row per step). A row may start at step
first_steps[b] > 0 (SamplingParams.first_steps): a reply cut after k tokens and continued from
prompt + its k tokens draws u(s_b, k), u(s_b, k + 1), ..., the numbers it would have drawn
uninterrupted (rollout.partial).

The hash: two 32-bit lanes (low and high half of the seed) mixed with the step by
`lowbias32` (Chris Wellons' 32-bit integer hash, a bijection), all in int64 tensors whose
products stay below 2**63 (no overflow; identical on CPU and CUDA); the two lane hashes make a
53-bit uniform. Uniforms are made for STEP_CHUNK steps at a time ([B, STEP_CHUNK] float64).
"""
from __future__ import annotations

import hashlib
import secrets

import torch

from engine.generation.processing import row_stops, shape

MASK32 = 0xFFFFFFFF
STEP_CHUNK = 64


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a 32-bit constant c, exact: the constant
    is split in 16-bit halves so no product reaches 2**63."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in [0, 2**32) (elementwise; result in the same range)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_seeds(params, batch: int) -> list[int]:
    """The 63-bit seed of every row: params.seeds, else one derived from params.seed and the
    row index (blake2b), else fresh randomness (secrets)."""
    if params.seeds is not None:
        return [int(s) for s in params.seeds]
    if params.seed is None:
        return [secrets.randbits(63) for _ in range(batch)]
    return [int.from_bytes(hashlib.blake2b(f"{params.seed}/{i}".encode(), digest_size=8)
                           .digest(), "little") >> 1 for i in range(batch)]


def uniforms(seeds: torch.Tensor, first_step: int, steps: int,
             offsets: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [B, steps] in (0, 1): column j is u(seed_b, offsets_b + first_step + j). `seeds`
    is int64 [B] of non-negative 63-bit seeds (any device); `offsets` int64 [B] (None: 0)."""
    seeds = seeds.to(torch.int64)
    lo, hi = (seeds & MASK32)[:, None], (seeds >> 32)[:, None]
    t = torch.arange(first_step, first_step + steps, dtype=torch.int64,
                     device=seeds.device)[None, :]
    if offsets is not None:
        t = t + offsets.to(device=seeds.device, dtype=torch.int64)[:, None]
    a = hash32(hash32(lo ^ 0x243F6A88) ^ hash32(t & MASK32))
    b = hash32(hash32(hi ^ 0x85A308D3) ^ hash32((t ^ 0x13198A2E) & MASK32) ^ a)
    a = hash32(a ^ b)
    bits = (a >> 5) * (1 << 26) + (b >> 6)  # 27 + 26 = 53 bits
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)


class SeededSampler:
    """The sampler of one generate call: `sample(logits, step)` for step 0, 1, ... in order.

    Args:
        params: SamplingParams (temperature, top_p, seed / seeds, first_steps: row b's step
            `step` draws u(seed_b, first_steps[b] + step), the continuation of a cut reply;
            sampling: vLLM's sampling fields per row, engine.generation.processing).
        batch: rows of the call.
        device: where the logits live.
        prompts: the rows' prompt ids (needed when params.sampling is given: the repetition
            penalty reads them).
        eos_ids: the engine's end-of-sequence ids (min_tokens masks them; `stops`).
    """

    def __init__(self, params, batch: int, device: torch.device,
                 prompts: list[list[int]] | None = None, eos_ids=()) -> None:
        self.params = params
        self.seeds = torch.tensor(row_seeds(params, batch), dtype=torch.int64, device=device)
        first = getattr(params, "first_steps", None)
        self.offsets = (None if first is None else
                        torch.tensor([int(f) for f in first], dtype=torch.int64, device=device))
        self._chunk_start, self._chunk = -1, None
        self.fields = getattr(params, "sampling", None)
        if self.fields is not None and prompts is None:
            raise ValueError("SamplingParams.sampling needs the rows' prompts")
        self.prompts, self.eos_ids = prompts, tuple(eos_ids)
        self.outputs: list[list[int]] = [[] for _ in range(batch)]
        # the ids that end each row (processing.row_stops)
        self.stops = row_stops(self.fields, self.eos_ids, batch)

    def _uniform(self, step: int) -> torch.Tensor:
        start = step - step % STEP_CHUNK
        if start != self._chunk_start:
            self._chunk_start, self._chunk = start, uniforms(self.seeds, start, STEP_CHUNK,
                                                             self.offsets)
        return self._chunk[:, step - start]

    def sample(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Next tokens [B] (int64) and their log-probs [B] from fp32 logits [B, V] at decode
        step `step` (`draw` with this call's temperature, top_p, uniforms and, with
        params.sampling, the rows' shaping over their prompts and ids sampled so far)."""
        p = self.params
        shaping = shape(logits, self.fields, self.prompts, self.outputs, self.eos_ids)
        token, logprob = draw(logits, p.temperature, p.top_p,
                              None if p.temperature == 0 else self._uniform(step), shaping)
        if self.fields is not None:
            for row, t in zip(self.outputs, token.tolist()):
                row.append(t)
        return token, logprob

    def stopped(self, token: torch.Tensor) -> torch.Tensor:
        """bool [B]: the sampled `token` [B] ends its row (one of the row's stop ids)."""
        if self.fields is None:
            return torch.isin(token, torch.tensor(self.eos_ids, device=token.device))
        return torch.tensor([t in s for t, s in zip(token.tolist(), self.stops)],
                            device=token.device)


def draw(logits: torch.Tensor, temperature: float, top_p: float,
         u: torch.Tensor | None, shaping=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] (int64) and their log-probs [B] from fp32 logits [B, V] and one uniform
    per row `u` [B] (None when greedy): log_softmax(logits / T)[token] (log_softmax(logits)
    when greedy, T = 0: the argmax), per the log-probability contract of
    engine.generation.base; top-p only restricts the draw (inverse CDF at u). `shaping`
    (engine.generation.processing.Shaping of these rows, vLLM's sampling fields; None: none)
    changes which token is drawn (greedy: the argmax of its logits; else its probabilities
    before top-p), never the log-probs. Row-wise: a row's result does not depend on the other
    rows."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = (logits if shaping is None else shaping.logits).argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp() if shaping is None else shaping.probs(temperature)
    if top_p < 1.0:  # keep the smallest prefix of sorted tokens reaching top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    token = inverse_cdf(probs, u)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index i with cdf[i] > u * cdf[-1] (cdf: float64 cumulative sum of
    the non-negative, not necessarily normalised `probs` [B, V]; `u` [B] in (0, 1)). A token
    of probability 0 is never returned; if rounding puts the target at the total, the last
    token with positive probability is taken."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    token = torch.searchsorted(cdf, u[:, None].to(cdf.device) * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # first index reaching the total
    return torch.where(token >= probs.shape[-1], last, token).squeeze(-1)
