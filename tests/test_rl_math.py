"""GRPO / DAPO math against hand-computed values: group advantages, clipped surrogate with clip
higher and dual clip, KL estimators, entropy, overlong punishment, dynamic sampling."""
from __future__ import annotations

import math

import pytest
import torch

from engine.rl.algo.advantages import group_advantages, zero_std_groups
from engine.rl.algo.dynamic_sampling import DynamicSampler, keep_groups_with_signal
from engine.rl.algo.overlong import overlong_penalty
from engine.rl.algo.policy_loss import clipped_surrogate, kl_penalty

# ----------------------------------------------------------------------------- advantages

# Two groups of 4, group-major.
# Group 0: [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sample var = 4 * 0.25 / 3 = 1/3,
#          std = 0.57735, A = +-0.5 / 0.57735 = +-0.8660254 (= sqrt(3)/2).
# Group 1: [0, 0, 0, 1]: mean 0.25, deviations -0.25 x3, 0.75; sum of squares 0.75,
#          sample var 0.25, std 0.5, A = [-0.5, -0.5, -0.5, 1.5].
#          (The population std sqrt(0.1875) = 0.4330 would give -0.5774 / 1.7321 instead.)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
H = math.sqrt(3) / 2


def test_group_advantages_hand_values():
    adv = group_advantages(REWARDS, group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([H, -H, -H, H, -0.5, -0.5, -0.5, 1.5]))
    # default eps = 1e-6 shifts values by ~1e-6 relative only
    adv_eps = group_advantages(REWARDS, group_size=4)
    torch.testing.assert_close(adv_eps, adv, rtol=1e-5, atol=1e-5)
    assert adv_eps[7] < 1.5  # eps is in the denominator


def test_dr_grpo_does_not_divide_by_std():
    adv = group_advantages(REWARDS, group_size=4, norm_by_std=False)
    torch.testing.assert_close(
        adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75]))


def test_group_layout_is_group_major():
    # the same rewards read as 2 groups of 4 vs 4 groups of 2 give different advantages
    adv2 = group_advantages(REWARDS, group_size=2, norm_by_std=False)
    torch.testing.assert_close(adv2, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, -0.5, 0.5]))


def test_zero_std_group_gives_exact_zeros():
    # 0.9 is not exact in binary: in float32 the mean of [0.9] * 3 differs from 0.9 by an ulp
    # and the std is ~1e-7, so a naive (r - mean) / (std + eps) gives ~0.056, not 0.
    # Our result must be exactly 0, never NaN.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5], dtype=torch.float32)
    adv = group_advantages(rewards, group_size=3)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:6], torch.zeros(6))
    torch.testing.assert_close(adv[6:], torch.tensor([-1.0, 1.0, 0.0]), atol=1e-5, rtol=1e-5)
    assert zero_std_groups(rewards, 3).tolist() == [True, True, False]
    # group size 1: sample std undefined -> 0 advantages, not NaN
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    # integer rewards are accepted and give float advantages
    adv_int = group_advantages(torch.tensor([1, 0, 0, 1, 0, 0, 0, 1]), 4, norm_by_std=False)
    assert adv_int.dtype == torch.float32 and adv_int[7].item() == 0.75


def test_advantage_input_validation():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


# ----------------------------------------------------------------------------- surrogate

EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0
# ratio, advantage, loss without dual clip, loss with dual clip (c=3), branch
SURROGATE_TABLE = [
    (1.1, 1.0, -1.1, -1.1, "inside"),
    (1.5, 1.0, -1.28, -1.28, "high"),          # -min(1.5, 1.28)
    (0.5, 1.0, -0.5, -0.5, "inside"),          # A > 0: low ratio is not clipped
    (0.5, -1.0, 0.8, 0.8, "low"),              # -min(-0.5, -0.8)
    (1.5, -1.0, 1.5, 1.5, "inside"),           # A < 0: high ratio not clipped, 1.5 < c
    (4.0, -1.0, 4.0, 3.0, "dual"),             # capped at c*|A| = 3
    (4.0, 2.0, -2.56, -2.56, "high"),          # -min(8, 1.28*2)
    (0.9, -2.0, 1.8, 1.8, "inside"),
    (2.0, 0.0, 0.0, 0.0, "inside"),
    (0.7, -0.5, 0.4, 0.4, "low"),              # -min(-0.35, -0.8*0.5)
]
# d loss / d logprob = -A * ratio on the unclipped branch, 0 where a clip is selected
GRADS = [-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 0.0, 1.8, 0.0, 0.0]


