"""rollout_correction (verl's `algorithm.rollout_correction`): IS weights, rejection modes and
metrics against a compact transcription of verl's rollout_corr_helper.py (verl 0.9.1:
compute_rollout_correction_weights, compute_is_metrics, compute_rollout_rejection_mask,
compute_offpolicy_metrics; verl is not a dependency), with the differences by design named
where they apply (is_weight_mean untruncated; sequence averages over sequences with a trained
token); bypass mode skips the old-log-prob forward, and its metrics (clip fractions over kept
tokens, is_weight_max a maximum) come through engine.rl.policy.update.policy_update in process;
the keys are validated at start (exit 2 naming the key)."""
import math
from types import SimpleNamespace

import pytest
import torch

from engine.config.schema import ConfigError, load_config
from engine.rl.algo.rollout_correction import RS_OPTIONS, RolloutCorrectionConfig, apply_to_batch
from engine.rl.checks import rl_problems
from engine.rl.config import RLConfig
from engine.rl.policy.logprob_stage import attach_old_logprobs
from engine.training.micro_batches import SequenceData

B, T = 8, 10


def v_mean(x, m, axis=None):
    return (x * m).sum() / (m.sum() + 1e-8) if axis is None else \
        (x * m).sum(axis) / (m.sum(axis) + 1e-8)


def v_is(lr, m, level, thr, normalize):  # compute_rollout_correction_weights
    if level == "token":
        w = torch.exp(lr.clamp(-20, 20))
    else:
        w = torch.exp((lr * m).sum(-1, keepdim=True).clamp(-20, 20)).expand_as(lr)
    raw = w * m
    w = raw.clamp(max=thr)
    if normalize:
        mean = v_mean(w, m) if level == "token" else \
            v_mean(w, m, -1)[m.sum(-1) > 0].mean()
        w = w / mean
    return w, raw


def v_rs(lr, m, option, lower, upper):  # compute_rollout_rejection_mask, one option
    lr = lr.clamp(-20, 20)
    stat = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}[option[-2:]]
    if option.startswith("seq_sum"):
        stat = (stat * m).sum(-1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = v_mean(stat, m, -1).unsqueeze(-1)
    elif option.startswith("seq_max"):
        stat = stat.masked_fill(m == 0, float("-inf")).max(-1, keepdim=True).values
    if option.endswith("k1"):
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return keep.expand_as(lr).float()


def _batch(seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    seqs, lrs, masks = [], [], []
    for i in range(B):
        head, n = 1 + i % 3, 1 + (3 * i) % 7
        old = (-torch.rand(head + n, generator=g) * 2).tolist()
        roll = (torch.tensor(old) + scale * torch.randn(head + n, generator=g)).tolist()
        mask = [0] * head + [1] * n
        seqs.append(SequenceData([5] * (head + n), [5] * (head + n), mask,
                                 extras={"old_logprobs": old, "rollout_logprobs": roll}))
        lr = torch.zeros(T, dtype=torch.float64)
        lr[:head + n] = torch.tensor(old, dtype=torch.float64) - torch.tensor(roll, dtype=torch.float64)
        mm = torch.zeros(T, dtype=torch.float64)
        mm[:head + n] = torch.tensor(mask, dtype=torch.float64)
        lrs.append(lr), masks.append(mm)
    return seqs, torch.stack(lrs), torch.stack(masks)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_and_metrics_match_verl(level, normalize):
    seqs, lr, m = _batch()
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=1.5,
                                  rollout_is_batch_normalize=normalize)
    metrics = apply_to_batch(seqs, cfg)
    w_ref, raw = v_is(lr, m, level, 1.5, normalize)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        torch.testing.assert_close(torch.tensor(s.extras["rollout_is_weights"], dtype=torch.float64),
                                   w_ref[i, :n], rtol=1e-6, atol=1e-9)
    assert float((raw > 1.5).sum()) > 0  # truncation exercised
    # compute_offpolicy_metrics (verl "kl", "k3_kl", "ppl_ratio": every row here has a trained
    # token, so verl's mean over rows is ours over sequences) and compute_is_metrics: verl
    # 0.9.1's "rollout_is_max" is the truncated maximum at token level, the untruncated one at
    # sequence level; "rollout_is_ratio_fraction_high" (our is_truncated_fraction) compares the
    # untruncated weights with the threshold, per token or per sequence. By design, not verl's:
    # is_weight_mean averages the UNTRUNCATED weights (verl 0.9.1's rollout_is_mean the
    # truncated ones).
    seq_mask = m.sum(-1) > 0
    assert bool(seq_mask.all())
    ppl = torch.exp(v_mean(-lr, m, -1)).mean()
    above = (raw > 1.5).double()
    expected = {"rollout_corr/kl_k1": v_mean(-lr, m), "rollout_corr/ppl_ratio": ppl,
                "rollout_corr/kl_k3": v_mean(torch.exp(lr) - lr - 1, m),
                "rollout_corr/is_weight_mean": v_mean(raw, m),
                "rollout_corr/is_weight_max": raw.clamp(max=1.5)[m > 0].max()
                if level == "token" else raw[m > 0].max(),
                "rollout_corr/is_truncated_fraction": v_mean(above, m) if level == "token"
                else above.max(-1).values.mean()}
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-6), key
    assert metrics["rollout_corr/masked_token_fraction"] == 0.0


