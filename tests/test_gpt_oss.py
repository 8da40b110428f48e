"""gpt-oss (GptOssForCausalLM): the tiny model of tests/gpt_oss_tiny.py against transformers.

- config: the published configs (presets) map; refusals name the field; parameter counts
  (sinks, router and expert biases included) equal the HF model's;
- pieces against transformers' own code: the clamped SwiGLU (bitwise), sink + sliding-window
  attention (eager_attention_forward with HF's sliding mask; control: a window one key wider
  differs), MXFP4 dequantization (convert_moe_packed_tensors, bitwise), the fused expert
  layout (per-expert views and back, bitwise);
- conversion HF -> mcore -> HF bitwise; `verify` logits within 1e-4 of transformers at TP1,
  TP2, PP2 and EP2 (fp32); the MXFP4 form as published loads to transformers' dequantized
  model (verify against transformers reading the MXFP4 folder), exports bf16 by default and
  re-exports the same bytes with --quantize mxfp4;
- layouts (tests/multirank/gpt_oss_check.py): TP2+SP, EP2, PP2, CP2, packing, CP2+packing
  equal the single process (rel 1e-5); negative controls: a sliding window crossing a packed
  boundary, CP with the sink slice not following the Ulysses exchange;
- GRPO with the HF rollout backend at EP2 with R3 routing replay: rollout/logprob_diff
  < 1e-3, weight sync exact, the engine's routing is the trainer's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpt_oss_tiny import build_gpt_oss, quantize_experts
from tests.launch import result_lines

CONVERT = "tools/convert.py"
CHECK = "tests/multirank/gpt_oss_check.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = build_gpt_oss(str(root / "hf"))
    mxfp4, reference = quantize_experts(hf, str(root / "quantized"))
    return {"hf": Path(hf), "mxfp4": Path(mxfp4), "reference": Path(reference)}


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_presets_map_and_refusals_name_the_field(models):
    from models.families.gpt_oss import GptOss
    from models.hf.config import config_problems

    cfg = json.loads((models["hf"] / "config.json").read_text())
    assert config_problems(cfg) == [] and config_problems(
        json.loads((models["mxfp4"] / "config.json").read_text())) == []
    assert all(config_problems(p) == [] for p in GptOss.presets.values())
    wrong = {"quant_method": dict(cfg, quantization_config={"quant_method": "fp8"}),
             "layer_types": dict(cfg, layer_types=["sliding_attention", "linear_attention"] * 2),
             "sliding_window": dict(cfg, sliding_window=None),
             "swiglu_limit": dict(cfg, swiglu_limit=0.0),
             "rope_type": dict(cfg, rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                         rope_theta=1e4))}
    for name, bad in wrong.items():
        assert any(name in p for p in config_problems(bad)), name


def test_parameter_counts_include_sinks_and_biases(models):
    from transformers import AutoModelForCausalLM

    from models.estimate.counting import stage_parameters
    from models.families.gpt_oss import GptOss

    cfg = json.loads((models["hf"] / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(models["hf"], dtype=torch.float32)
    assert stage_parameters(cfg, 1, 1).total == sum(p.numel() for p in hf.parameters())
    for name, billions in (("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)):  # model card
        assert round(stage_parameters(GptOss.presets[name], 1, 1).total / 1e9, 2) == billions


def test_clamped_swiglu_is_transformers_bitwise():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from models.families.gpt_oss import SigmoidGate
    from models.layers.biased_experts.spec import clamped_glu

    hf = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=1,
                                    swiglu_limit=2.0))
    gate_up = 3.0 * torch.randn(50, 32)              # interleaved: gate 0::2, linear 1::2
    mega = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1)   # megatron: [gate; up]
    config = type("C", (), dict(activation_func=SigmoidGate(1.702),
                                activation_func_clamp_value=2.0, glu_linear_offset=1.0))
    assert (gate_up.abs() > 2.0).any()
    assert torch.equal(clamped_glu(mega, config), hf._apply_gate(gate_up))


def test_sink_window_attention_matches_transformers_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from models.layers.attention.sinks import sink_window_attention

    gen = torch.Generator().manual_seed(0)
    b, h, s, d, window = 2, 4, 20, 8, 5
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(3))
    sinks = torch.randn(h, generator=gen)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (j > i - window)                      # HF sliding_window_overlay
    mask = torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = type("M", (), dict(num_key_value_groups=1, sinks=sinks, training=False))
    ref, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=d ** -0.5)
    ours = sink_window_attention(q, k, v, d ** -0.5, window - 1, sinks).transpose(1, 2)
    assert (ours - ref).abs().max() < 1e-6
    wider = sink_window_attention(q, k, v, d ** -0.5, window, sinks).transpose(1, 2)
    assert (wider - ref).abs().max() > 1e-2                    # negative control


def test_mxfp4_dequantize_is_transformers_bitwise():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from models.formats.mxfp4 import dequantize, quantize

    x = 0.05 * torch.randn(3, 64, 96)
    x[0, :32, 0] = 0.0                                          # an all-zero group
    blocks, scales = quantize(x)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    ours = dequantize(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert (ours - x).abs().max() < 0.05 and (ours - x).abs().max() > 0   # it did round
    again, same = quantize(ours.bfloat16().float(), scales)     # an untrained re-export
    assert torch.equal(again, blocks) and torch.equal(same, scales)


def test_fused_expert_views_round_trip(models):
    from models.layers.biased_experts.fused import FusedExpertReader, fuse_experts
    from models.hf.io import SafetensorsReader, read_config

    cfg = read_config(models["hf"])
    raw = SafetensorsReader(models["hf"])
    reader = FusedExpertReader(raw, cfg)
    gate_up = raw.get("model.layers.1.mlp.experts.gate_up_proj")
    x = torch.randn(5, 64)
    gate = reader.get("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert ((x @ gate.t()) - (x @ gate_up[2])[:, 0::2]).abs().max() < 1e-5  # HF's gate
    stream = [(n, reader.get(n)) for n in reader.keys()]
    back = dict(fuse_experts(cfg, stream))
    assert sorted(back) == sorted(raw.keys())
    assert all(torch.equal(back[n], raw.get(n)) for n in back)


def _verify(pools, model: Path, ckpt: Path, *layout: str) -> float:
    world = 2 if layout else 1
    proc = pools.script(world, CONVERT, "verify", "--hf-dir", str(model), "--ckpt", str(ckpt),
                        "--seq-len", "40", *layout)
    assert proc.returncode == 0, proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
    return float(line.split("max_abs_diff=")[1].split()[0])


def test_convert_round_trip_and_verify(pools, models, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", models["hf"],
                        "--out", ckpt).returncode == 0
    assert pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", ckpt, "--out", out).returncode == 0
    a, b = _tensors(models["hf"]), _tensors(out)
    assert sorted(a) == sorted(b)
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)
    for layout in ((), ("--tp", "2"), ("--pp", "2"), ("--ep", "2")):
        assert _verify(pools, models["hf"], ckpt, *layout) < 1e-4, layout


def test_mxfp4_checkpoint_as_published(pools, models, tmp_path):
    """Loads to transformers' own dequantization (verify reads the MXFP4 folder with
    transformers, which dequantizes on CPU), exports unquantized (bf16 experts, fp32 rest, no
    quantization_config) and, with --quantize mxfp4, the source's bytes."""
    ckpt, plain, again = tmp_path / "ckpt", tmp_path / "plain", tmp_path / "again"
    assert pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", models["mxfp4"], "--out",
                        ckpt).returncode == 0
    assert _verify(pools, models["mxfp4"], ckpt, "--ep", "2") < 1e-4
    assert _verify(pools, models["reference"], ckpt, "--tp", "2") < 1e-4
    assert pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", ckpt, "--out", plain).returncode == 0
    ref, out = _tensors(models["reference"]), _tensors(plain)
    assert sorted(ref) == sorted(out)
    for name, tensor in out.items():
        expected = torch.bfloat16 if name.endswith(("gate_up_proj", "down_proj")) else torch.float32
        assert tensor.dtype == expected and torch.equal(ref[name].to(expected), tensor), name
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", ckpt, "--out", again,
                        "--quantize", "mxfp4").returncode == 0
    src, back = _tensors(models["mxfp4"]), _tensors(again)
    assert sorted(src) == sorted(back)
    assert all(src[n].dtype == back[n].dtype and torch.equal(src[n], back[n]) for n in src)


