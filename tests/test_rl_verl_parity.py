"""Policy losses, REINFORCE++ estimators and rollout correction against verl's published code.

The `verl_*` functions below are a compact transcription of verl's formulas (volcengine/verl,
verl/trainer/ppo/core_algos.py: agg_loss, compute_policy_loss_vanilla / _gspo / _geo_mean /
_cispo / _sapo, compute_reinforce_plus_plus[_baseline]_outcome_advantage; verl/trainer/ppo/
rollout_corr_helper.py: compute_rollout_correction_weights, compute_rollout_rejection_mask,
compute_offpolicy_metrics; verl/utils/torch_functional.py: masked_mean / masked_whiten), read
in verl 0.9.1 (verl is not a dependency). Every loss is compared in value AND gradient on
identical random inputs for every aggregation mode, through this engine's GlobalLossNormalizer
weights. Where verl 0.9.1 aggregates:
- with the configured loss_agg_mode: ppo_clip (vanilla), gspo and cispo; all five modes agree
  with ours, seq-mean-token-sum-norm included: verl divides the sequence sum by S x H
  (global_batch_size x loss_scale_factor), as ours does (the snapshot b178a3cd5, Jan 2026,
  forced seq-mean-token-mean on gspo and divided seq-mean-token-sum-norm by H only; 0.9.1 does
  neither);
- with a fixed aggregation whatever loss_agg_mode says: sapo (seq-mean-token-mean) and geo_mean
  (torch.mean over sequences). Here loss.agg_mode applies (by design), so those two are verl's
  numbers in seq-mean-token-mean; in the other modes they are checked against verl's per-token
  / per-sequence losses aggregated by that mode, and shown to differ from verl's fixed number.
"""
from types import SimpleNamespace

import pytest
import torch

from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.algo.policy_loss import PolicyLossContext
from engine.rl.algo.policy_loss_variants import POLICY_LOSSES
from engine.rl.algo.seq_reduce import SequenceReducer
from engine.training.loss import AGG_MODES, aggregate, weights_from_counts

B, T, H = 6, 12, 16.0
SETTINGS = SimpleNamespace(eps_low=0.2, eps_high=0.28, dual_c=3.0, tau_pos=1.0, tau_neg=1.05)


# ------------------------------------------------------------ verl transcription (see above)
def v_mean(x, m, axis=None):
    return (x * m).sum() / (m.sum() + 1e-8) if axis is None else \
        (x * m).sum(axis) / (m.sum(axis) + 1e-8)


def v_agg(l, m, mode, n_tokens, n_seqs):  # agg_loss with global batch info, dp_size 1
    if mode == "token-mean":
        return (l * m).sum() / n_tokens
    if mode == "token-sum":
        return (l * m).sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (l * m).sum(-1)[m.sum(-1) > 0].sum() / n_seqs  # n_seqs: global_batch_size
        return loss / H if mode == "seq-mean-token-sum-norm" else loss  # H: loss_scale_factor
    per = (l * m).sum(-1) / (m.sum(-1) + 1e-8)  # seq-mean-token-mean
    return per[m.sum(-1) > 0].sum() / n_seqs


# verl 0.9.1's aggregation of each loss: None = the configured loss_agg_mode
VERL_FIXED_AGG = {"ppo_clip": None, "gspo": None, "cispo": None,
                  "sapo": "seq-mean-token-mean", "geo_mean": "mean over sequences"}


def v_vanilla(old, lp, a, m, w):
    ratio = torch.exp((lp - old).clamp(-20, 20))
    l1, l2 = -a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28)
    c1 = torch.maximum(l1, l2)
    return torch.where(a < 0, torch.min(-a * 3.0, c1), c1) * (w if w is not None else 1)


def v_gspo(old, lp, a, m, w):
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    s = torch.exp((lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
    return torch.maximum(-a * s, -a * s.clamp(1 - 0.2, 1 + 0.28)) * (w if w is not None else 1)


def v_geo_mean_seq(old, lp, a, m, w):  # per-sequence losses; verl returns their torch.mean
    d, sgn = lp - old, torch.sign(a)
    c = sgn * torch.min(sgn * d, sgn * d.clamp(-0.2, 0.28))
    n = m.sum(-1)
    pg = -((a * m).sum(-1) / (n + 1e-8)) * torch.exp((c * m).sum(-1) / (n + 1e-8))
    if w is not None:
        pg = pg * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    return pg


def v_cispo(old, lp, a, m, w):
    r = torch.exp((lp - old).clamp(-20, 20))
    return -r.clamp(1 - 0.2, 1 + 0.28).detach() * a * lp * (w if w is not None else 1)


def v_sapo(old, lp, a, m, w):
    r = torch.exp((lp - old).clamp(-20, 20))
    tau = torch.where(a > 0, torch.tensor(1.0), torch.tensor(1.05))
    return -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * a * (w if w is not None else 1)


def v_whiten(x, m):
    mean = v_mean(x, m)
    var = v_mean((x - mean) ** 2, m) * m.sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def v_rfpp(rewards_tok, m, index=None):
    if index is None:  # returns with gamma 1 over the trained tokens (0.9.1: an untrained
        ret, run = torch.zeros_like(rewards_tok), 0  # position passes the running return on)
        for t in reversed(range(rewards_tok.shape[1])):
            new = rewards_tok[:, t] + run
            ret[:, t] = new * m[:, t]
            run = new * m[:, t] + run * (1 - m[:, t])
        return v_whiten(ret, m) * m
    scores = rewards_tok.sum(-1)
    for g in set(index):
        rows = [i for i, x in enumerate(index) if x == g]
        if len(rows) > 1:
            scores[rows] = scores[rows] - scores[rows].mean()
    return v_whiten(scores.unsqueeze(-1) * m, m) * m
# --------------------------------------------------------------------- end of transcription


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 3, 7, 1, 10, 5])
    starts = torch.tensor([0, 2, 1, 4, 0, 3])
    pos = torch.arange(T)
    m = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).float()
    lp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.5, 0.7])[:, None].expand(B, T).clone()
    w = torch.exp(0.4 * torch.randn(B, T, generator=g)).clamp(max=2.0) * m
    return lp, old, adv, m, w


