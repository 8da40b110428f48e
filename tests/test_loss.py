"""GlobalLossNormalizer: the five aggregation modes against hand-computed values, the seeds'
example (100 tokens at 0.5 and 900 at 0.3 -> 0.32), and split invariance of the weighted sum."""
import math

import pytest
import torch

from engine.training.loss import AGG_MODES, GlobalLossNormalizer, aggregate, weights_from_counts


def _token_losses(lengths, masks_on, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    masks = [torch.tensor([1.0] * k + [0.0] * (n - k), dtype=torch.float64)
             for n, k in zip(lengths, masks_on)]
    return losses, masks


def _reference(mode, losses, masks, horizon, count_empty=True):
    sums = [float((l * m).sum()) for l, m in zip(losses, masks)]
    counts = [float(m.sum()) for m in masks]
    n_total = sum(counts)
    s = len(sums) if count_empty else sum(1 for c in counts if c > 0)
    if mode == "token-mean":
        return sum(sums) / n_total
    if mode == "token-sum":
        return sum(sums)
    if mode == "seq-mean-token-sum":
        return sum(sums) / s
    if mode == "seq-mean-token-mean":
        return sum(x / c for x, c in zip(sums, counts) if c > 0) / s
    return sum(sums) / (s * horizon)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("count_empty", [True, False])
def test_modes_match_formulas_for_any_split(mode, count_empty):
    lengths, on = [5, 9, 3, 7, 4, 6], [5, 2, 0, 7, 1, 3]
    losses, masks = _token_losses(lengths, on)
    expected = _reference(mode, losses, masks, horizon=12, count_empty=count_empty)
    norm = GlobalLossNormalizer(mode, horizon=12, count_empty_sequences=count_empty)
    counts = torch.tensor(on)
    w = norm.sequence_weights(counts)
    # split the sequences into micro-batches in two different ways: the sum must not change
    for split in ([[0, 1, 2, 3, 4, 5]], [[0], [1, 2], [3, 4, 5]], [[5, 3], [1], [0, 2, 4]]):
        total = 0.0
        for mb in split:
            for i in mb:
                total += float(aggregate(losses[i], masks[i] * w[i]))
        assert math.isclose(total, expected, rel_tol=1e-6), (mode, split, total, expected)


def test_seed_example_token_mean_is_0_32_not_mean_of_means():
    # two micro-batches: 100 tokens at loss 0.5, 900 tokens at loss 0.3
    losses = [torch.full((100,), 0.5), torch.full((900,), 0.3)]
    masks = [torch.ones(100), torch.ones(900)]
    w = GlobalLossNormalizer("token-mean").sequence_weights(torch.tensor([100, 900]))
    total = sum(float(aggregate(l, m * wi)) for l, m, wi in zip(losses, masks, w))
    assert total == pytest.approx(0.32, abs=1e-6)
    mean_of_means = (0.5 + 0.3) / 2
    assert mean_of_means == pytest.approx(0.4)
    assert abs(total - mean_of_means) > 0.05


def test_empty_batch_gives_zero_weights_not_nan():
    for mode in AGG_MODES:
        w = weights_from_counts(torch.tensor([0, 0]), 0.0, 0.0, mode, 8)
        assert torch.isfinite(w).all(), mode
        if mode != "token-sum":  # token-sum weighs every sequence 1; masks are 0 anyway
            assert torch.all(w == 0), mode


def test_unknown_mode_lists_choices():
    with pytest.raises(ValueError) as e:
        GlobalLossNormalizer("mean")
    for mode in AGG_MODES:
        assert mode in str(e.value)


def test_norm_mode_needs_horizon():
    with pytest.raises(ValueError, match="horizon"):
        GlobalLossNormalizer("seq-mean-token-sum-norm").sequence_weights(torch.tensor([3]))