@pytest.mark.parametrize("option", RS_OPTIONS)
def test_rejection_modes_match_verl(option):
    seqs, lr, m = _batch(1, scale=0.6)
    thr = "0.3_2.5" if option == "seq_sum_k1" else "0.7_1.6"
    if not option.endswith("k1"):  # an upper bound between the statistic's values
        stat = v_rs(lr, m, option, None, float("inf"))  # all kept: find the median statistic
        lr_c = lr.clamp(-20, 20)
        tok = {"k2": 0.5 * lr_c ** 2, "k3": torch.exp(lr_c) - 1 - lr_c}[option[-2:]]
        assert bool((stat == 1).all())
        thr = f"{float(tok[m > 0].median()) * (3 if option.startswith('seq_sum') else 1):.6f}"
    lower, upper = (float(x) for x in thr.split("_")) if "_" in thr else (None, float(thr))
    keep = v_rs(lr, m, option, lower, upper)
    metrics = apply_to_batch(seqs, RolloutCorrectionConfig(rollout_rs=option,
                                                           rollout_rs_threshold=thr))
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        assert s.loss_mask == (keep[i, :n] * m[i, :n]).long().tolist(), (option, i)
    dropped = (1 - keep) * m
    assert 0 < float(dropped.sum()) < float(m.sum()), option  # some, not all, rejected
    assert metrics["rollout_corr/masked_token_fraction"] == pytest.approx(
        float(v_mean(1 - keep, m)), rel=1e-6)
    assert metrics["rollout_corr/rejected_sequence_fraction"] == pytest.approx(
        float((dropped.sum(-1) > 0).float().mean()), rel=1e-6)


def test_rejection_options_combine_and_one_threshold_broadcasts():
    seqs, lr, m = _batch(2, scale=0.6)
    apply_to_batch(seqs, RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k2",
                                                 rollout_rs_threshold="1.8"))
    keep = v_rs(lr, m, "token_k1", 1 / 1.8, 1.8) * v_rs(lr, m, "seq_max_k2", None, 1.8)
    assert [x for s in seqs for x in s.loss_mask] == \
        [int(k * mm) for i, s in enumerate(seqs) for k, mm in zip(keep[i, :len(s.tokens)],
                                                                 m[i, :len(s.tokens)])]


class _CountingPolicy:
    vocab_size = 16

    def __init__(self):
        self.forwards = 0

    def forward_only(self, *args, **kwargs):
        self.forwards += 1
        raise AssertionError("bypass mode must not run the old-log-prob forward")


def test_bypass_mode_skips_the_old_logprob_forward():
    seqs, _, _ = _batch()
    cfg = RLConfig()
    cfg.rollout_correction.bypass_mode = True
    policy = _CountingPolicy()
    assert attach_old_logprobs(policy, seqs, cfg) == {}
    assert policy.forwards == 0
    assert all(s.extras["old_logprobs"] == s.extras["rollout_logprobs"] for s in seqs)


