"""rollout_correction (verl's `algorithm.rollout_correction`): IS weights, rejection modes and
metrics against a compact transcription of verl's rollout_corr_helper.py (volcengine/verl at
b178a3cd5: compute_rollout_correction_weights, compute_rollout_rejection_mask,
compute_offpolicy_metrics; verl is not a dependency); bypass mode skips the old-log-prob
forward; the keys are validated at start (exit 2 naming the key)."""
import math

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
    # compute_offpolicy_metrics (verl "kl", "k3_kl", "ppl_ratio"; "rollout_is_mean")
    seq_mask = m.sum(-1) > 0
    ppl = torch.exp(v_mean(-lr, m, -1))[seq_mask].mean()
    expected = {"rollout_corr/kl_k1": v_mean(-lr, m), "rollout_corr/ppl_ratio": ppl,
                "rollout_corr/kl_k3": v_mean(torch.exp(lr) - lr - 1, m),
                "rollout_corr/is_weight_mean": v_mean(raw, m),
                "rollout_corr/is_weight_max": raw[m > 0].max()}
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
