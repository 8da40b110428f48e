"""LoRA DPO from a PEFT adapter through the command line (`-m engine.dpo` with
model.lora.init_from on two ranks of the rank pool, the demo's model and preference files):
the reference is the starting adapter, frozen (docs/preference.md#the-reference), also after a
resume. The math against peft and TRL: tests/test_dpo.py."""
from __future__ import annotations

import math

import pytest

from tests.test_dpo_cli import _args, _metrics
from tools.tiny_models import build_peft_adapter


def test_lora_dpo_from_an_adapter_starts_at_margin_zero_and_resumes(pools, demo_assets,
                                                                      tmp_path):
    """Step 1: the policy is the reference: rewards/margins 0 and the loss ln 2 plus RPO's
    0.2 x nll (the bare base as reference gives margins far from 0: tests/test_dpo.py). The run
    stops after step 1 with a checkpoint and resumes: step 2's margins are not 0, so the
    resumed reference is still the starting adapter read from its folder (a reference rebuilt
    from the checkpoint's adapters would be the policy itself: margins 0 again). Measured:
    margins 0.0 and loss 1.78167 = ln 2 + 0.2 x 5.44263 at step 1, margins 0.130 at step 2."""
    adapter = build_peft_adapter(str(demo_assets / "model"), str(tmp_path / "adapter"),
                                 rank=4, alpha=8, std=0.1)
    lora = (f"model.lora.init_from={adapter}", "optim.lr=1e-2", "train.eval_interval=0",
            "checkpoint.save_interval=1")
    first = pools.script(2, *_args(demo_assets, tmp_path, 1, *lora), timeout=600)
    assert first.returncode == 0, first.stderr
    assert f"reference: the starting adapter ({adapter})" in first.stdout, first.stdout
    resumed = pools.script(2, *_args(demo_assets, tmp_path, 2, *lora), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["rewards/margins"]) < 1e-6, rows[0]
    assert rows[0]["loss"] == pytest.approx(math.log(2) + 0.2 * rows[0]["nll"], rel=1e-5)
    assert abs(rows[1]["rewards/margins"]) > 1e-4, rows[1]
