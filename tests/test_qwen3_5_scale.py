"""Qwen3.5 at scale, static checks (no processes, no weights): parameter counts of the Gated
DeltaNet hybrids (models.layers.gated_delta_net.costs via models.estimate.counting) against
transformers' own models built on the meta device, for the tiny test shapes and the published
presets (models.families.qwen3_5.presets); the memory estimate and the communication plan of
GDN layers worked out by hand for Qwen3.5-9B at TP2 (engine.config.recipe_validation,
models.estimate.memory, models.estimate.comm); the layout check of GDN heads.
"""
import pytest
import torch

from models.estimate.comm import CommSetup, comm_plan
from models.estimate.training_memory import GIB
from engine.config.recipe_validation import estimate_memory
from engine.config.schema import SFTConfig, load_config
from models.families.registry import family_of, model_presets
from models.estimate.counting import padded_vocab_size, stage_parameters
from parallel.layout import ParallelLayout
from tests.launch import REPO_ROOT
from tests.qwen3_5_tiny import COMMON, MOE

PRESETS = model_presets()
# replicated over TP: norms (zero-centred decoder/q/k norms, the GDN gated norm), the router,
# the shared expert's gate; everything else of a layer is split over TP
REPLICATED = ("layernorm", "q_norm", "k_norm", "linear_attn.norm", "mlp.gate.weight",
              "shared_expert_gate")


