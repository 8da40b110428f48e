"""Issue 76's preference items, in process: KTO's margin metrics without both labels (item 7,
as TRL 1.16's KTOTrainer: a side without an example has no metrics of its own and
`rewards/margins` needs both); reward models refuse model.mtp.enabled by name (item 3: they
train no MTP layer). KTO training the MTP layer: tests/test_mtp.py; the shared core's
behaviour: the DPO, KTO and RM suites (tests/test_dpo*.py, test_kto*.py, test_rm*.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.kto.loss import KTOLossSettings
from engine.kto.loss_fn import REPORT_KEYS, ExampleBatch, kto_metrics


def _batch(labels: list[bool]) -> ExampleBatch:
    n = len(labels)
    return ExampleBatch(KTOLossSettings(), torch.full((n,), 4.0, dtype=torch.float64),
                        torch.zeros(n, dtype=torch.float64), torch.tensor(labels),
                        torch.tensor(0.25, dtype=torch.float64), torch.zeros(n))


def _out() -> dict:
    """Reduced reports as train_batch returns them (a missing side reports 0 there)."""
    return {k: 0.1 * (i + 1) for i, k in enumerate(REPORT_KEYS)}


def test_kto_metrics_leave_out_a_side_without_examples():
    """The step's and the evaluation's metrics (kto_step, evaluate: kto_metrics): with only
    desirable examples `*/rejected` and `rewards/margins` are absent (they were logged as 0 and
    as rewards/chosen); with only undesirable ones `*/chosen` and the margins; with both, the
    margins are chosen - rejected."""
    out = _out()
    only_good = kto_metrics(out, _batch([True, True, True]))
    assert {"rewards/rejected", "logps/rejected", "logits/rejected",
            "rewards/margins"}.isdisjoint(only_good), only_good
    assert only_good["rewards/chosen"] == out["rewards/chosen"] and only_good["kl"] == 0.25
    assert only_good["entropy"] == out["entropy"] and only_good["loss"] == out["loss"]
    only_bad = kto_metrics(out, _batch([False, False]))
    assert {"rewards/chosen", "logps/chosen", "logits/chosen",
            "rewards/margins"}.isdisjoint(only_bad), only_bad
    assert only_bad["rewards/rejected"] == out["rewards/rejected"]
    both = kto_metrics(out, _batch([True, False, True]))
    assert set(both) == set(REPORT_KEYS) | {"kl", "rewards/margins"}
    assert both["rewards/margins"] == out["rewards/chosen"] - out["rewards/rejected"]


def test_reward_models_refuse_mtp_by_name():
    """A reward model trains no MTP layer: model.mtp.enabled=true is refused before any
    process group (engine.config.rm_settings.rm_problems, also `--validate`); off, nothing."""
    from engine.config.mtp_settings import MTPConfig
    from engine.config.rm_settings import RMSettings, rm_problems

    hf = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 8}
    cfg = SimpleNamespace(rm=RMSettings(), model=SimpleNamespace(
        hf_path="/models/GLM-4.5-Air", mtp=MTPConfig(enabled=True)))
    problems = rm_problems(cfg, hf)
    assert [p for p in problems if p.startswith("model.mtp.enabled=true")] == [
        "model.mtp.enabled=true is not supported for reward models: a reward model scores a "
        "sequence at one token and predicts none, so its MTP layer (a draft model) would learn "
        "nothing; leave model.mtp.enabled false"], problems
    cfg.model.mtp.enabled = False
    assert not any("model.mtp" in p for p in rm_problems(cfg, hf))
