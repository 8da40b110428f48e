"""Qwen3.5 conditional-generation checkpoints as published (Qwen3_5(Moe)ForConditionalGeneration:
the text model under model.language_model.*, the vision tower model.visual.* (mapped to the
trainer's tower, models.vision; images: tests/test_vlm.py), MTP tensors mtp.* one of them bf16;
tests/qwen3_5_tiny.py), read as their text model (models.hf.conditional):

- in-process: the text view of config.json and the reader's names; refusals name the field (a
  missing text_config, a top-level quantization_config, a tensor outside the text model and the
  vision tower, a wrapper config not read through the view; in RL rollout.backend=sglang and
  advantage.estimator=gae);
- HF -> mcore -> HF is bitwise for every tensor (vision tower and MTP included, dtypes too) and
  config.json comes back as stored; `verify` against transformers' ForConditionalGeneration is
  within 1e-4 at TP2 (dense), EP2 (MoE) and PP2 (dense with tied embeddings, as Qwen3.5-0.8B:
  no lm_head.weight, so a view that did not tie would be refused for the missing tensor);
- engine.sft, 2 steps on text: the export of the trained checkpoint has every text tensor
  changed and model.visual.* (frozen, the default) / mtp.* bitwise unchanged, config.json as
  stored;
- GRPO with the HF rollout backend (MoE, one rank; transformers loads the folder's
  conditional-generation model and the weight sync streams into it under the view's names): rollout/logprob_diff < 1e-5 at both steps, with the
  stale-engine negative control; its checkpoint's export keeps model.visual.* / mtp.* bitwise.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import run_cli
from tests.qwen3_5_tiny import MTP_TENSORS, build_qwen3_5_conditional
from tests.test_qwen3_5 import _grpo, _stale_engine_gap, _tensors, convert_round_trip

CONVERT = "tools/convert.py"
CARRIED = ("model.visual.", "mtp.")


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5_conditional")
    return {"dense": Path(build_qwen3_5_conditional(str(root / "dense"))),
            "moe": Path(build_qwen3_5_conditional(str(root / "moe"), moe=True)),
            "tied": Path(build_qwen3_5_conditional(str(root / "tied"), tie=True))}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _carried_equal(src: dict, out: dict) -> bool:
    names = [n for n in src if n.startswith(CARRIED)]
    return bool(names) and all(n in out and src[n].dtype == out[n].dtype
                               and torch.equal(src[n], out[n]) for n in names)


def test_text_view_and_names(wrapped, tmp_path):
    from models.families.tensors import tensor_problems
    from models.families.base import ORIGINAL
    from models.hf.conditional import text_names, text_view
    from models.hf.config import config_problems
    from models.hf.io import SafetensorsReader, read_config

    raw = _config(wrapped["dense"])
    view = read_config(wrapped["dense"])
    assert view["model_type"] == "qwen3_5_text" and view[ORIGINAL] == raw
    assert view["num_hidden_layers"] == raw["text_config"]["num_hidden_layers"]
    assert config_problems(view) == []
    reader = SafetensorsReader(wrapped["dense"])
    names = set(reader.keys())
    assert tensor_problems(view, names) == []
    assert "model.embed_tokens.weight" in names and set(MTP_TENSORS) <= names
    assert not any(n.startswith("model.language_model.") for n in names)
    stored = _tensors(wrapped["dense"])
    assert torch.equal(reader.get("model.layers.3.self_attn.q_proj.weight"),
                       stored["model.language_model.layers.3.self_attn.q_proj.weight"])
    # the top-level tie_word_embeddings is the one ForConditionalGeneration ties by
    tied = text_view(dict(raw, tie_word_embeddings=True))
    assert tied["tie_word_embeddings"] is True and not raw["text_config"]["tie_word_embeddings"]
    refused = {"text_config": {k: v for k, v in raw.items() if k != "text_config"},
               "quantization_config": dict(raw, quantization_config={"quant_method": "fp8"})}
    for needle, bad in refused.items():
        assert any(needle in p for p in config_problems(text_view(bad))), needle
    assert any("read as its text model" in p for p in config_problems(raw))  # not viewed
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="model.layers.0.x"):
        text_names(tmp_path, ["model.language_model.norm.weight", "model.layers.0.x"])


@pytest.mark.parametrize("kind,layout", [("dense", ("--tp", "2")), ("moe", ("--ep", "2")),
                                         ("tied", ("--pp", "2"))])
def test_round_trip_is_bitwise_and_verify(pools, wrapped, tmp_path, kind, layout):
    model, ckpt, out = wrapped[kind], tmp_path / "ckpt", tmp_path / "hf"
    convert_round_trip(pools, model, ckpt, out)
    a, b = _tensors(model), _tensors(out)
    assert sorted(a) == sorted(b) and _carried_equal(a, b)
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)
    assert b["mtp.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert _config(out) == _config(model)
    assert ("lm_head.weight" in a) == (kind != "tied")
    proc = pools.script(2, CONVERT, "verify", "--hf-dir", str(model), "--ckpt", str(ckpt),
                        "--seq-len", "70", *layout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = "Qwen3_5MoeForConditionalGeneration" if kind == "moe" else \
        "Qwen3_5ForConditionalGeneration"
    assert f"reference: transformers {reference}\n" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
    assert float(line.split("max_abs_diff=")[1].split()[0]) < 1e-4, line


def test_sft_trains_the_text_model_only(pools, wrapped, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i % 3} ?"},
                          {"role": "assistant", "content": f"the answer is {i + i % 3}"}]}
            for i in range(8)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, ckpt, out = wrapped["dense"], tmp_path / "ckpt", tmp_path / "hf"
    proc = pools.script(
        1, "-m", "engine.sft", f"model.hf_path={model}", f"data.train_files=[{data}]",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
        "train.max_steps=2", "optim.lr=1e-2", "logging.progress_bar=false",
        f"logging.dir={tmp_path}/log", f"checkpoint.dir={ckpt}", "checkpoint.save_interval=2",
        f"data.cache_dir={tmp_path}/cache", "data.num_workers=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = _tensors(model), _tensors(out)
    assert sorted(a) == sorted(b) and _carried_equal(a, b)
    text = [n for n in a if not n.startswith(CARRIED)]
    assert all(not torch.equal(a[n], b[n]) for n in text)
    assert _config(out) == _config(model)


def test_grpo_with_the_hf_backend(pools, wrapped, tmp_path):
    """transformers loads the wrapper folder's text model (Qwen3_5MoeForCausalLM, names
    model.*), the names the weight sync streams: the engine's log-probs after a sync equal the
    trainer's; an engine left at the initial weights would be off by far more."""
    model, ckpt = wrapped["moe"], tmp_path / "ckpt"
    metrics = _grpo(pools, model, tmp_path / "run", 1, f"checkpoint.dir={ckpt}",
                    "checkpoint.save_interval=2")
    assert len(metrics) == 2 and metrics[0]["grad_norm"] > 0
    assert all(m["rollout/logprob_diff"] < 1e-5 for m in metrics), metrics
    assert _stale_engine_gap(model, tmp_path / "run" / "dump" / "step_2.jsonl") > 1e-3
    out = tmp_path / "hf"
    proc = pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _carried_equal(_tensors(model), _tensors(out))


@pytest.mark.parametrize("extra,needle", [
    ("rollout.backend=sglang", "rollout.backend='sglang' with a conditional-generation"),
    ("advantage.estimator=gae", "advantage.estimator=gae with a conditional-generation")])
def test_rl_refuses_what_has_not_run(wrapped, tmp_path, extra, needle):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "what is 1 plus 1 ?", "answer": 2}) + "\n")
    proc = run_cli("engine.rl", f"model.hf_path={wrapped['dense']}",
                   f"data.train_files=[{prompts}]", "reward.fn=tests.test_rl_loop:digit_reward",
                   f"logging.dir={tmp_path}/run", extra)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