def _surrogate_inputs():
    ratio = torch.tensor([row[0] for row in SURROGATE_TABLE], dtype=torch.float64)
    adv = torch.tensor([row[1] for row in SURROGATE_TABLE], dtype=torch.float64)
    old = torch.linspace(-3.0, -0.1, len(SURROGATE_TABLE), dtype=torch.float64)
    logprobs = (old + ratio.log()).requires_grad_(True)
    return logprobs, old, adv


@pytest.mark.parametrize("dual", [False, True])
def test_clipped_surrogate_table(dual):
    logprobs, old, adv = _surrogate_inputs()
    terms = clipped_surrogate(logprobs, old, adv, EPS_LOW, EPS_HIGH,
                              dual_c=DUAL_C if dual else None)
    expected = torch.tensor([row[3 if dual else 2] for row in SURROGATE_TABLE],
                            dtype=torch.float64)
    torch.testing.assert_close(terms.loss.detach(), expected)
    torch.testing.assert_close(terms.ratio, torch.tensor([r[0] for r in SURROGATE_TABLE],
                                                         dtype=torch.float64))
    branch = [row[4] for row in SURROGATE_TABLE]
    assert terms.clipped_low.tolist() == [float(b == "low") for b in branch]
    assert terms.clipped_high.tolist() == [float(b == "high") for b in branch]
    assert terms.dual_clipped.tolist() == [float(b == "dual" and dual) for b in branch]
    assert terms.clipped_low.mean().item() == pytest.approx(0.2)
    assert terms.clipped_high.mean().item() == pytest.approx(0.2)
    assert terms.dual_clipped.mean().item() == pytest.approx(0.1 if dual else 0.0)

    terms.loss.sum().backward()
    grads = list(GRADS)
    if not dual:
        grads[5] = 4.0  # unclipped: -A * ratio = 4
    torch.testing.assert_close(logprobs.grad, torch.tensor(grads, dtype=torch.float64))


def test_clipped_surrogate_shapes_and_extremes():
    logprobs = torch.zeros(2, 3)
    old = torch.tensor([[0.0, -200.0, 0.0], [0.0, 0.0, 0.0]])  # log ratio 200 on a masked token
    adv = torch.tensor([[0.0, 0.0, 1.0], [-1.0, -1.0, -1.0]])
    terms = clipped_surrogate(logprobs, old, adv, 0.2, 0.2)
    assert terms.loss.shape == (2, 3)
    assert torch.isfinite(terms.loss).all()  # no inf * 0 = NaN
    assert terms.loss[0, 1].item() == 0.0
    with pytest.raises(ValueError, match="same shape"):
        clipped_surrogate(torch.zeros(3), torch.zeros(3), torch.zeros(1), 0.2, 0.2)
    with pytest.raises(ValueError, match="dual_c"):
        clipped_surrogate(torch.zeros(3), torch.zeros(3), torch.zeros(3), 0.2, 0.2, dual_c=1.0)


# ----------------------------------------------------------------------------- KL

def test_kl_estimators_at_specific_values():
    logp = torch.tensor([-1.0, -1.5, -0.7], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.7], dtype=torch.float64)  # d = +0.5, -0.5, 0
    k1 = kl_penalty(logp, ref, "k1")
    k2 = kl_penalty(logp, ref, "k2")
    k3 = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k1, torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(k2, torch.tensor([0.125, 0.125, 0.0], dtype=torch.float64))
    # exp(-0.5) + 0.5 - 1 and exp(0.5) - 0.5 - 1
    torch.testing.assert_close(
        k3, torch.tensor([0.1065306597126334, 0.1487212707001282, 0.0], dtype=torch.float64))


def test_k1_and_k3_are_unbiased_and_k3_nonnegative():
    # exact expectation over a categorical: E_{x~p}[k(x)] must equal KL(p || ref) for k1, k3
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, generator=gen, dtype=torch.float64) * 2, dim=0)
    ref = torch.log_softmax(torch.randn(50, generator=gen, dtype=torch.float64) * 2, dim=0)
    p = logp.exp()
    kl = (p * (logp - ref)).sum()
    for estimator in ("k1", "k3"):
        torch.testing.assert_close((p * kl_penalty(logp, ref, estimator)).sum(), kl)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k1") < 0).any()  # k1 is not pointwise >= 0
    # k2 is biased: its expectation differs from the KL here
    assert abs((p * kl_penalty(logp, ref, "k2")).sum().item() - kl.item()) > 1e-3


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


