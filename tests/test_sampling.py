"""The HF backend's vectorized seeded sampler (engine.generation.sampling): the counter-based
hash against a scalar Python reference, uniformity and independence of its uniforms, sampled
frequencies against the closed-form softmax (temperature, top-p), row independence from the
batch, greedy and the reported log-probs."""
from __future__ import annotations

import pytest
import torch

from engine.generation import SamplingParams
from engine.generation.sampling import SeededSampler, hash32, inverse_cdf, uniforms


def lowbias32(x: int) -> int:
    """Scalar reference of the hash (plain Python integers, mod 2**32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_the_scalar_reference_without_overflow():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    got = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [lowbias32(x) for x in xs]
    assert all(0 <= v < 2 ** 32 for v in got)


def test_uniforms_are_uniform_and_uncorrelated():
    seeds = torch.arange(4000, dtype=torch.int64) * 0x9E3779B97F4A7C15 % (2 ** 63)
    u = uniforms(seeds, 0, 64)                      # 256000 draws
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.003        # sd of the mean ~ 0.00057
    assert abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u.float(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 50                                 # 15 dof: p(chi2 > 50) ~ 1e-5
    x = u - 0.5
    for a, b in ((x[:, 1:], x[:, :-1]), (x[1:], x[:-1])):   # next step, next seed
        corr = float((a * b).mean() / (x * x).mean())
        assert abs(corr) < 0.01
    # a seed's uniforms do not depend on the chunk they were made in
    assert torch.equal(uniforms(seeds[:3], 10, 5), u[:3, 10:15])
    # seeds differing only in the high 31 bits differ
    assert not torch.equal(uniforms(torch.tensor([5]), 0, 8),
                           uniforms(torch.tensor([5 + (1 << 40)]), 0, 8))


def _frequencies(logits: torch.Tensor, params: SamplingParams, rows: int) -> torch.Tensor:
    params.seeds = list(range(1000, 1000 + rows))
    sampler = SeededSampler(params, rows, torch.device("cpu"))
    token, logprob = sampler.sample(logits.expand(rows, -1).clone(), 0)
    scale = params.temperature or 1.0
    ref = torch.log_softmax(logits / scale, dim=-1)[0]
    assert torch.allclose(logprob, ref[token])      # the sampled token's log-prob
    return torch.bincount(token, minlength=logits.shape[-1]).double() / rows


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_frequencies_match_the_softmax(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    rows = 40000
    freq = _frequencies(logits, SamplingParams(max_new_tokens=1, temperature=temperature), rows)
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    sd = (probs * (1 - probs) / rows).sqrt()
    assert bool(((freq - probs).abs() <= 5 * sd + 1e-4).all()), (freq, probs)


def test_top_p_draws_only_from_the_nucleus_in_proportion():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]])
    probs = torch.softmax(logits[0].double(), dim=-1)
    top_p = 0.8   # sorted mass before token 2 is p0 + p1 < 0.8: tokens 0, 1, 2 kept
    kept = torch.cumsum(probs, 0) - probs < top_p
    assert kept.tolist() == [True, True, True, False, False, False]
    rows = 30000
    freq = _frequencies(logits, SamplingParams(max_new_tokens=1, top_p=top_p), rows)
    target = torch.where(kept, probs, torch.zeros_like(probs))
    target = target / target.sum()
    assert float(freq[~kept].sum()) == 0.0
    sd = (target * (1 - target) / rows).sqrt()
    assert bool(((freq - target).abs() <= 5 * sd + 1e-4).all())


def test_a_row_samples_the_same_alone_and_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    params = SamplingParams(max_new_tokens=4, seeds=[11, 22, 33, 44, 55, 66])
    whole = SeededSampler(params, 6, torch.device("cpu"))
    for step in range(70):  # crosses a uniform chunk boundary
        batch_tokens, _ = whole.sample(logits, step)
        for i in (0, 3, 5):
            alone = SeededSampler(SamplingParams(max_new_tokens=4, seeds=[params.seeds[i]]), 1,
                                  torch.device("cpu"))
            assert int(alone.sample(logits[i:i + 1], step)[0]) == int(batch_tokens[i])
    other = SeededSampler(SamplingParams(max_new_tokens=4, seeds=[12, 22, 33, 44, 55, 66]), 6,
                          torch.device("cpu"))
    draws = [other.sample(logits, s)[0][0] != whole.sample(logits, s)[0][0] for s in range(20)]
    assert any(draws)  # negative control: another seed, other tokens


def test_greedy_takes_the_argmax_and_reports_untempered_logprobs():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    sampler = SeededSampler(SamplingParams(max_new_tokens=1, temperature=0.0), 2,
                            torch.device("cpu"))
    token, logprob = sampler.sample(logits, 0)
    assert token.tolist() == [1, 0]
    assert torch.allclose(logprob, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert inverse_cdf(probs, torch.tensor([1e-12])).tolist() == [1]
    assert inverse_cdf(probs, torch.tensor([0.5])).tolist() == [3]
    assert inverse_cdf(probs, torch.tensor([1.0])).tolist() == [3]  # target at the total


def test_seed_and_no_seed_paths():
    from engine.generation.sampling import row_seeds

    a = row_seeds(SamplingParams(max_new_tokens=1, seed=7), 3)
    assert a == row_seeds(SamplingParams(max_new_tokens=1, seed=7), 3) and len(set(a)) == 3
    assert a != row_seeds(SamplingParams(max_new_tokens=1, seed=8), 3)
    assert row_seeds(SamplingParams(max_new_tokens=1), 2) != row_seeds(
        SamplingParams(max_new_tokens=1), 2)
    assert all(0 <= s < 2 ** 63 for s in a)
