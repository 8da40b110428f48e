"""Recipes under recipes/sft/ and `engine.sft --validate` (engine.config.recipe_validation).

Parameter counts are checked against the published sizes of the models; the memory estimate
against the formulas of engine.config.recipe_validation's docstring, worked out here by hand for
Llama-3.1-8B at TP2 x DP4. The launch scripts themselves run in tests/test_checkpointing.py.
"""
import re

import pytest

from engine.config.schema import SFTConfig, load_config
from models.estimate.training_memory import GIB
from engine.config.recipe_validation import (MODEL_SHAPES, estimate_memory, stage_parameters,
                                      validate_recipe)
from parallel.layout import ParallelLayout
from tests.launch import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "recipes" / "sft").glob("*.yaml"))


def load(path, *overrides):
    cfg, _ = load_config(SFTConfig, ["--config", str(path), *overrides])
    return cfg


def test_recipe_set_is_complete():
    names = {p.stem for p in RECIPES}
    assert {"qwen3_8b_h100", "llama31_8b_h100", "qwen3_8b_32k_cp", "llama31_70b_h100",
            "glm4_5_air_h100", "gpt_oss_20b_h100", "gpt_oss_120b_h100", "moonlight_16b_a3b_h100",
            "deepseek_v3_h100", "qwen3_8b_lora_h100", "llama31_70b_lora_h100",
            "qwen3_5_9b_h100", "qwen3_5_122b_a10b_h100", "deepseek_v3_lora_h100",
            "qwen3_5_35b_a3b_images_h100"} <= names
    shapes = {load(p).model.shape for p in RECIPES}
    assert shapes == {"qwen3-8b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b",
                      "glm-4.5-air", "gpt-oss-20b", "gpt-oss-120b", "moonlight-16b-a3b",
                      "deepseek-v3", "qwen3.5-9b", "qwen3.5-122b-a10b", "qwen3.5-35b-a3b-vl"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_validates_at_its_cluster_size(path):
    cfg = load(path)
    assert cfg.model.dtype == "bfloat16" and cfg.optim.distributed_optimizer
    assert cfg.checkpoint.resume == "auto" and cfg.checkpoint.save_interval > 0
    nodes, per_node = cfg.recipe.nodes, cfg.recipe.gpus_per_node
    report = validate_recipe(cfg, nodes * per_node, nodes)
    assert report.problems == [], report.problems
    assert [w for w in report.warnings if "train_files" not in w] == []
    # the memory the recipe states (checked within 10% by the validation) is also in its
    # header comment, and fits an H100 80GB
    stated = cfg.recipe.expected_memory_gib
    assert stated is not None and stated < cfg.recipe.gpu_memory_gib
    comment = re.search(r"Expected memory per GPU: ~([0-9.]+) GiB", path.read_text())
    assert comment and float(comment.group(1)) == stated
    summary = "\n".join(report.summary)
    assert f"tp={cfg.parallel.tp} pp={cfg.parallel.pp}" in summary
    assert f"= {stated:.1f} of" in summary


def test_published_parameter_counts():
    assert stage_parameters(MODEL_SHAPES["llama-3.1-8b"], 1, 1).total == 8_030_261_248
    assert stage_parameters(MODEL_SHAPES["llama-3.1-70b"], 1, 1).total == 70_553_706_496
    assert stage_parameters(MODEL_SHAPES["qwen3-8b"], 1, 1).total == 8_190_735_360


def test_memory_estimate_by_hand_llama8b_tp2_dp4():
    hf = MODEL_SHAPES["llama-3.1-8b"]
    cfg = load(REPO_ROOT / "recipes" / "sft" / "llama31_8b_h100.yaml")
    mem = estimate_memory(hf, ParallelLayout(8, tp=2), cfg.train, bf16=True,
                          distributed_optimizer=True, micro_batches=32)
    h, q, kv, ffn, vocab, layers, t = 4096, 4096, 1024, 14336, 128256, 32, 4096
    per_rank = (layers * ((2 * h * q + 2 * h * kv + 3 * h * ffn) // 2 + 2 * h)
                + 2 * (vocab * h // 2) + h)       # vocab 128256 is a multiple of 128
    assert per_rank == 4_015_263_744
    assert mem.weights == pytest.approx(per_rank * 2 / GIB)
    assert mem.grads == pytest.approx(per_rank * 4 / GIB)
    assert mem.optimizer == pytest.approx(per_rank * 12 / 4 / GIB)
    act = 2 * t * (4 * h + (q + 2 * q + q + 2 * kv + 3 * ffn) / 2)
    assert mem.activations == pytest.approx(layers * act / GIB)
    # the chunked loss head (train.loss_chunk_tokens 1024): three fp32 [1024, V/2] buffers;
    # the bf16 output weight's gradient goes straight into DDP's fp32 main_grad (in grads)
    assert mem.logits == pytest.approx(12 * 1024 * vocab / 2 / GIB)
    assert mem.total == pytest.approx(51.36 - vocab / 2 * h * 6 / GIB, abs=0.01)   # 49.89
    # fp32 weights: the head returns its fp32 [V/2, h] weight gradient to autograd
    fp32 = estimate_memory(hf, ParallelLayout(8, tp=2), cfg.train, bf16=False,
                           distributed_optimizer=True, micro_batches=32)
    assert fp32.logits == pytest.approx((12 * 1024 * vocab / 2 + vocab / 2 * h * 4) / GIB)
    unchunked = estimate_memory(hf, ParallelLayout(8, tp=2), load(
        REPO_ROOT / "recipes" / "sft" / "llama31_8b_h100.yaml", "train.loss_chunk_tokens=0").train,
        bf16=True, distributed_optimizer=True, micro_batches=32)
    assert unchunked.logits == pytest.approx(t * vocab / 2 * 14 / GIB)


def test_pipeline_layers_in_flight():
    hf = MODEL_SHAPES["llama-3.1-70b"]
    train = load(REPO_ROOT / "recipes" / "sft" / "llama31_70b_h100.yaml").train
    one_f_one_b = estimate_memory(hf, ParallelLayout(64, tp=8, pp=4), train, True, True, 64)
    assert one_f_one_b.notes["layers_in_flight"] == 4 * 20
    few = estimate_memory(hf, ParallelLayout(64, tp=8, pp=4), train, True, True, 2)
    assert few.notes["layers_in_flight"] == 2 * 20
    interleaved = estimate_memory(hf, ParallelLayout(64, tp=8, pp=4, vpp=5), train, True,
                                  True, 64)
    assert interleaved.notes["layers_in_flight"] == (2 * 3 + 4 * 4 + 1) * 4


def test_more_nodes_shard_the_optimizer_further():
    cfg = load(REPO_ROOT / "recipes" / "sft" / "qwen3_8b_h100.yaml")
    one, two = validate_recipe(cfg, 8, 1), validate_recipe(cfg, 16, 2)
    assert one.problems == two.problems == []
    assert "world=16 dp=8 tp=2" in "\n".join(two.summary)
    opt = [float(re.search(r"optimizer ([0-9.]+)", "\n".join(r.summary)).group(1))
           for r in (one, two)]
    assert opt[1] == pytest.approx(opt[0] / 2, abs=0.05)


def test_moe_memory_shards_expert_optimizer_over_dp_over_ep():
    """Qwen3-30B-A3B at EP8: each GPU holds 16 experts x 48 layers (3.62 B parameters) plus
    the 1.54 B dense ones; the expert optimizer state is sharded over dp / ep ranks, the
    dense one over dp, so 4 nodes (dp 32, expert-dp 4) halve the expert share of 2 nodes."""
    from engine.config.recipe_validation import estimate_memory
    from parallel.layout import ParallelLayout

    cfg = load(REPO_ROOT / "recipes" / "sft" / "qwen3_30b_a3b_h100.yaml")
    hf = MODEL_SHAPES["qwen3-30b-a3b"]
    experts = stage_parameters(hf, 1, 1, 8).expert_stage
    dense = stage_parameters(hf, 1, 1, 8).first_stage - experts
    assert experts == 48 * 16 * 3 * 2048 * 768
    for world in (16, 32):
        layout = ParallelLayout(world, ep=8)
        mem = estimate_memory(hf, layout, cfg.train, True, True, 8)
        expected = (dense * 12 / world + experts * 12 / (world // 8)) / 2 ** 30
        assert mem.optimizer == pytest.approx(expected, rel=1e-12)
        assert mem.weights == pytest.approx((dense + experts) * 2 / 2 ** 30, rel=1e-12)


def test_validation_reports_every_problem(tmp_path):
    from tools.tiny_models import build_tiny_model

    qwen3 = REPO_ROOT / "recipes" / "sft" / "qwen3_8b_h100.yaml"
    bad = validate_recipe(load(qwen3, "parallel.tp=3", "train.seq_length=0"), 8, 1)
    assert any("train.seq_length=0" in p for p in bad.problems)
    assert any("not divisible by parallel.tp x parallel.pp x parallel.cp" in p
               for p in bad.problems)
    assert validate_recipe(load(qwen3), 12, 8).problems == [
        "world size 12 is not a positive multiple of --nodes 8"]
    big = validate_recipe(load(qwen3, "parallel.tp=1"), 8, 1)
    assert any("exceeds recipe.gpu_memory_gib=79.6" in p for p in big.problems), big
    stale = validate_recipe(load(qwen3, "recipe.expected_memory_gib=30"), 8, 1)
    assert any("recipe.expected_memory_gib=30.0 but the estimate" in p for p in stale.problems)
    cross = validate_recipe(load(REPO_ROOT / "recipes" / "sft" / "llama31_70b_h100.yaml"), 64,
                            16)
    assert any("tp x cp = 8 does not fit inside one node of 4 GPUs" in w for w in cross.warnings)
    tiny = build_tiny_model(str(tmp_path / "tiny"), "qwen3", vocab_size=200, tokenizer=False)
    mismatch = validate_recipe(load(qwen3, f"model.hf_path={tiny}",
                                    f"data.train_files=[{tmp_path / 'missing.jsonl'}]"), 8, 1)
    assert any("model.shape=qwen3-8b does not match model.hf_path: hidden_size 4096" in p
               for p in mismatch.problems), mismatch.problems
    assert any("data.train_files: file not found" in p for p in mismatch.problems)
    unknown = validate_recipe(load(qwen3, "model.shape=gpt-5"), 8, 1)
    assert any("model.shape='gpt-5' is not a known preset" in p for p in unknown.problems)


def _validate_cli(*args):
    """`python -m engine.sft ARGS` (a --validate check), in this process (run_cli)."""
    from tests.launch import run_cli

    return run_cli("engine.sft", *args)


def test_validate_cli_exit_codes():
    ok = _validate_cli("--config", "recipes/sft/qwen3_8b_h100.yaml", "--validate",
                       "--world-size", "16", "--nodes", "2")
    assert ok.returncode == 0, ok.stderr
    assert "world=16 dp=8 tp=2 pp=1 cp=1 on 2 node(s) x 8 GPUs" in ok.stdout
    assert "16 micro-batches per DP rank per step" in ok.stdout
    assert "recipe OK for world size 16 on 2 node(s)" in ok.stdout
    bad = _validate_cli("--config", "recipes/sft/llama31_70b_h100.yaml", "--validate",
                        "--world-size=48", "--nodes", "6")
    assert bad.returncode == 2
    assert "recipe INVALID for world size 48 on 6 node(s)" in bad.stderr
    assert "world size 48 is not divisible by parallel.tp x parallel.pp x parallel.cp" in \
        bad.stderr