# ----------------------------------------------------------------------------- DAPO

def test_overlong_penalty_values():
    lengths = torch.tensor([0, 80, 81, 90, 95, 100, 110])
    out = overlong_penalty(lengths, max_len=100, buffer=20)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.05, -0.5, -0.75, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_len=100, buffer=20, penalty=0.5)
    torch.testing.assert_close(half, out * 0.5)
    step = overlong_penalty(torch.tensor([99, 100, 101]), max_len=100, buffer=0)
    torch.testing.assert_close(step, torch.tensor([0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=10, buffer=20)


def test_keep_groups_with_signal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert keep_groups_with_signal(rewards, 2).tolist() == [False, True, False]


def _gen_batch(tag: str, rewards: list[float]) -> tuple[dict, torch.Tensor]:
    n = len(rewards)
    batch = {
        "id": [f"{tag}{i}" for i in range(n)],
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "tokens": [torch.arange(i + 1) for i in range(n)],  # ragged: a list
    }
    return batch, torch.tensor(rewards, dtype=torch.float32)


def test_dynamic_sampler_filters_and_needs_second_batch():
    sampler = DynamicSampler(group_size=2, target_groups=3, max_gen_batches=4)
    assert sampler.needs_more()
    # groups: (1,1) no signal, (0,1) kept, (0,0) no signal, (1,0) kept
    assert sampler.add(*_gen_batch("a", [1, 1, 0, 1, 0, 0, 1, 0])) == 2
    assert sampler.needs_more() and not sampler.is_full()
    with pytest.raises(RuntimeError, match="needs_more"):
        sampler.result()
    # groups: (0,0) no, (1,0) kept, (0,1) kept -> 4 kept, the 4th is surplus
    assert sampler.add(*_gen_batch("b", [0, 0, 1, 0, 0, 1])) == 2
    assert sampler.is_full() and not sampler.needs_more()
    out = sampler.result()
    assert out["id"] == ["a2", "a3", "a6", "a7", "b2", "b3"]
    torch.testing.assert_close(out["reward"], torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0]))
    assert [t.numel() for t in out["tokens"]] == [3, 4, 7, 8, 3, 4]
    assert sampler.stats() == {
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/groups_generated": 7.0,
        "dynamic_sampling/groups_with_signal": 4.0,
        "dynamic_sampling/signal_fraction": 4 / 7,
    }


def test_dynamic_sampler_budget_exhausted():
    strict = DynamicSampler(group_size=2, target_groups=3, max_gen_batches=1)
    strict.add(*_gen_batch("a", [1, 1, 0, 1]))
    assert not strict.needs_more()
    with pytest.raises(RuntimeError, match="only 1 of 3 groups"):
        strict.result()
    with pytest.raises(RuntimeError, match="max_gen_batches"):
        strict.add(*_gen_batch("b", [0, 1]))

    partial = DynamicSampler(group_size=2, target_groups=3, max_gen_batches=1,
                             allow_partial=True)
    partial.add(*_gen_batch("a", [1, 1, 0, 1]))
    assert partial.result()["id"] == ["a2", "a3"]

    empty = DynamicSampler(group_size=2, target_groups=1, max_gen_batches=1, allow_partial=True)
    empty.add(*_gen_batch("a", [1, 1, 0, 0]))
    with pytest.raises(RuntimeError, match="only 0 of 1"):
        empty.result()


def test_dynamic_sampler_rejects_inconsistent_batches():
    sampler = DynamicSampler(group_size=2, target_groups=2, max_gen_batches=3)
    batch, rewards = _gen_batch("a", [0, 1])
    with pytest.raises(ValueError, match="rows"):
        sampler.add(batch, torch.tensor([0.0, 1.0, 1.0, 1.0]))
    sampler.add(batch, rewards)
    other = dict(batch, reward=torch.zeros(2, 3))  # trailing shape changed
    with pytest.raises(ValueError, match="layout"):
        sampler.add(other, rewards)
