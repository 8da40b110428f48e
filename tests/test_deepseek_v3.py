"""DeepSeek-V3 (`deepseek_v3`: MLA + sigmoid-routed MoE; Kimi-K2, Moonlight) on the tiny models
of tests/deepseek_v3_tiny.py ("lora": 2 layers, q_lora_rank 32, YaRN with mscale; "qproj": 4
layers (1 dense), q_lora_rank null, rope_interleave false, default RoPE):

- FP8 blocks (models.formats.fp8): dequantize = fp8 x scale of its block in fp32 (ragged
  edges); re-quantizing with the source scales gives the same bytes, from fp32 or bf16; a
  float8 tensor without a scale is refused; other quantization configs are refused by name;
- refusals name the field; parameter counts equal transformers' (the tiny models per stage,
  both presets whole: DeepSeek-V3 671.0 B of which 37.5 B active; Moonlight 16.0 B);
- megatron's logits equal transformers' (fp32) for both models; negative controls: the softmax
  scale without mscale, the latent norms with rms_norm_eps, unpermuted rope rows;
- one MLA layer at TP2 + SP equals one rank (output and gradients); negative control:
  megatron's local spec as it comes (column-parallel down projections);
- hf-to-mcore -> mcore-to-hf is bitwise (MTP layer included); `verify` at TP2, PP2 (a dense
  stage and a MoE stage; for "qproj" a dense + MoE stage and a MoE stage) and EP2 within 1e-4
  of transformers;
- an FP8 checkpoint (block-scaled e4m3, MTP in FP8 too): `verify` against its dequantized
  reference; exported as bf16 by default (the dequantized values rounded, other tensors in
  their source dtype, no quantization_config); with --quantize fp8 bitwise the input;
- the SFT invariance harness with the bias update on (tests/multirank/glm4_moe_check.py):
  TP2+SP, TP2+SP with full recompute, EP2, PP2, CP2, packing, CP2+packing (and TP2+SP, PP2,
  CP2+packing for "qproj") equal the single process (rel 1e-5); negative control: per-rank
  bias counts;
- GRPO with the HF rollout backend at TP2 + SP: rollout/logprob_diff < 1e-3, weight sync exact.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.deepseek_v3_tiny import build_deepseek_v3, build_fp8, dequantized_reference
from tests.launch import result_lines

CONVERT = "tools/convert.py"
CHECK = "tests.multirank.deepseek_v3_check"
HARNESS = "tests/multirank/glm4_moe_check.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    qproj = dict(q_lora_rank=None, rope_interleave=False, mtp=False, num_hidden_layers=4,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return {"lora": build_deepseek_v3(str(root / "lora")),
            "qproj": build_deepseek_v3(str(root / "qproj"), **qproj)}


def _tensors(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, dtype included (float8 compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def test_fp8_blocks_dequantize_and_requantize_exactly():
    from models.formats.fp8 import FP8_DTYPE, dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * 0.05
    q, scale = quantize(w, (128, 128))
    assert q.dtype == FP8_DTYPE and tuple(scale.shape) == (3, 2)   # ragged 300 x 200
    deq = dequantize(q, scale, (128, 128))
    loop = torch.empty(300, 200)
    for i in range(3):
        for j in range(2):
            block = q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            loop[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = block * scale[i, j]
    assert torch.equal(deq, loop)
    assert (deq - w).abs().max() <= 0.07 * w.abs().max()     # e4m3: 3 mantissa bits
    for copy in (deq, deq.to(torch.bfloat16)):
        q2, s2 = quantize(copy, (128, 128), scale)
        assert _same(q2, q) and torch.equal(s2, scale)
    grown = deq.clone()
    grown[0, 0] = 2 * deq.abs().max() / scale[0, 0] * scale[0, 0]    # block (0, 0) overflows
    _, s3 = quantize(grown, (128, 128), scale)
    assert s3[0, 0] > scale[0, 0] and torch.equal(s3[1:], scale[1:])


def test_quantization_refusals_and_unscaled_fp8():
    from models.families.base import UnmappedTensorsError
    from models.formats.quantized import DequantizingReader, quantization_problem
    from models.hf.quantized_export import export_tensors

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}
    assert quantization_problem({"quantization_config": fp8}) is None
    wrong = {"quant_method='awq'": {"quant_method": "awq"},
             "fmt='e5m2'": dict(fp8, fmt="e5m2"),
             "scale_fmt='ue8m0'": dict(fp8, scale_fmt="ue8m0"),
             "activation_scheme='static'": dict(fp8, activation_scheme="static"),
             "weight_block_size=None": dict(fp8, weight_block_size=None)}
    for name, qcfg in wrong.items():
        assert name in quantization_problem({"quantization_config": qcfg}), name

    class Reader:
        def keys(self):
            return ["w"]

        def get(self, name):
            return torch.zeros(2, 2, dtype=torch.float8_e4m3fn)

    with pytest.raises(UnmappedTensorsError, match="without a scale"):
        DequantizingReader(Reader(), {"model_type": "deepseek_v3"}).get("w")
    with pytest.raises(ValueError, match="source is unquantized"):   # --quantize fp8
        export_tensors({}, {"model_type": "deepseek_v3"}, "/nonexistent", "fp8")


def test_refusals_name_the_field(models):
    from models.hf.config import config_problems
    from models.hf.io import read_config

    cfg = read_config(models["lora"])
    assert config_problems(cfg) == [] and config_problems(read_config(models["qproj"])) == []
    wrong = {"num_key_value_heads": dict(num_key_value_heads=2),
             "attention_bias": dict(attention_bias=True),
             "moe_layer_freq": dict(moe_layer_freq=2),
             "q_lora_rank": dict(q_lora_rank=0),
             "qk_rope_head_dim": dict(qk_rope_head_dim=7),
             "quant_method": dict(quantization_config={"quant_method": "gptq"}),
             "partial_rotary_factor": dict(rope_parameters=dict(
                 rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
             "rope_type": dict(rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                    rope_theta=1e4)),
             "n_group": dict(n_group=4, topk_group=1),
             "scoring_func": dict(scoring_func="softmax")}
    for name, values in wrong.items():
        assert any(name in p for p in config_problems(dict(cfg, **values))), name


def test_parameter_counts_equal_transformers(models):
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.families.registry import model_presets
    from models.estimate.counting import padded_vocab_size, stage_parameters
    from models.hf.io import read_config

    for kind in ("lora", "qproj"):
        cfg = read_config(models[kind])
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models[kind]))
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        counts, half = stage_parameters(cfg, 1, 2), cfg["num_hidden_layers"] // 2
        assert stage_parameters(cfg, 1, 1).total == sum(sizes.values())
        layer = {n: int(n.split(".")[2]) for n in sizes if n.startswith("model.layers.")}
        first = sum(v for n, v in sizes.items() if layer.get(n, half) < half or "embed" in n)
        last = sum(v for n, v in sizes.items() if layer.get(n, -1) >= half or "lm_head" in n
                   or n == "model.norm.weight")
        pad = (padded_vocab_size(cfg["vocab_size"]) - cfg["vocab_size"]) * cfg["hidden_size"]
        assert (counts.first_stage, counts.last_stage) == (first + pad, last + pad)
    v3 = stage_parameters(model_presets()["deepseek-v3"], 1, 1)
    moonlight = stage_parameters(model_presets()["moonlight-16b-a3b"], 1, 1)
    assert (v3.total, v3.active) == (671_026_404_352, 37_552_282_624)
    assert (moonlight.total, moonlight.active) == (15_960_108_544, 2_914_774_528)
    preset = dict(model_presets()["deepseek-v3"])   # transformers' own count, on meta
    preset.pop("quantization_config")
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(preset.pop("model_type"), **preset))
    assert sum(p.numel() for p in whole.parameters()) == v3.total


def test_logits_equal_transformers_with_controls(pools, models):
    [lora] = pools.run(1, f"{CHECK}:logits_parity", models["lora"])
    [qproj] = pools.run(1, f"{CHECK}:logits_parity", models["qproj"])
    for r in (lora, qproj):
        assert r["max_abs"] < 1e-4 and r["norm_eps"] > 1e-2, r
    assert lora["no_mscale"] > 1e-2 and qproj["no_permute"] > 1e-2


def test_mla_tp_sp_layer_with_control(pools, models):
    r = pools.run(2, f"{CHECK}:mla_tp_sp", models["lora"])[0]
    assert r["out_rel"] < TOL and r["grad_rel"] < TOL and r["control_grad_rel"] > 1e-2, r


def test_convert_round_trip_and_verify(pools, models, tmp_path):
    for kind, layouts in (("lora", (("--tp", "2"), ("--pp", "2"), ("--ep", "2"))),
                          ("qproj", (("--tp", "2"), ("--pp", "2")))):
        ckpt, out = tmp_path / kind / "ckpt", tmp_path / kind / "hf"
        pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", models[kind], "--out", str(ckpt))
        pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
        a, b = _tensors(models[kind]), _tensors(out)
        assert sorted(a) == sorted(b) and all(_same(a[n], b[n]) for n in a), kind
        for layout in layouts:
            assert _verify(pools, models[kind], ckpt, *layout) < 1e-4, (kind, layout)
    assert "model.layers.2.eh_proj.weight" in _tensors(tmp_path / "lora" / "hf")  # MTP


def _verify(pools, hf_dir, ckpt, *layout) -> float:
    proc = pools.script(2 if layout else 1, CONVERT, "verify", "--hf-dir", str(hf_dir),
                        "--ckpt", str(ckpt), "--seq-len", "40", *layout)
    line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
    return float(line.split("max_abs_diff=")[1].split()[0])


def test_fp8_checkpoint_loads_exports_and_requantizes(pools, models, tmp_path):
    fp8 = build_fp8(models["lora"], str(tmp_path / "fp8"))
    ref = dequantized_reference(fp8, str(tmp_path / "ref"))
    ckpt, bf16, again = tmp_path / "ckpt", tmp_path / "bf16", tmp_path / "again"
    pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", fp8, "--out", str(ckpt))
    assert _verify(pools, ref, ckpt) < 1e-4
    pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(bf16))
    pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(again),
                 "--quantize", "fp8")
    source, requantized = _tensors(fp8), _tensors(again)
    assert sorted(source) == sorted(requantized)
    assert all(_same(source[n], requantized[n]) for n in source)
    assert json.loads((again / "config.json").read_text())["quantization_config"]
    plain, expected = _tensors(bf16), _tensors(ref)
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    for name, tensor in expected.items():
        stored = source[name]
        want = tensor.to(torch.bfloat16) if stored.dtype == torch.float8_e4m3fn else stored
        assert _same(plain[name], want), name
    mtp = "model.layers.2.self_attn.kv_b_proj.weight"   # an FP8 MTP weight, dequantized
    assert plain[mtp].dtype == torch.bfloat16 and mtp + "_scale_inv" not in plain


BIAS = "bias=0.01+modes=token-mean"
SPECS = {"lora": [f"2,1,0,1,16,sp+{BIAS}", f"2,1,0,1,3,sp+recompute=full+{BIAS}",
                  f"1,1,0,1,4,ep=2+{BIAS}", f"1,2,0,1,4,{BIAS}",
                  f"1,1,0,2,16,{BIAS}", f"1,1,0,1,16,packing+{BIAS}",
                  f"1,1,0,2,16,packing+{BIAS}"],
         "qproj": [f"2,1,0,1,16,sp+{BIAS}", f"1,2,0,1,4,{BIAS}", f"1,1,0,2,16,packing+{BIAS}"]}
CONTROLS = {"lora": [f"1,1,0,1,16,bug=localbias+{BIAS}"], "qproj": []}


@pytest.mark.parametrize("kind", ["lora", "qproj"])
def test_invariance_with_bias_update(pools, models, tmp_path, kind):
    ref = str(tmp_path / "ref.pt")
    env = {"INV_ADAM_EPS": "1e-3"}
    first = pools.script(1, HARNESS, models[kind], ref, f"1,1,0,1,16,{BIAS}", env=env,
                         timeout=900)
    assert result_lines(first.stdout)[0]["reference"]
    proc = pools.script(2, HARNESS, models[kind], ref, *SPECS[kind], *CONTROLS[kind], env=env,
                        timeout=900)
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert len(results) == len(SPECS[kind]) + len(CONTROLS[kind])
    for spec in SPECS[kind]:
        r = results[spec]
        assert r["loss_rel"] < TOL and r["grad_norm_rel"] < TOL and r["param_rel"] < TOL, r
    for spec in CONTROLS[kind]:
        assert results[spec]["param_rel"] > 1e-3, results[spec]


def test_grpo_with_hf_rollouts_at_tp2(pools, models, tmp_path):
    prompts = tmp_path / "add.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                           "answer": i % 10 + (3 * i + 1) % 10}) + "\n"
                               for i in range(16)))
    log_dir = tmp_path / "rl"
    pools.script(
        2, "-m", "engine.rl", f"model.hf_path={models['lora']}", f"data.train_files=[{prompts}]",
        "parallel.tp=2", "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4",
        "train.mini_batches_per_step=2", "train.micro_batch_size=2", "train.max_steps=2",
        "train.seq_length=64", "optim.lr=1e-3", "kl.beta=0.05",
        "reward.fn=tests.rl_rewards:digit_reward", "rollout.check_weight_sync=true",
        f"logging.dir={log_dir}", "logging.progress_bar=false", timeout=400)
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_diff"] < 1e-3, m
        assert m["debug/sync_logit_max_diff"] < 1e-4 and m["debug/sync_logit_change"] > 1e-2
        assert m["grad_norm"] > 0 and m["policy/kl"] > 0


def test_recipes_and_the_v3_rollout_engine_that_does_not_fit():
    """The Moonlight GRPO recipe validates; DeepSeek-V3 with the same rollout (one SGLang
    engine per node on H100s) is refused: bf16 updates to its FP8 engine by name
    (rollout.sync_quantization), and with FP8 sync its 78.4 GiB of FP8 weights per GPU do not
    fit mem_fraction 0.35 of an H100 (engines never span nodes; the H200 recipe:
    tests/test_rl_sync_quantization.py)."""
    from engine.config.loading import load_config
    from engine.rl.config import RLConfig
    from engine.rl.recipe_check import rl_recipe_report

    recipe = Path(__file__).resolve().parents[1] / "recipes/rl/moonlight_16b_a3b_grpo_h100.yaml"
    cfg, _ = load_config(RLConfig, ["--config", str(recipe)])
    summary, problems, _ = rl_recipe_report(cfg, 2, 8)
    assert problems == [] and any("68.1" in line for line in summary)
    cfg, _ = load_config(RLConfig, ["--config", str(recipe), "model.shape=deepseek-v3",
                                    "parallel.tp=8", "parallel.ep=64"])
    _, problems, _ = rl_recipe_report(cfg, 64, 8)
    assert any("set rollout.sync_quantization=fp8" in p for p in problems), problems
    cfg.rollout.sync_quantization = "fp8"
    _, problems, _ = rl_recipe_report(cfg, 64, 8)
    assert any("78.4 GiB per GPU" in p and "does not fit" in p for p in problems), problems