LAYOUTS = ["2,1,0,1,16,sp", "1,1,0,1,4,ep=2", "1,2,0,1,4", "1,1,0,2,16", "1,1,0,1,16,packing",
           "1,1,0,2,16,packing"]
CONTROLS = ["1,1,0,1,16,packing+control=window", "1,1,0,2,16,control=sinkslice"]


def test_layouts_equal_the_single_process(pools, models, tmp_path):
    ref = tmp_path / "reference.pt"
    first = pools.script(1, CHECK, models["hf"], ref, "1,1,0,1,16", timeout=600)
    assert first.returncode == 0 and ref.is_file()
    proc = pools.script(2, CHECK, models["hf"], ref, *LAYOUTS, *CONTROLS, timeout=600)
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert sorted(results) == sorted(LAYOUTS + CONTROLS)
    for spec in LAYOUTS:
        r = results[spec]
        assert max(r["loss_rel"], r["grad_norm_rel"], r["param_rel"]) < TOL, r
    for spec in CONTROLS:   # a window across a packed boundary; sinks of the wrong heads
        assert results[spec]["loss_rel"] > 1e-3, results[spec]


def test_grpo_with_the_hf_rollout_backend(pools, models, tmp_path):
    """GRPO at EP2 x DP2 with the HF backend and R3 routing replay: the weight sync writes
    the fused experts into the engine (its logits equal the trainer's after the step's
    weights moved), the rollout log-probs equal the trainer's recomputed ones, and the
    experts transformers' router chose (mlp.router) are the trainer's own."""
    prompts = tmp_path / "add.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                           "answer": i % 10 + (3 * i + 1) % 10}) + "\n"
                               for i in range(16)))
    log_dir = tmp_path / "rl"
    proc = pools.script(
        2, "-m", "engine.rl", f"model.hf_path={models['hf']}", f"data.train_files=[{prompts}]",
        "parallel.ep=2", "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=4",
        "train.mini_batches_per_step=2", "train.micro_batch_size=2", "train.max_steps=2",
        "train.seq_length=64", "optim.lr=1e-3", "kl.beta=0.05", "moe.routing_replay=R3",
        "reward.fn=tests.rl_rewards:digit_reward", "rollout.check_weight_sync=true",
        f"logging.dir={log_dir}", "logging.progress_bar=false", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_diff"] < 1e-3
        assert m["debug/sync_logit_max_diff"] < 1e-4 and m["debug/sync_logit_change"] > 1e-2
        assert m["grad_norm"] > 0 and m["policy/kl"] > 0
        assert m["moe/rollout_replay_mismatch"] < 1e-2, m
