"""LoRA in `--validate` (models.estimate.lora_memory, models.estimate.lora; docs/lora.md#memory):
adapter counts against peft and by hand (TP, PP, experts over EP), the SFT memory estimate of
a small case worked out by hand, the RL estimate without a KL reference copy, the recipes.
Single process, no process group."""
from __future__ import annotations

import pytest

from models.estimate.training_memory import GIB
from engine.config.recipe_validation import estimate_memory, validate_recipe
from engine.config.schema import SFTConfig, load_config
from models.estimate.counting import stage_parameters
from models.lora.adapters import LoraSpec
from models.estimate.lora import adapter_parameters
from models.lora.sites import resolve_targets
from parallel.layout import ParallelLayout
from tests.launch import REPO_ROOT
from tools.tiny_models import build_tiny_model

ALL = resolve_targets("all-linear")
# h 64, q = 8 x 16 = 128, kv = 2 x 16 = 32, ffn 128, 4 layers
DENSE = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 4, "vocab_size": 256, "tie_word_embeddings": False,
         "max_position_embeddings": 4096}
MOE = {**DENSE, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8,
       "num_experts_per_tok": 2, "num_hidden_layers": 2, "decoder_sparse_step": 1,
       "mlp_only_layers": []}


def test_adapter_count_equals_peft(tmp_path):
    """The unsharded count is peft's number of trainable parameters on the HF model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = build_tiny_model(str(tmp_path / "m"), "qwen3", tokenizer=False)
    hf = AutoConfig.from_pretrained(model_dir)
    for targets in ("all-linear", ["q_proj", "v_proj"], ["o_proj", "down_proj", "up_proj"]):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert adapter_parameters(hf, resolve_targets(targets), 4, 1, 1).total == trainable


def test_glm4_moe_count_equals_peft_as_peft_converts_the_names(tmp_path):
    """GLM-4.5: peft 0.21 on transformers 5 reads all-linear and gate_proj / up_proj /
    down_proj on glm4_moe as the fused routed experts (gate_up_proj at rank 2r) and, for
    all-linear, the router (target_parameters), never the dense layer's or the shared
    expert's MLP; the count of what model.lora.* resolves to (engine.config.lora_family)
    equals peft's trainable parameters for each, per-module ranks included (so a peft that
    reads the names otherwise shows up here)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config.lora_family import family_spec
    from tests.glm4_moe_tiny import build_glm4_moe

    model_dir = build_glm4_moe(str(tmp_path / "glm"), tokenizer=False, mtp=False)
    hf = AutoConfig.from_pretrained(model_dir)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    for targets, parameters in ((attention, {"gate_up_proj", "down_proj", "gate.weight"}),
                                ("all-linear", {"gate_up_proj", "down_proj", "gate.weight"}),
                                (["gate_proj", "up_proj", "down_proj"],
                                 {"gate_up_proj", "down_proj"})):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        spec = family_spec(hf.to_dict(), 4, 8.0, targets)
        assert adapter_parameters(hf, spec.targets, spec, 1, 1).total == trainable, targets
        config = model.peft_config["default"]
        if targets != attention:
            assert set(config.target_parameters) == parameters
            assert set(config.target_modules) == set(attention) & set(spec.targets)