@pytest.mark.parametrize("overrides,message", [
    ({"rollout_is": "seq"}, "rollout_correction.rollout_is='seq' is not valid; choose one of "
                            "null, token, sequence"),
    ({"rollout_is_threshold": 0.0}, "rollout_correction.rollout_is_threshold=0.0 must be"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": "2"}, "token_k4 not valid; choose from"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "'0.5_2' is not a valid "
                                                                  "threshold of token_k2"),
    ({"rollout_rs": "seq_sum_k1"}, "rollout_rs_threshold must be set with rollout_rs"),
    ({"rollout_rs_threshold": "2"}, "rollout_rs is null (set both, or neither)"),
    ({"loss_type": "reinforce"}, "applies only with rollout_correction.bypass_mode=true"),
    ({"loss_type": "pg", "bypass_mode": True}, "loss_type='pg' is not valid"),
    ({"bypass_mode": True, "rollout_is": "token", "rollout_is_batch_normalize": True},
     "rollout_is_batch_normalize=true needs the IS weights of the whole batch"),
])
def test_bad_rollout_correction_keys_are_named(overrides, message):
    cfg = RLConfig()
    for k, v in overrides.items():
        setattr(cfg.rollout_correction, k, v)
    assert message in " | ".join(rl_problems(cfg))


def test_bypass_refuses_another_policy_loss_and_sapo_taus_are_checked():
    cfg = RLConfig(policy_loss="gspo")
    cfg.rollout_correction.bypass_mode = True
    cfg.sapo.tau_neg = 0.0
    problems = " | ".join(rl_problems(cfg))
    assert "policy_loss='gspo' cannot be combined with it" in problems
    assert "sapo.tau_neg=0.0 must be > 0" in problems


def test_tis_cap_is_refused_naming_its_replacement():
    with pytest.raises(ConfigError, match="rollout.tis_cap .* was renamed to "
                                          r"rollout_correction.rollout_is_threshold \(with "
                                          "rollout_correction.rollout_is=token\\)"):
        load_config(RLConfig, ["rollout.tis_cap=2.0"])
    cfg, _ = load_config(RLConfig, ["rollout_correction.rollout_is=token",
                                    "rollout_correction.rollout_rs=seq_mean_k3",
                                    "rollout_correction.rollout_rs_threshold=0.01"])
    assert cfg.rollout_correction.rollout_rs_threshold == "0.01" and not rl_problems(cfg)


# ------------------------------------------------- bypass mode through policy_update (in process)
class _SummingEngine:
    """TrainEngine.train_batch without a model: the GlobalLossNormalizer's weights, padded
    micro-batches of `split` sequences, the loss function on each, reports summed over them
    (engine.training.schedule.reduce_reports on one rank). The "logits" handed to the loss
    function are the current policy's log-probs (extras "test_logp"; token_logprobs_and_entropy
    is replaced by the test)."""

    def __init__(self, split):
        self.split = split

    def train_batch(self, seqs, normalizer, loss_fn, report_keys):
        weights = normalizer.sequence_weights(
            torch.tensor([float(sum(s.loss_mask)) for s in seqs]))
        sums = dict.fromkeys(report_keys, 0.0)
        start = 0
        for size in self.split:
            part = list(range(start, min(start + size, len(seqs))))
            start += size
            width = max(len(seqs[i].tokens) for i in part)
            mask = torch.zeros(len(part), width)
            ids = torch.full((len(part), width), -1, dtype=torch.long)
            extras = {k: torch.zeros(len(part), width) for k in seqs[0].extras}
            for row, i in enumerate(part):
                n = len(seqs[i].tokens)
                mask[row, :n] = torch.tensor(seqs[i].loss_mask, dtype=torch.float32)
                ids[row, :n] = row
                for k in extras:
                    extras[k][row, :n] = torch.tensor(seqs[i].extras[k])
            w = weights[part].float()[:, None] * mask
            mb = SimpleNamespace(token_weights=w, labels=torch.zeros_like(ids), loss_mask=mask,
                                 seq_ids=ids, extras=extras)
            _, report = loss_fn(extras["test_logp"], mb)
            for k in report_keys:
                sums[k] += float(report[k])
        return {**sums, "time/step_s": 0.0}