def _meta_model(values: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config.to_dict(), {n: p.numel() for n, p in model.named_parameters()}


def _tiny(moe: bool, **extra) -> dict:
    kind = dict(model_type="qwen3_5_moe_text", **MOE) if moe else dict(
        model_type="qwen3_5_text", intermediate_size=128)
    return dict(COMMON, **kind, **extra)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tiny_counts_and_stage_splits_equal_transformers(moe):
    """Total, the PP2 split and the TP2 x EP2 split of the tiny hybrids from transformers'
    parameter names; negative control: an all-attention layout counts differently (and
    transformers agrees with that count too)."""
    cfg, sizes = _meta_model(_tiny(moe))
    assert cfg["layer_types"].count("linear_attention") == 3
    assert stage_parameters(cfg, 1, 1).total == sum(sizes.values())
    h, pad = cfg["hidden_size"], (padded_vocab_size(200) - 200) * cfg["hidden_size"]
    layer = {n: int(n.split(".")[2]) for n in sizes if n.startswith("model.layers.")}
    first = sum(v for n, v in sizes.items() if layer.get(n, 2) < 2 or "embed" in n)
    last = sum(v for n, v in sizes.items() if layer.get(n, -1) >= 2 or "lm_head" in n
               or n == "model.norm.weight")
    split = stage_parameters(cfg, 1, 2)
    assert (split.first_stage, split.last_stage) == (first + pad, last + pad)
    body = {n: v for n, v in sizes.items() if n in layer}
    expert = sum(v for n, v in body.items() if ".mlp.experts." in n)
    replicated = sum(v for n, v in body.items() if any(r in n for r in REPLICATED))
    sharded = sum(body.values()) - expert - replicated
    tp_ep = stage_parameters(cfg, 2, 1, 2)
    assert tp_ep.expert_stage == expert // 4
    assert tp_ep.first_stage == (sharded // 2 + replicated + expert // 4
                                 + 2 * padded_vocab_size(200, 2) * h // 2 + h)
    control, control_sizes = _meta_model(_tiny(moe, layer_types=["full_attention"] * 4))
    assert stage_parameters(control, 1, 1).total == sum(control_sizes.values())
    assert sum(control_sizes.values()) != sum(sizes.values())


@pytest.mark.parametrize("name,total,active", [
    ("qwen3.5-9b", 8_953_803_264, 8_953_803_264),
    ("qwen3.5-35b-a3b", 34_660_610_688, 3_454_988_928),
    ("qwen3.5-122b-a10b", 122_111_526_912, 9_771_288_576)])
def test_published_presets_count_as_transformers(name, total, active):
    from models.hf.config import config_problems

    preset = PRESETS[name]
    assert config_problems(preset) == []
    counts = stage_parameters(preset, 1, 1)
    assert (counts.total, counts.active) == (total, active)
    _, sizes = _meta_model(preset)
    assert sum(sizes.values()) == total


def _load(name, *overrides):
    cfg, _ = load_config(SFTConfig, ["--config", str(REPO_ROOT / "recipes" / "sft" / name),
                                     *overrides])
    return cfg


def test_memory_estimate_by_hand_qwen3_5_9b_tp2_dp4():
    """Activations: 24 GDN layers (projections, conv input and output, fp32 rule inputs,
    fp32 state per 64-token chunk, intra-chunk matrix, outputs) and 8 gated attention layers,
    averaged; logits: the chunked head (three fp32 [1024, V/2] buffers and the fp32 weight
    gradient and its bf16 cast), and unchunked as a control."""
    hf = PRESETS["qwen3.5-9b"]
    cfg = _load("qwen3_5_9b_h100.yaml")
    mem = estimate_memory(hf, ParallelLayout(8, tp=2), cfg.train, bf16=True,
                          distributed_optimizer=True, micro_batches=32)
    h, ffn, t, vocab = 4096, 12288, 4096, 248320
    kd, vd, nv, dk, dv = 2048, 4096, 32, 128, 128
    gdn = (2 * ((2 * kd + 2 * vd + 2 * nv) + 2 * (2 * kd + vd) + 2 * vd)
           + 4 * (nv * (2 * dk + dv + 2) + nv * dk * dv / 64 + nv * 64)) / 2
    assert gdn == 82112
    q, kv = 16 * 256, 4 * 256
    attention = 2 * (q + 2 * q + q + 2 * kv) / 2 + 2 * 2 * q / 2
    per_layer = t * (2 * (4 * h + 3 * ffn / 2) + (24 * gdn + 8 * attention) / 32)  # no SP
    assert mem.activations == pytest.approx(32 * per_layer / GIB)
    assert mem.logits == pytest.approx(12 * 1024 * vocab / 2 / GIB)   # bf16: no head buffer
    unchunked = estimate_memory(hf, ParallelLayout(8, tp=2),
                                _load("qwen3_5_9b_h100.yaml", "train.loss_chunk_tokens=0").train,
                                True, True, 32)
    assert unchunked.logits == pytest.approx(t * vocab / 2 * 14 / GIB)
    assert unchunked.logits > mem.logits + 2  # GiB: the whole micro-batch's fp32 logits


def test_comm_plan_by_hand_qwen3_5_9b_tp2_cp2():
    """CP: GDN layers exchange q, k, v, beta, decay and the output (not GQA's q, k, v, o);
    TP+SP: every layer two linear blocks, the GDN output norm's per-micro-batch all-reduce,
    the SP-tagged norms (q/k norms on attention layers only) once per step."""
    hf = PRESETS["qwen3.5-9b"]
    layout = ParallelLayout(8, tp=2, cp=2, sequence_parallel=True)
    plan = comm_plan(hf, layout, CommSetup(tokens_per_micro_batch=8192, micro_batches=3))
    a, big_t, h, m = 2, 4096, 4096, 3
    gdn_fwd = big_t * (2 * 2048 + 2 * 4096 + 2 * 32) / 2 * a
    att_fwd = big_t * (2 * 8 + 2 * 2) * 256 * a
    assert plan.per_gpu["cp_exchange"] == m * 2 * (24 * gdn_fwd + 8 * att_fwd)
    block = 3 * big_t * h * a / 2 + 2 * big_t * h * a
    micro = (32 * 2 * block + 24 * 128 * a + big_t * h * a + big_t * h * a / 2
             + big_t * h * a / 2 + big_t * h * a + 3 * big_t * 4)
    once = (32 * 2 * h + 8 * 2 * 256 + h) * 4
    assert plan.per_gpu["tp_sp"] == pytest.approx(m * micro + once, rel=1e-12)


def test_gdn_heads_must_divide_tp_x_cp():
    preset = PRESETS["qwen3.5-9b"]
    fam = family_of(preset)
    assert fam.layout_problems(preset, 2, 8) == []
    assert fam.layout_problems(preset, 2, 16) == [
        "linear_num_key_heads=16 is not divisible by parallel.tp x parallel.cp = 2 x 16: "
        "Gated DeltaNet layers split their heads over both"]