def _ours(name, lp, old, adv, m, w, mode, rows=None):
    rows = list(range(B)) if rows is None else rows
    counts = m.sum(-1)
    weights = weights_from_counts(counts, float(counts.sum()), float(B), mode, H)
    sub = lambda x: x[rows] if x is not None else None  # noqa: E731
    ids = torch.tensor(rows)[:, None].expand(len(rows), T).clone()
    ctx = PolicyLossContext(sub(m), SequenceReducer(ids - min(rows), sub(m)), sub(w))
    terms = POLICY_LOSSES[name](lp[rows], old[rows], adv[rows], SETTINGS, ctx)
    return aggregate(terms.loss, weights[rows, None].float() * m[rows])


def _verl(name, lp, old, adv, m, w, mode, fixed=True):
    """verl 0.9.1's loss with loss_agg_mode=`mode`; `fixed` False: the losses of sapo /
    geo_mean aggregated by `mode` instead of verl's fixed aggregation (this engine's rule)."""
    n_tok, n_seq = m.sum(), float(B)
    if name == "geo_mean":  # L_i on each token: seq-mean-token-mean = verl's torch.mean(L_i)
        seq = v_geo_mean_seq(old, lp, adv, m, w)
        if fixed:
            return seq.mean()
        return v_agg(seq[:, None].expand(B, T), m, mode, n_tok, n_seq)
    fn = {"ppo_clip": v_vanilla, "gspo": v_gspo, "cispo": v_cispo, "sapo": v_sapo}[name]
    agg = VERL_FIXED_AGG[name] if fixed and VERL_FIXED_AGG[name] else mode
    return v_agg(fn(old, lp, adv, m, w), m, agg, n_tok, n_seq)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "geo_mean", "cispo", "sapo"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("with_is", [False, True])
def test_policy_loss_matches_verl_value_and_gradient(name, mode, with_is):
    lp, old, adv, m, w = _inputs()
    w = w if with_is else None
    ours = _ours(name, lp, old, adv, m, w, mode)
    (g_ours,) = torch.autograd.grad(ours, lp)
    verl_agrees = VERL_FIXED_AGG[name] is None or mode == "seq-mean-token-mean"
    ref = _verl(name, lp, old, adv, m, w, mode, fixed=verl_agrees)
    if not verl_agrees:  # by design: loss.agg_mode applies; verl's fixed aggregation differs
        verl = _verl(name, lp, old, adv, m, w, mode)
        assert abs(float(verl - ref)) > 1e-4 * abs(float(verl)), (name, mode)
    (g_ref,) = torch.autograd.grad(ref, lp)
    assert abs(float(ref)) > 1e-3 and float(g_ref.abs().max()) > 1e-4
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["gspo", "geo_mean"])
def test_sequence_losses_are_exact_over_micro_batches(name):
    """Micro-batches of whole sequences sum to the whole batch's loss; a per-shard sequence
    ratio (the classic bug, here: a sequence cut in two halves) does not."""
    lp, old, adv, m, w = _inputs(1)
    mode = "token-mean"
    whole = _ours(name, lp, old, adv, m, None, mode)
    parts = _ours(name, lp, old, adv, m, None, mode, [0, 3]) + \
        _ours(name, lp, old, adv, m, None, mode, [1, 2, 4, 5])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=2e-7)  # float32 sums
    halves = torch.zeros_like(m)
    halves[:, T // 2:] = 1  # shard-local "sequences": first and second half of each row
    counts = m.sum(-1)
    weights = weights_from_counts(counts, float(counts.sum()), float(B), mode, H)
    ids = torch.arange(B)[:, None] * 2 + halves.long()
    ctx = PolicyLossContext(m, SequenceReducer(ids, m), None)
    cut = aggregate(POLICY_LOSSES[name](lp, old, adv, SETTINGS, ctx).loss,
                    weights[:, None].float() * m)
    assert abs(float(cut - whole)) > 1e-4 * abs(float(whole))


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_matches_verl(name):
    _, _, _, m, _ = _inputs()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    last = (m * torch.arange(T)).argmax(-1)
    tok = torch.zeros(B, T)
    tok[torch.arange(B), last] = rewards
    index = [0, 0, 1, 1, 2, 2]
    ref = v_rfpp(tok, m, index if name.endswith("baseline") else None)
    ours = ADVANTAGE_ESTIMATORS[name](rewards, 2, None, m.sum(-1))
    torch.testing.assert_close(ours[:, None] * m, ref, rtol=1e-5, atol=1e-6)
    # the negative control: whitening each half of the batch on its own differs
    halves = torch.cat([ADVANTAGE_ESTIMATORS[name](rewards[:4], 2, None, m.sum(-1)[:4]),
                        ADVANTAGE_ESTIMATORS[name](rewards[4:], 2, None, m.sum(-1)[4:])])
    assert float((halves - ours).abs().max()) > 1e-2
