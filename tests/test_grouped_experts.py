"""Grouped MoE experts (models.layers.experts.grouped, key moe.grouped_experts) equal megatron's
SequentialMLP: one expert module (experts without tokens, both kernels, fused SwiGLU, a
negative control that routes the tokens to the wrong experts) and a whole Qwen3-MoE model at
EP1, EP2 and TP2 with sequence parallelism, and at EP2 with megatron's fused SwiGLU and
residual add and the compiled RMSNorm (model.fusions, under the CPU runtime) against the unfused
sequential model (logits and every gradient, fp32, rel 1e-5;
tests/multirank/grouped_experts_check.py). The checkpoint layout is SequentialMLP's, so the
HF <-> Megatron round trips of tests/test_moe_convert.py, tests/test_mixtral_convert.py and
tests/test_moe_sft_cli.py (grouped by default) cover the mapping."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.launch import result_lines
from tests.test_moe_convert import build_moe

CHECK = str(Path(__file__).parent / "multirank" / "grouped_experts_check.py")
TOL = 1e-5


def test_expert_module_matches_sequential_mlp(pools):
    proc = pools.script(1, CHECK, "--unit", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in result_lines(proc.stdout)}
    expected = {"padded", "padded_fused_swiglu", "negative_control"}
    if hasattr(torch, "_grouped_mm"):
        expected.add("grouped_mm")
    assert set(rows) == expected
    for case in expected - {"negative_control"}:
        assert rows[case]["out"] <= TOL and rows[case]["grads"] <= TOL, rows[case]
    # tokens sent to the wrong experts: the comparison must see it
    assert rows["negative_control"]["out"] > 0.1 and rows["negative_control"]["grads"] > 0.1


def test_whole_model_matches_sequential_at_ep1_ep2_tp2sp_and_fused(pools, tmp_path):
    hf_dir = build_moe(tmp_path / "hf")
    proc = pools.script(2, CHECK, hf_dir, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["layout"]: r for r in result_lines(proc.stdout)}
    assert set(rows) == {"ep1", "ep2", "tp2sp", "ep2_fusions", "tp2sp_lora"}
    for row in rows.values():
        assert row["grouped_modules"] == 4  # one per layer on every rank
        assert row["logits"] <= TOL and row["grads"] <= TOL, row
        # the compiled RMSNorm (model.fusions.rmsnorm) ran under the CPU runtime in ep2_fusions
        assert (row["fused_norms"] > 0) == (row["layout"] == "ep2_fusions"), row


def test_grouped_experts_key_is_validated_and_passed_to_the_builder():
    from engine.config.moe_settings import MoEConfig, moe_overrides, moe_problems

    moe_cfg = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}
    cfg = SimpleNamespace(moe=MoEConfig(grouped_experts="yes"), parallel=SimpleNamespace(ep=1))
    problems = moe_problems(cfg, moe_cfg)
    assert any(p.startswith("moe.grouped_experts='yes'") for p in problems), problems
    assert moe_overrides(SimpleNamespace(moe=MoEConfig()), moe_cfg)["grouped_experts"] is True
    off = SimpleNamespace(moe=MoEConfig(grouped_experts=False))
    assert moe_overrides(off, moe_cfg)["grouped_experts"] is False


@pytest.mark.parametrize("value,refused", [("false", False), ("true", False), ("maybe", True)])
def test_grouped_experts_cli_value(value, refused):
    from engine.config.schema import SFTConfig, load_config

    if refused:
        with pytest.raises(Exception, match="grouped_experts"):
            load_config(SFTConfig, [f"moe.grouped_experts={value}"])
    else:
        cfg, _ = load_config(SFTConfig, [f"moe.grouped_experts={value}"])
        assert cfg.moe.grouped_experts is (value == "true")
