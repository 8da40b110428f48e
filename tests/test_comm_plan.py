"""The communication plan (models.estimate.comm) against the bytes the engine really hands to
torch.distributed, and the plan in `--validate` (human and --json) of the shipped recipes.

One 2-rank torchrun launch (tests/multirank/comm_bytes.py; a real launch, not the rank pool:
it wraps torch.distributed's functions before megatron binds them at import) trains through the engine at DP2, TP2+SP,
PP2, CP2 and EP2 (MoE), and LoRA (rank 8 on all-linear, base frozen) at TP2+SP and TP2, with
both overlaps on, wrapping every collective; each rank's measured
bytes per kind must be within 5 % of the prediction for its pipeline stage, every kind the
layout implies must be non-zero, and nothing but control scalars may be left unattributed.
"""
import json
import subprocess

import pytest

from tests.launch import REPO_ROOT, result_lines, run_cli, run_torchrun
from tools.tiny_models import build_tiny_model

pytestmark = pytest.mark.timeout(900)

TOL = 0.05
SPECS = {"dp2": "1,1,0,1,1,0,0", "tp2_sp": "2,1,0,1,1,1,0", "pp2": "1,2,0,1,1,0,0",
         "cp2": "1,1,0,2,1,0,0", "ep2": "1,1,0,1,2,0,1", "tp2_sp_lora": "2,1,0,1,1,1,0,8",
         "tp2_lora": "2,1,0,1,1,0,0,8"}
# kinds each layout must exercise (world 2)
EXPECTED = {"dp2": {"dp_grad_reduce", "dp_param_all_gather"}, "tp2_sp": {"tp_sp"},
            "pp2": {"pp_p2p", "pp_tied_embedding"},
            "cp2": {"cp_exchange", "dp_grad_reduce", "dp_param_all_gather"},
            "ep2": {"ep_all_to_all", "dp_grad_reduce", "dp_param_all_gather"},
            "tp2_sp_lora": {"tp_sp"}, "tp2_lora": {"tp_sp"}}
CONTROL_BYTES = 4096   # per rank and step: loss sums, token counts, grad norms, metadata


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("comm")
    dense = build_tiny_model(str(root / "dense"), "qwen3", vocab_size=200, tokenizer=False)
    moe = build_tiny_model(str(root / "moe"), "qwen3_moe", vocab_size=200, layers=2,
                           tokenizer=False)
    proc = run_torchrun(2, "tests/multirank/comm_bytes.py", dense, moe,
                        *(f"{k}:{v}" for k, v in SPECS.items()), timeout=600)
    assert proc.returncode == 0
    return {r["spec"]: r["ranks"] for r in result_lines(proc.stdout)}


def test_every_layout_measured(measured):
    assert set(measured) == set(SPECS)


# The EP combine all-to-all hands back the rows this rank's experts received, which depends on
# the routing: per rank the plan is the expectation under uniform routing; over the EP group the
# total is exact (every row dispatched is combined), so this kind is compared as the group mean.
GROUP_MEAN = {"ep_all_to_all"}


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_predicted_bytes_match_measured_per_kind(measured, spec):
    ranks = measured[spec]
    for rank in ranks:
        got, want = rank["measured"], rank["predicted"]
        for kind, predicted in want.items():
            seen = got.get(kind, 0.0)
            if kind in GROUP_MEAN:
                seen = sum(r["measured"].get(kind, 0.0) for r in ranks) / len(ranks)
            where = (spec, rank["rank"], kind, seen, predicted)
            if predicted == 0:
                assert seen == 0, where
            else:
                assert abs(seen - predicted) <= TOL * predicted, where
        for kind in EXPECTED[spec]:
            assert want[kind] > 0 and got.get(kind, 0) > 0, (spec, rank["rank"], kind)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_only_control_scalars_are_unattributed(measured, spec):
    for rank in measured[spec]:
        other = {k: v for k, v in rank["measured"].items() if k.startswith("other:")}
        assert sum(other.values()) <= CONTROL_BYTES, (spec, rank["rank"], other)


def _validate(module: str, recipe: str, *extra: str) -> subprocess.CompletedProcess:
    """`python -m MODULE --config RECIPE --validate ...`, in this process (run_cli)."""
    return run_cli(module, "--config", str(REPO_ROOT / recipe), "--validate", *extra)


@pytest.mark.parametrize("recipe", ["recipes/sft/llama31_70b_h100.yaml",
                                    "recipes/sft/qwen3_8b_32k_cp.yaml",
                                    "recipes/sft/qwen3_30b_a3b_h100.yaml"])
def test_sft_validate_json_has_the_communication_section(recipe):
    proc = _validate("engine.sft", recipe, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    comm = out["communication"]
    assert out["ok"] and out["memory_gib"]["total"] > 0
    assert comm["unit"] == "bytes" and "input" in comm["definition"]
    assert comm["overlap"] == {"grad_reduce": True, "param_gather": True, "bucket_mb": None,
                               "grad_reduce_in_fp32": True}
    assert comm["per_gpu"]["dp_grad_reduce"] > 0 and comm["measured_on_gpu"] is False
    layout_kind = {"llama31_70b": "pp_p2p", "32k_cp": "cp_exchange", "30b_a3b": "ep_all_to_all"}
    kind = next(v for k, v in layout_kind.items() if k in recipe)
    assert comm["per_gpu"][kind] > 0
    text = _validate("engine.sft", recipe)
    assert "communication per GPU per optimizer step" in text.stdout


def test_rl_validate_json_has_communication_and_weight_sync():
    proc = _validate("engine.rl", "recipes/rl/qwen3_8b_grpo_h100.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    comm = json.loads(proc.stdout)["communication"]
    # Qwen3-8B in bf16: 8.19 B parameters x 2 bytes into each engine per RL step
    assert comm["weight_sync"]["bytes_per_engine"] == pytest.approx(16.38e9, rel=1e-3)
    assert comm["per_gpu"]["tp_sp"] > 0