def _bypass_batch(seed=3, scale=0.5):
    """(sequences, current logp, rollout logp, advantages, mask) as [B, T] float64 tensors."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    cur, roll, adv, mask = (torch.zeros(B, T, dtype=torch.float64) for _ in range(4))
    for i in range(B):
        head, n = 1 + i % 2, 2 + (3 * i) % 7
        r = -torch.rand(head + n, generator=g, dtype=torch.float64) * 2
        c = r + scale * torch.randn(head + n, generator=g, dtype=torch.float64)
        a = 1.0 if i % 2 else -1.0
        m = [0] * head + [1] * n
        seqs.append(SequenceData([5] * (head + n), [5] * (head + n), m, extras={
            "old_logprobs": r.tolist(), "rollout_logprobs": r.tolist(),
            "advantages": [a] * (head + n), "test_logp": c.tolist()}))
        cur[i, :head + n], roll[i, :head + n] = c, r
        adv[i, :head + n], mask[i, :head + n] = a, torch.tensor(m, dtype=torch.float64)
    return seqs, cur, roll, adv, mask


def _bypass_update(monkeypatch, seqs, corr, mode="token-mean", split=(B,)):
    import engine.rl.policy.update as update

    monkeypatch.setattr(update, "token_logprobs_and_entropy",
                        lambda logits, *a, **k: (logits, torch.zeros_like(logits)))
    monkeypatch.setattr(update, "ps", SimpleNamespace(
        get_data_parallel_group=lambda **k: None, model_parallel_is_initialized=lambda: False))
    settings = update.PolicyLossSettings(vocab_size=16, temperature=1.0, eps_low=0.2,
                                         eps_high=0.28, bypass=corr)
    loss_cfg = SimpleNamespace(agg_mode=mode, count_empty_sequences=True)
    return update.policy_update(_SummingEngine(split), seqs, loss_cfg, settings, horizon=16.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_bypass_clip_fractions_are_over_kept_tokens(monkeypatch, mode):
    """Bypass mode with rejection: a rejected token lies outside the clip band but carries no
    gradient; policy/clipfrac_* average the clip indicators over the KEPT tokens only (verl's
    masked_mean over the post-rejection mask), the same for any micro-batch split. token-mean
    and seq-mean-token-sum: the plain mean over kept tokens; seq-mean-token-mean: kept tokens
    weighted 1/n_i (n_i counted before rejection)."""
    seqs, cur, roll, adv, m = _bypass_batch()
    corr = RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k1",
                                   rollout_rs_threshold="1.5")
    out = _bypass_update(monkeypatch, seqs, corr, mode)
    r = torch.exp(cur - roll)
    keep = ((r >= 1 / 1.5) & (r <= 1.5)).double() * m  # token_k1: 1/1.5 <= r <= 1.5
    low = ((adv < 0) & (r < 0.8)).double()
    high = ((adv > 0) & (r > 1.28)).double()
    rejected = m - keep
    # the bug's trigger: rejected tokens are outside the clip band, some on a clipped side
    assert float((rejected * (low + high)).sum()) > 0 and float(rejected.sum()) < float(m.sum())
    assert float((keep * low).sum()) > 0 and float((keep * high).sum()) > 0
    tok_w = keep / m.sum(-1, keepdim=True) if mode == "seq-mean-token-mean" else keep
    expected_low = float((tok_w * low).sum() / tok_w.sum())
    expected_high = float((tok_w * high).sum() / tok_w.sum())
    assert out["policy/clipfrac_low"] == pytest.approx(expected_low, rel=1e-6)
    assert out["policy/clipfrac_high"] == pytest.approx(expected_high, rel=1e-6)
    if mode == "token-mean":  # verl: masked_mean(indicator, response_mask * keep)
        assert expected_low == pytest.approx(float((low * keep).sum() / keep.sum()))
    split = _bypass_update(monkeypatch, seqs, corr, mode, split=(3, 2, 3))
    for key in ("policy/clipfrac_low", "policy/clipfrac_high"):
        assert split[key] == pytest.approx(out[key], rel=1e-6), key
    assert out["rollout_corr/masked_token_fraction"] == pytest.approx(
        float(rejected.sum() / m.sum()), rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bypass_is_weight_max_is_a_maximum_over_micro_batches(monkeypatch, level):
    """Bypass mode logs rollout_corr/is_weight_max: the MAX over micro-batches (and, reduced with
    MAX, over DP x CP and PP ranks), verl 0.9.1's value (token level truncated at the
    threshold, sequence level untruncated), the same for any micro-batch split; the RL loop
    combines optimizer steps with max, not mean."""
    seqs, cur, roll, adv, m = _bypass_batch(scale=0.8)
    thr = 1.5
    corr = RolloutCorrectionConfig(bypass_mode=True, rollout_is=level, rollout_is_threshold=thr)
    lr = (cur - roll) * m
    raw = torch.exp(lr) if level == "token" else torch.exp(lr.sum(-1, keepdim=True)).expand_as(lr)
    top = float(raw[m > 0].max())
    assert top > thr  # truncation exercised
    expected = min(top, thr) if level == "token" else top
    for split in ((B,), (3, 2, 3), (1,) * B):
        out = _bypass_update(monkeypatch, seqs, corr, split=split)
        assert out["rollout_corr/is_weight_max"] == pytest.approx(expected, rel=1e-6), split
    above = (raw > thr).double()
    fraction = (float((above * m).sum() / m.sum()) if level == "token"
                else float(above[:, 0][m.sum(-1) > 0].mean()))
    assert out["rollout_corr/is_truncated_fraction"] == pytest.approx(fraction, rel=1e-6)
    assert 0 < fraction < 1


def test_rl_loop_combines_is_weight_max_with_max(monkeypatch):
    """train_on_rollout averages rollout_corr/* over the optimizer steps, except the maximum."""
    import engine.rl.policy.train_step as loop

    updates = iter([{"rollout_corr/is_weight_max": 1.2, "rollout_corr/kl_k1": 0.1},
                    {"rollout_corr/is_weight_max": 1.7, "rollout_corr/kl_k1": 0.3},
                    {"rollout_corr/kl_k1": 0.2}])  # a mini-batch without a trained token
    base = {k: 0.0 for k in loop.UPDATE_MEAN_KEYS}
    base.update({"lr": 1.0, "train/micro_batches": 1.0, "policy/response_tokens": 1.0})
    monkeypatch.setattr(loop, "build_sequences", lambda batch: list(range(6)))
    monkeypatch.setattr(loop, "logprob_stage", lambda *a, **k: {})
    monkeypatch.setattr(loop, "end_replay", lambda policy: None)
    monkeypatch.setattr(loop, "policy_update", lambda *a, **k: {**base, **next(updates)})
    cfg = RLConfig()
    cfg.train.mini_batches_per_step = 3
    metrics = loop.train_on_rollout(SimpleNamespace(vocab_size=16), None,
                                    SimpleNamespace(rewards=[]), cfg, step=0)
    assert metrics["rollout_corr/is_weight_max"] == 1.7
    assert metrics["rollout_corr/kl_k1"] == pytest.approx(0.2)


def test_sequence_metrics_leave_out_sequences_without_a_trained_token():
    """ppl_ratio and rejected_sequence_fraction average over the sequences with a trained
    token. verl 0.9.1 averages over every row: an empty row adds exp(0) = 1 to ppl_ratio and 0
    to rollout_rs_seq_masked_fraction, which gives different numbers on this batch."""
    def batch_with_an_empty_row():
        seqs, lr, m = _batch(4, scale=0.6)
        seqs[2].loss_mask = [0] * len(seqs[2].loss_mask)
        m[2] = 0
        return seqs, lr, m

    seqs, lr, m = batch_with_an_empty_row()
    metrics = apply_to_batch(seqs, RolloutCorrectionConfig(rollout_rs="token_k1",
                                                           rollout_rs_threshold="1.3"))
    keep = v_rs(lr, m, "token_k1", 1 / 1.3, 1.3)
    has_token = m.sum(-1) > 0
    per_seq_ppl = torch.exp(v_mean(-lr, m, -1))  # exp(0) = 1 on the empty row
    has_rejected = ((1 - keep) * m).sum(-1) > 0
    ours_ppl, verl_ppl = per_seq_ppl[has_token].mean(), per_seq_ppl.mean()
    ours_rej, verl_rej = has_rejected[has_token].double().mean(), has_rejected.double().mean()
    assert metrics["rollout_corr/ppl_ratio"] == pytest.approx(float(ours_ppl), rel=1e-9)
    assert metrics["rollout_corr/rejected_sequence_fraction"] == pytest.approx(float(ours_rej))
    assert abs(float(ours_ppl - verl_ppl)) > 1e-3 and abs(float(ours_rej - verl_rej)) > 1e-3
    # the sequence-level truncated fraction follows the same rule
    seqs, lr, m = batch_with_an_empty_row()  # the first call set rejected tokens' mask to 0
    metrics = apply_to_batch(seqs, RolloutCorrectionConfig(rollout_is="sequence",
                                                           rollout_is_threshold=1.2))
    seq_w = torch.exp((lr * m).sum(-1))
    assert metrics["rollout_corr/is_truncated_fraction"] == pytest.approx(
        float((seq_w[has_token] > 1.2).double().mean()))
