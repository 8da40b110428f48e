"""Qwen3-MoE family (models.families.qwen3_moe) and tools/convert.py with expert parallelism.

Fixture: a tiny Qwen3MoeForCausalLM (4 layers, hidden 64, 8 experts of width 32, top-2 with
renormalisation, untied embeddings, random init with initializer_range 0.2), built with
transformers here; nothing is downloaded.

- HF -> mcore (TP1) -> HF and HF -> mcore written at TP2 x EP2 on 4 ranks -> HF (1 process,
  so the experts are resharded from 2 EP ranks to 1) are bitwise equal to the original.
- `verify --ep 2` at TP2 x EP2 (from the TP1 checkpoint) and at PP2 x EP2 (from the TP2 x EP2
  checkpoint) on 4 ranks: logits within 1e-4 of transformers'.
- Layout and config refusals name the key / field (exit 2 from the CLI).
- Parameter counts: the fixture's HF tensor count; Qwen3-30B-A3B's published 30.5B / 3.3B.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.test_convert import _assert_bitwise_equal, _tensors, convert
from tools.tiny_models import build_tiny_model

_DIFF = re.compile(r"max_abs_diff=([0-9.eE+-]+|nan|inf)")


def build_moe(out_dir: Path, seed: int = 0, **extra) -> str:
    return build_tiny_model(str(out_dir), "qwen3_moe", hidden=64, layers=4, heads=8,
                            kv_heads=2, seed=seed, initializer_range=0.2, **extra)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return build_moe(tmp_path_factory.mktemp("moe") / "hf")


@pytest.fixture(scope="module")
def moe_ckpts(pools, moe_dir, tmp_path_factory) -> dict[str, str]:
    """{"tp1": checkpoint written by 1 process, "tp2ep2": written by 4 ranks at TP2 x EP2}."""
    root = tmp_path_factory.mktemp("moe_ckpt")
    proc = convert(pools, 1, "hf-to-mcore", "--hf-dir", moe_dir, "--out", str(root / "tp1"))
    assert proc.returncode == 0
    proc = convert(pools, 4, "hf-to-mcore", "--hf-dir", moe_dir,
                   "--out", str(root / "tp2ep2"), "--tp", "2", "--ep", "2")
    assert proc.returncode == 0
    return {"tp1": str(root / "tp1"), "tp2ep2": str(root / "tp2ep2")}


def test_fixture_routes_tokens_unevenly(moe_dir):
    """The router is really random (not HF's zero init): experts get different loads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    top = out.router_logits[0].topk(2, dim=-1).indices.flatten()
    load = torch.bincount(top, minlength=8)
    assert load.max() > load.min()
    assert out.logits.std() > 0.5


@pytest.mark.parametrize("ckpt", ["tp1", "tp2ep2"])
def test_roundtrip_is_bitwise(pools, ckpt, moe_dir, moe_ckpts, tmp_path):
    out = tmp_path / "hf"
    proc = convert(pools, 1, "mcore-to-hf", "--ckpt", moe_ckpts[ckpt], "--out", str(out))
    assert proc.returncode == 0
    _assert_bitwise_equal(moe_dir, out)
    names = _tensors(out)
    assert sum(".mlp.experts." in n for n in names) == 4 * 8 * 3
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (Path(moe_dir) / "config.json").read_text())


@pytest.mark.parametrize("ckpt,layout", [("tp1", ["--tp", "2"]), ("tp2ep2", ["--pp", "2"])])
def test_verify_with_expert_parallelism(pools, ckpt, layout, moe_dir, moe_ckpts):
    proc = convert(pools, 4, "verify", "--hf-dir", moe_dir, "--ckpt", moe_ckpts[ckpt],
                   *layout, "--ep", "2")
    assert proc.returncode == 0
    diffs = _DIFF.findall(proc.stdout)
    assert len(diffs) == 1, proc.stdout
    print(f"verify {layout} ep=2: max_abs_diff={diffs[0]}")
    assert float(diffs[0]) < 1e-4
    assert "ep=2" in proc.stdout


def test_verify_refuses_ep_that_does_not_divide_experts(pools, moe_dir, moe_ckpts):
    """Refused after torch.distributed starts (the layout is checked against the world
    size), so on the 1-rank pool: exit code 2, no traceback."""
    proc = convert(pools, 1, "verify", "--hf-dir", moe_dir, "--ckpt", moe_ckpts["tp1"],
                   "--ep", "3", check=False)
    assert proc.returncode == 2
    assert "parallel.ep=3" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,needle", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
])
def test_refused_moe_fields_are_named(extra, needle):
    from models.hf.config import config_problems

    cfg = dict(model_type="qwen3_moe", vocab_size=200, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16,
               intermediate_size=128, moe_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2)
    cfg.update(extra)
    problems = config_problems(cfg)
    assert len(problems) == 1 and needle in problems[0], problems


def test_expert_layout_problems_name_parallel_ep():
    from parallel.layout import ParallelLayout

    assert ParallelLayout(4, tp=2, ep=2).problems(num_experts=8) == []
    (p,) = ParallelLayout(4, tp=2, ep=4).problems(num_experts=8)
    assert "parallel.ep=4" in p and "dp x cp" in p
    (p,) = ParallelLayout(6, ep=3).problems(num_experts=8)
    assert "num_experts=8" in p and "parallel.ep=3" in p
    (p,) = ParallelLayout(2, ep=2).problems(num_experts=0)
    assert "mixture-of-experts" in p


def test_parameter_counts(moe_dir):
    from models.estimate.counting import stage_parameters
    from models.families.presets import MODEL_SHAPES

    cfg = json.loads((Path(moe_dir) / "config.json").read_text())
    total = sum(t.numel() for t in _tensors(moe_dir).values())
    assert stage_parameters(cfg, 1, 1).total == total
    # one rank at TP2 x PP2 x EP2 holds 2 layers' 4 local experts split over 2 TP ranks
    assert stage_parameters(cfg, 2, 2, 2).expert_stage == 2 * 4 * 3 * 64 * 32 // 2
    big = stage_parameters(MODEL_SHAPES["qwen3-30b-a3b"], 1, 1)
    assert round(big.total / 1e9, 1) == 30.5 and round(big.active / 1e9, 1) == 3.4
