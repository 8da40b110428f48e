"""Registries of the RL side: algorithm presets, advantage estimators, policy losses, rollout
backends; renamed configuration keys are refused with their new name."""
import pytest
import torch

from engine.config.schema import ConfigError, load_config
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS, leave_one_out_advantages
from engine.rl.algo.policy_loss import PolicyLossContext, clipped_surrogate
from engine.rl.algo.policy_loss_variants import POLICY_LOSSES
from engine.rl.algo.presets import ALGORITHMS, apply_algorithm_defaults
from engine.rl.algo.seq_reduce import SequenceReducer
from engine.rl.checks import rl_problems
from engine.rl.config import RLConfig
from engine.generation import BACKENDS, RolloutEngine, backend_class


def test_rloo_is_reward_minus_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    adv = leave_one_out_advantages(rewards, group_size=4)
    expected = [1 - 1, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert torch.equal(adv[4:], torch.zeros(4))  # a constant group gives exactly 0
    # RLOO = n / (n - 1) x (r - group mean)
    g = rewards[:4]
    torch.testing.assert_close(adv[:4], 4 / 3 * (g - g.mean()))
    with pytest.raises(ValueError, match="group_size >= 2"):
        leave_one_out_advantages(torch.tensor([1.0]), group_size=1)


def test_registries_are_looked_up_by_name():
    assert {"grpo", "dapo"} <= set(ALGORITHMS)
    assert {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} \
        <= set(ADVANTAGE_ESTIMATORS)
    assert {"ppo_clip", "gspo", "geo_mean", "cispo", "sapo"} <= set(POLICY_LOSSES)
    cfg = RLConfig()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    grpo = ADVANTAGE_ESTIMATORS["grpo"](rewards, 2, cfg.advantage, torch.tensor([3, 1, 2, 2]))
    assert torch.all(grpo.abs() > 0.5)  # (1 - 0.5) / (std 0.707 + eps)
    logp, old, adv = torch.tensor([0.1, -0.2]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])
    settings = type("S", (), {"eps_low": 0.2, "eps_high": 0.28, "dual_c": None})()
    ctx = PolicyLossContext(torch.ones(2), SequenceReducer(torch.tensor([0, 1]), torch.ones(2)))
    torch.testing.assert_close(POLICY_LOSSES["ppo_clip"](logp, old, adv, settings, ctx).loss,
                               clipped_surrogate(logp, old, adv, 0.2, 0.28).loss)


def test_dapo_preset_applies_only_to_keys_not_set():
    cfg = RLConfig(algorithm="dapo")
    apply_algorithm_defaults(cfg, explicit={"clip.eps_high"})
    assert cfg.clip.eps_low == 0.2 and cfg.clip.eps_high == 0.2  # explicit key kept
    assert cfg.dapo.dynamic_sampling and cfg.kl.beta == 0.0


def test_unknown_estimator_and_policy_loss_name_the_choices():
    cfg = RLConfig()
    cfg.advantage.estimator, cfg.policy_loss = "ppo", "gmpo"
    problems = " | ".join(rl_problems(cfg))
    assert ("advantage.estimator='ppo' is not valid; choose one of grpo, rloo, "
            "reinforce_plus_plus, reinforce_plus_plus_baseline") in problems
    assert ("policy_loss='gmpo' is not valid; choose one of ppo_clip, gspo, geo_mean, cispo, "
            "sapo") in problems


@pytest.mark.parametrize("old,new", [("rollout.sglang_tp_size=2", "rollout.gpus_per_engine"),
                                     ("rollout.sglang.tp_size=2", "rollout.gpus_per_engine"),
                                     ("rollout.sglang_mem_fraction=0.4",
                                      "rollout.sglang.mem_fraction")])
def test_renamed_sglang_keys_are_refused_with_the_new_name(old, new):
    with pytest.raises(ConfigError, match=f"was renamed to {new}"):
        load_config(RLConfig, [old])
    cfg, _ = load_config(RLConfig, [f"{new}={old.split('=')[1]}"])
    assert str(cfg.rollout.gpus_per_engine if "tp" in old else cfg.rollout.sglang.mem_fraction) \
        == old.split("=")[1]


def test_backends_declare_everything_the_loop_calls():
    assert set(BACKENDS) == {"hf", "vllm", "sglang"}
    hf = backend_class("hf")
    assert issubclass(hf, RolloutEngine) and hf.supports_logit_probe
    for name in ("generate", "update_weights", "sleep", "wake", "shutdown", "probe_logits",
                 "from_config", "is_asleep"):
        assert hasattr(RolloutEngine, name), name
