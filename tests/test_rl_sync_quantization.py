"""rollout.sync_quantization=fp8 (engine.generation.sync.quantization): the weight sync to FP8
rollout engines, on the tiny FP8 DeepSeek-V3 of tests/deepseek_v3_tiny.py (16 x 16 blocks):

- the quantized stream (models.hf.quantized_stream) equals what `mcore-to-hf --quantize fp8`
  writes for the same tensors (models.hf.quantized_export.export_tensors), bitwise, for trained
  (perturbed) weights that keep some published scales and need fresh ones for others; each
  scale follows its weight and never starts a bucket (control: a plain tensor does);
- the HF engine, after an FP8 sync, holds dequant(quant(W)) bitwise (the other tensors W);
  negative controls: a sync without the scales is refused by name, and unit scales (an FP8
  weight cast unscaled, what a bf16 sync does to an FP8 engine) move the logits by > 1;
- SGLang's fused q_a / kv_a halves reach it in one call (engine.generation.sglang.pairs);
- the key is refused by name (bad value, unquantized model, backend, SGLang on an FP8 model
  without it); the estimate counts FP8 engine weights (DeepSeek-V3: 669.07 B FP8 parameters,
  40.8 M scales; the rest is exactly embeddings, lm_head, norms and routers) and the 64-node
  H200 recipe validates, 32 nodes do not;
- GRPO at PP2 with the HF backend (the second stage's FP8 tensors cross ranks as bytes):
  rollout/logprob_diff after an FP8 sync reflects FP8 rounding; the same run with
  sync_quantization null stays at ~1e-6.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.generation.hf.backend import HFRolloutEngine
from tests.deepseek_v3_tiny import build_deepseek_v3, build_fp8


class PlainHFEngine(HFRolloutEngine):
    """A backend that declares no FP8 updates (the refusal's subject)."""
    sync_quantizations = ()


ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/rl/deepseek_v3_grpo_h200.yaml"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("sync_fp8")
    return build_fp8(build_deepseek_v3(str(root / "src")), str(root / "fp8"))


def _config(path: str) -> dict:
    return json.loads(Path(path, "config.json").read_text())


def _trained(fp8_dir: str) -> dict[str, torch.Tensor]:
    """The folder's weights as the trainer loads them (exact dequantization, fp32), moved as
    training would: small noise everywhere, and one block of each FP8 weight scaled x 3 so
    its published scale no longer fits (a fresh amax / 448 scale)."""
    from models.hf.io import SafetensorsReader
    from models.formats.quantized import DequantizingReader

    cfg = _config(fp8_dir)
    reader = DequantizingReader(SafetensorsReader(fp8_dir), cfg)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in reader.keys():
        if name.startswith("model.layers.2."):   # the MTP layer is not synced
            continue
        w = reader.get(name).float()
        w = w + 3e-3 * torch.randn(w.shape, generator=gen)
        if name in reader.parts:
            w[:16, :16] *= 3.0
        out[name] = w
    return out


def _quantized(fp8_dir: str, tensors: dict) -> list[tuple[str, torch.Tensor]]:
    from models.hf.quantized_stream import QuantizedSource

    return list(QuantizedSource(fp8_dir, _config(fp8_dir)).quantize(iter(tensors.items())))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_stream_equals_the_exporter_bitwise_and_scales_stay_with_weights(fp8_dir, tmp_path):
    from engine.rl.policy.weight_export import iter_buckets
    from models.hf.quantized_export import export_tensors, record_source

    cfg, trained = _config(fp8_dir), _trained(fp8_dir)
    stream = _quantized(fp8_dir, trained)
    assert record_source(fp8_dir, cfg, tmp_path) > 0
    exported, _ = export_tensors(dict(trained), cfg, tmp_path, quantize="fp8")
    names = [n for n, _ in stream]
    scales = [n for n in names if n.endswith("_scale_inv")]
    assert len(scales) == 38 and set(names) == set(exported)
    fresh = 0
    for i, (name, t) in enumerate(stream):
        if name.endswith("_scale_inv") or name + "_scale_inv" in names:
            ref = exported[name]
            assert t.dtype == ref.dtype and torch.equal(_bytes(t), _bytes(ref)), name
        else:   # not FP8 in the checkpoint: as the trainer has it (the exporter casts it)
            assert t is trained[name]
        if name.endswith("_scale_inv"):
            assert names[i - 1] + "_scale_inv" == name
            fresh += int((t != load_scale(fp8_dir, name)).sum())
    assert fresh >= 38          # the x3 block of every weight got a fresh scale
    weight_bytes = max(t.numel() for _, t in stream if t.dtype == torch.float8_e4m3fn)
    for bucket in iter_buckets(iter(stream), weight_bytes):
        assert not bucket[0][0].endswith("_scale_inv")
    plain = [("a", torch.zeros(4)), ("b", torch.zeros(1))]   # control: b starts a bucket
    assert len(list(iter_buckets(iter(plain), 16))) == 2


def load_scale(fp8_dir: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(fp8_dir, "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_hf_engine_holds_dequantized_fp8_with_negative_controls(fp8_dir):
    from engine.rl.policy.weight_sync import probe_tokens, sync_weights
    from models.formats.fp8 import dequantize

    trained = _trained(fp8_dir)
    stream = _quantized(fp8_dir, trained)
    engine = HFRolloutEngine(fp8_dir, dtype=torch.float32)
    sync_weights(iter(stream), engine, bucket_mb=0.01)
    sent = dict(stream)
    moved = 0.0
    for name, w in trained.items():
        got = engine._params[name]
        if name + "_scale_inv" in sent:
            want = dequantize(sent[name], sent[name + "_scale_inv"], (16, 16))
            moved = max(moved, float((want - w).abs().max()))
        else:
            want = w
        assert torch.equal(got, want), name
    assert moved > 1e-3                     # FP8 rounding is real: the engine is not W
    probe = probe_tokens(200)
    good = engine.probe_logits(probe)
    dropped = [(n, t) for n, t in stream if not n.endswith("_scale_inv")]
    with pytest.raises(ValueError, match=r"without '.*_scale_inv' in the same bucket"):
        engine.update_weights(dropped)
    unit = [(n, torch.ones_like(t) if n.endswith("_scale_inv") else t) for n, t in stream]
    engine.update_weights(unit)
    assert float((engine.probe_logits(probe) - good).abs().max()) > 1.0


def test_sglang_gets_fused_halves_in_one_call(monkeypatch, tmp_path):
    """On the fake sglang 0.5.23 Engine of tests/test_sglang_backend.py (the sync's session
    included): the halves of a fused q_a / kv_a pair reach update_weights_from_tensor in one
    call."""
    import sys
    import types

    from engine.generation.sglang.backend import SGLangRolloutEngine
    from engine.generation.sglang.pairs import fuses_qkv_a
    from engine.generation.sglang.settings import TESTED_VERSION
    from tests.test_sglang_backend import FakeEngine

    module = types.ModuleType("sglang")
    module.__version__, module.Engine = TESTED_VERSION, FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "config.json").write_text(json.dumps({"q_lora_rank": 16, "kv_lora_rank": 8}))
    engine = SGLangRolloutEngine(str(tmp_path))
    a, kv = "model.layers.3.self_attn.q_a_proj.", "model.layers.3.self_attn.kv_a_proj_with_mqa."
    engine.update_weights([(a + "weight", 1), (a + "weight_scale_inv", 2), ("x", 0)])
    assert engine._pairs.held == [a + "weight", a + "weight_scale_inv"]
    with pytest.raises(RuntimeError, match="waiting for its fused"):
        engine._generate([[1]], None)
    engine.update_weights([(kv + "weight", 3), (kv + "weight_scale_inv", 4)])
    calls = [[n for n, _ in kw["named_tensors"]] for name, kw in engine.engine.calls
             if name == "update_weights_from_tensor"]
    assert calls == [["x"], [a + "weight", kv + "weight", a + "weight_scale_inv",
                             kv + "weight_scale_inv"]]
    assert engine._pairs.held == []
    assert fuses_qkv_a({"q_lora_rank": 1536, "kv_lora_rank": 512})
    assert not fuses_qkv_a({"q_lora_rank": None, "kv_lora_rank": 512})   # Moonlight: q_proj


def _rl_cfg(*keys):
    from engine.config.loading import load_config
    from engine.rl.config import RLConfig

    return load_config(RLConfig, list(keys))[0]


def test_the_key_is_refused_by_name(fp8_dir):
    from engine.generation.sync.quantization import sync_quantization_problems

    src = str(Path(fp8_dir).parent / "src")
    fp8 = _config(fp8_dir)

    def problems(path, *keys):
        return sync_quantization_problems(_rl_cfg(f"model.hf_path={path}", *keys), _config(path))

    assert problems(fp8_dir, "rollout.sync_quantization=fp8") == []
    assert problems(src) == [] and problems(fp8_dir) == []
    [bad] = problems(fp8_dir, "rollout.sync_quantization=int8")
    assert "rollout.sync_quantization='int8' is not valid; choose one of null, fp8" in bad
    [plain] = problems(src, "rollout.sync_quantization=fp8")
    assert plain.startswith("rollout.sync_quantization=fp8") and "quant_method=None" in plain
    [backend] = problems(fp8_dir, "rollout.sync_quantization=fp8",
                         "rollout.backend=tests.test_rl_sync_quantization:PlainHFEngine")
    assert "rollout.backend=tests.test_rl_sync_quantization:PlainHFEngine cannot load fp8" \
        in backend
    cfg = _rl_cfg("model.shape=deepseek-v3", "rollout.backend=sglang")
    [sglang] = sync_quantization_problems(cfg, fp8)
    assert "set rollout.sync_quantization=fp8" in sglang


def test_fp8_engine_estimate_and_the_h200_recipe(capsys):
    from engine.rl.recipe_check import rl_validate_main
    from engine.generation.engine_memory import engine_weights, engine_weights_problem
    from models.estimate.counting import stage_parameters
    from models.families.presets import MODEL_SHAPES

    hf = MODEL_SHAPES["deepseek-v3"]
    cfg = _rl_cfg("model.shape=deepseek-v3", "model.dtype=bfloat16",
                  "rollout.sync_quantization=fp8")
    w = engine_weights(cfg, hf)
    total = stage_parameters(hf, 1, 1).total
    h, layers, experts = hf["hidden_size"], hf["num_hidden_layers"], hf["n_routed_experts"]
    rest = (2 * hf["vocab_size"] * h + h + layers * (2 * h + hf["q_lora_rank"]
            + hf["kv_lora_rank"]) + (layers - hf["first_k_dense_replace"]) * experts * h)
    assert (w.fp8_params, w.scales) == (669_065_609_216, 40_838_232)
    assert total - w.fp8_params == rest and w.bytes == w.fp8_params + 4 * w.scales + 2 * rest
    qwen = _rl_cfg("model.shape=qwen3-8b", "rollout.sync_quantization=fp8")
    assert "deepseek_v3 (MLA) checkpoints only" in engine_weights_problem(qwen, {
        "model_type": "qwen3"})
    assert rl_validate_main(["--config", str(RECIPE), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "weights 78.4 (FP8: 669.07 B parameters" in out and "= 134.2" in out
    assert "673.2 GB to each of 64 engine(s)" in out and "recipe OK on 64 node(s)" in out
    assert rl_validate_main(["--config", str(RECIPE), "--validate", "--nodes", "32",
                             "parallel.ep=32"]) == 2
    assert "156.1 GiB exceeds recipe.gpu_memory_gib=140.4" in capsys.readouterr().err


def _grpo(pools, path: str, log_dir: Path, *extra: str) -> list[dict]:
    prompts = log_dir.parent / "add.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i) % 10} ?",
                                           "answer": i % 10 + (3 * i) % 10}) + "\n"
                               for i in range(8)))
    pools.script(
        2, "-m", "engine.rl", f"model.hf_path={path}", f"data.train_files=[{prompts}]",
        "parallel.pp=2", "rollout.n=4", "rollout.max_new_tokens=8", "train.prompts_per_step=2",
        "train.micro_batch_size=2", "train.max_steps=2", "train.seq_length=64",
        "optim.lr=1e-3", "kl.beta=0", "reward.fn=tests.rl_rewards:digit_reward",
        "rollout.check_weight_sync=true", f"logging.dir={log_dir}",
        "logging.progress_bar=false", *extra, timeout=400)
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_fp8_sync_at_pp2(pools, fp8_dir, tmp_path):
    fp8 = _grpo(pools, fp8_dir, tmp_path / "fp8", "rollout.sync_quantization=fp8")
    exact = _grpo(pools, fp8_dir, tmp_path / "exact")
    assert len(fp8) == len(exact) == 2
    assert fp8[0]["rollout/logprob_diff"] < 1e-5 and exact[0]["rollout/logprob_diff"] < 1e-5
    assert exact[1]["rollout/logprob_diff"] < 1e-5           # model.dtype sync: exact
    assert fp8[1]["rollout/logprob_diff"] > 1e-3             # after an FP8 sync: rounding
    assert exact[0]["debug/sync_logit_max_diff"] < 1e-4
    assert fp8[0]["debug/sync_logit_max_diff"] > 1e-2
    fp8_bytes, exact_bytes = (r[0]["rollout/sync_bytes_per_engine"] for r in (fp8, exact))
    assert fp8_bytes < 0.5 * exact_bytes