def test_adapter_counts_by_hand():
    r, h, q, kv, ffn = 4, 64, 128, 32, 128
    # TP2: column slices A [r, h] whole, B [out / 2, r]; row A [r, in / 2], B [h, r] whole
    layer = ((r * h + r * q // 2) + 2 * (r * h + r * kv // 2) + (r * q // 2 + r * h)
             + 2 * (r * h + r * ffn // 2) + (r * ffn // 2 + r * h))
    assert layer == 3200   # the tiny model's TP2 rank in tests/multirank/lora_rl_check.py
    tp2 = adapter_parameters(DENSE, ALL, r, 2, 1)
    assert tp2.first_stage == tp2.last_stage == 4 * layer and tp2.expert_first == 0
    assert adapter_parameters(DENSE, ALL, r, 2, 2).first_stage == 2 * layer
    # MoE: all-linear adapts only attention there (gate/up/down name experts: as peft)
    attention = (r * h + r * q // 2) + 2 * (r * h + r * kv // 2) + (r * q // 2 + r * h)
    assert adapter_parameters(MOE, ALL, r, 2, 1).first_stage == 2 * attention
    # experts at tp2 x ep2: 4 local experts per layer, each gate_up_proj A [r, h], B
    # [2 x 32 / 2, r] (peft's target_parameters: one adapter on the fused [gate; up]), down
    # A [r, 32 / 2], B [h, r]
    expert = (r * h + r * 32) + (r * 16 + r * h)
    both = adapter_parameters(MOE, ALL | {"experts"}, r, 2, 1, ep=2)
    assert both.expert_first == 2 * 4 * expert == 5632
    assert both.first_stage == 2 * attention + 5632


def _train(**keys):
    cfg, _ = load_config(SFTConfig, [f"train.{k}={v}" for k, v in keys.items()])
    return cfg.train


def test_sft_estimate_by_hand_tp2_sp_dp2():
    """bf16, distributed optimizer, tp2 (SP) x dp2, 1024-token micro-batches, no recompute:
    the frozen base keeps its bf16 weights only, the adapters add their bf16 weights, fp32
    gradients, 12 bytes / dp of optimizer state, and per layer and token r per column slice
    (5, gathered over the sequence) and r / tp per row slice (2); no gathered input (the
    column adapters gather A x, not x)."""
    layout = ParallelLayout(4, tp=2, sequence_parallel=True)
    train = _train(micro_batch_size=1, seq_length=1024)
    spec = LoraSpec(4, 8.0, ALL)
    full = estimate_memory(DENSE, layout, train, True, True, 8)
    lora = estimate_memory(DENSE, layout, train, True, True, 8, spec)
    base, adapters = stage_parameters(DENSE, 2, 1).first_stage, 12800
    assert base == 107200
    assert lora.weights == pytest.approx((base + adapters) * 2 / GIB)
    assert lora.grads == pytest.approx(adapters * 4 / GIB)
    assert lora.optimizer == pytest.approx(adapters * 12 / 2 / GIB)
    assert full.optimizer == pytest.approx(base * 12 / 2 / GIB)   # the control: everything
    assert lora.activations - full.activations == pytest.approx(
        4 * 2 * 1024 * (4 * 5 + 4 * 2 / 2) / GIB)
    assert (lora.logits, lora.runtime) == (full.logits, full.runtime)
    assert lora.notes["adapter_parameters"] == adapters and lora.notes["base_parameters"] == base


def test_sft_validate_reports_and_checks_lora(tmp_path):
    recipe = REPO_ROOT / "recipes" / "sft" / "qwen3_8b_lora_h100.yaml"
    cfg, _ = load_config(SFTConfig, ["--config", str(recipe)])
    report = validate_recipe(cfg, 1, 1)
    assert report.problems == []
    text = "\n".join(report.summary)
    assert "43.6 M adapter parameters trained (0.53 % of the model)" in text
    # Qwen3-8B r16 all-linear: 36 x 1,212,416 adapters (peft's 43,646,976)
    grads = 36 * 1_212_416 * 4 / GIB
    assert report.data["memory_gib"]["grads"] == pytest.approx(grads)
    assert report.data["memory_gib"]["optimizer"] == pytest.approx(3 * grads)
    cfg.model.lora.rank = 0   # the control: full fine-tuning does not fit one GPU
    assert any("exceeds recipe.gpu_memory_gib" in p for p in validate_recipe(cfg, 1, 1).problems)
    cfg.model.lora.rank, cfg.model.lora.target_modules = 16, ["experts"]
    assert any("adapts ['experts.down_proj', 'experts.gate_up_proj'], but the model has no MoE"
               in p for p in validate_recipe(cfg, 1, 1).problems)


def test_rl_validate_counts_no_reference_copy_under_lora(capsys):
    from engine.rl.recipe_check import rl_validate_main

    recipe = str(REPO_ROOT / "recipes" / "rl" / "qwen3_30b_a3b_lora_grpo_h100.yaml")
    assert rl_validate_main(["--config", recipe, "--validate"]) == 0
    out = capsys.readouterr().out
    assert "KL reference 0.0 (the policy's frozen base, adapters off)" in out
    assert "recipe OK on 1 node(s) x 8 GPUs" in out
    assert "on k_proj, o_proj, q_proj, v_proj: 26.7 M adapter parameters" in out
    # tp2: 48 layers x (q 32 x 2048 + 32 x 4096 / 2, k and v 32 x 2048 + 32 x 512 / 2,
    # o 32 x 4096 / 2 + 32 x 2048) adapters; grads 4 bytes, Adam 12 / dp 4
    adapters = 48 * (131072 + 2 * 73728 + 131072)
    assert f"grads {adapters * 4 / GIB:.1f} + optimizer {adapters * 3 / GIB:.1f}" in out
    # the control: full-parameter GRPO at this layout holds a reference copy of the policy
    # (bf16 weights 8.2 GiB per GPU), full gradients and Adam state: it does not fit one node
    assert rl_validate_main(["--config", recipe, "--validate", "model.lora.rank=0"]) == 2
    captured = capsys.readouterr()
    assert "(weights 8.2 + grads 16.4 + optimizer 42.7" in captured.out
    assert "+ KL reference 8.2 = 81.9" in captured.out
    assert "estimated peak memory per GPU 127.2 GiB exceeds" in captured.err


@pytest.mark.parametrize("moe, targets", [
    (False, "all-linear"), (False, ["q_proj", "in_proj_qkv", "in_proj_b", "out_proj"]),
    (True, ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
            "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"])])
def test_qwen3_5_count_equals_peft(tmp_path, moe, targets):
    """Qwen3.5 (Gated DeltaNet layers, gated attention whose q_proj carries the output gate;
    MoE: gate/up/down are the shared expert's): the count equals peft's trainable parameters,
    and the modules peft adapts are the family's names (Family.lora_targets), so all-linear
    means the same on both sides. Negative control: counting q_proj without its gate rows
    misses parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.families.registry import FAMILIES
    from tests.qwen3_5_tiny import build_qwen3_5

    model_dir = build_qwen3_5(str(tmp_path / "q"), moe=moe, tokenizer=False)
    hf = AutoConfig.from_pretrained(model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_parameters(hf, resolve_targets(targets), 4, 1, 1).total == trainable
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[1] for n, _ in model.named_parameters()
               if ".lora_A" in n}
    family = FAMILIES[hf.model_type]
    assert adapted == (set(family.lora_targets) if targets == "all-linear" else set(targets))
    if targets != "all-linear" and "q_proj" in targets:   # 1 attention layer of 4
        q_only = adapter_parameters(hf, frozenset({"q_proj"}), 4, 1, 1).total
        assert q_only == 4 * 64 + 4 * 2 * 4 * 16 != 4 * 64 + 4 * 4 * 16   # the gate rows count


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_deepseek_v3_mla_count_equals_peft_and_shards_by_hand(tmp_path, q_lora_rank):
    """DeepSeek-V3 (MLA): the count of the MLA adapters equals peft's trainable parameters
    (q_a_proj / q_b_proj, or q_proj when q_lora_rank is null); at TP2 the replicated down
    projections' adapters stay whole and only the up projections' B and o_proj's A halve."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.deepseek_v3_tiny import build_deepseek_v3

    model_dir = build_deepseek_v3(str(tmp_path / "ds"), tokenizer=False, mtp=False,
                                  q_lora_rank=q_lora_rank)
    hf = AutoConfig.from_pretrained(model_dir)
    q = ["q_a_proj", "q_b_proj"] if q_lora_rank else ["q_proj"]
    targets = q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_parameters(hf, resolve_targets(targets), 4, 1, 1).total == trainable
    # h 64, 4 heads, nope/rope/v 16/8/12, kv_lora_rank 16; per layer at TP2:
    kv = 4 * 64 + 4 * (16 + 8) + 4 * 16 + 4 * 4 * (16 + 12) // 2 + 4 * 4 * 12 // 2 + 4 * 64
    qpart = (4 * 64 + 4 * 32 + 4 * 32 + 4 * 4 * 24 // 2) if q_lora_rank else \
        (4 * 64 + 4 * 4 * 24 // 2)
    assert adapter_parameters(hf, resolve_targets(targets), 4, 2, 1).first_stage == \
        2 * (kv + qpart)


def test_expert_adapter_count_equals_peft_target_parameters(tmp_path):
    """Qwen3-MoE with the attention and `experts`: the count equals peft's trainable
    parameters with target_parameters (mlp.experts.gate_up_proj / down_proj: one adapter per
    expert on the fused [gate; up], one on down), and the expert share is the experts'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.estimate.lora import stage_adapters

    model_dir = build_tiny_model(str(tmp_path / "m"), "qwen3_moe", tokenizer=False)
    hf = AutoConfig.from_pretrained(model_dir)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=attention,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(p.numel() for n, p in model.named_parameters()
                  if p.requires_grad and ".experts." in n)
    count = adapter_parameters(hf, frozenset(attention + ["experts"]), 4, 1, 1)
    assert count.total == trainable and count.expert_first == count.expert_last
    assert stage_adapters(hf, frozenset({"experts"}), 4, 1, 1, 1, 0)[1] == experts
