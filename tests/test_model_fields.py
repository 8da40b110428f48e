"""The bridge's config-field table (models.families): every row that maps a value is checked
for logit parity with transformers, every refused value for a clear refusal.

Mapped rows: one tiny HF model per row (MAPPED), all checked in ONE 2-rank run of this file as
a script (on the session's rank pool, tests/pool.py, as torchrun would run it): for each model
and each layout of LAYOUTS (TP2, PP2) it builds the chunks, loads the HF weights, and compares
fp32 logits with transformers' (max over ranks).
Rank 0 also measures `field_effect`: how far transformers' own logits move when the row's
field is undone (CONTROL) — the size of the error a bridge that ignored the field would make,
so a parity bound of 1e-4 proves the field is really mapped.

    torchrun --nproc_per_node 2 tests/test_model_fields.py SPEC.json

Refused rows (REFUSED) run in-process on config dicts (no megatron); the leftover-tensor check
runs on a checkpoint with one extra tensor, in-process and through tools/convert.py. The same
refusals at `engine.sft` / `engine.rl` start are in tests/test_model_cli_refusals.py.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

LAYOUTS = {"tp2pp1": (2, 1), "tp1pp2": (1, 2)}
PARITY_TOL = 1e-4
MIN_FIELD_EFFECT = 1e-3
BATCH, SEQ = 2, 32
_L3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_position_embeddings=8192, rope_theta=10000.0)
_L3_CUSTOM = dict(rope_type="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                  original_max_position_embeddings=64, rope_theta=10000.0)
_DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)

# name -> (arch, config extras, CONTROL: the extras that undo the field (None: no control),
#          "legacy": rewrite config.json with the pre-transformers-5 rope_scaling spelling)
MAPPED: dict[str, tuple[str, dict, dict | None, bool]] = {
    "rope_llama3_rope_parameters": (
        "llama", dict(rope_parameters={**_L3, "original_max_position_embeddings": 16},
                      max_position_embeddings=512),
        dict(rope_parameters=_DEFAULT_ROPE), False),
    "rope_llama3_custom_params_legacy_rope_scaling": (
        "llama", dict(rope_parameters=_L3_CUSTOM, max_position_embeddings=512),
        dict(rope_parameters=_L3), True),
    "rope_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=4.0,
                                                       rope_theta=10000.0)),
                    dict(rope_parameters=_DEFAULT_ROPE), False),
    "rope_yarn": ("qwen3", dict(rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                     original_max_position_embeddings=32,
                                                     rope_theta=10000.0),
                                max_position_embeddings=128),
                  dict(rope_parameters=_DEFAULT_ROPE), False),
    "rope_theta_top_level_legacy": ("qwen2", dict(rope_parameters=dict(
        rope_type="default", rope_theta=100.0)), dict(rope_parameters=_DEFAULT_ROPE), True),
    "llama_attention_bias": ("llama", dict(attention_bias=True), dict(attention_bias=False),
                             False),
    "llama_mlp_bias": ("llama", dict(mlp_bias=True), dict(mlp_bias=False), False),
    "llama_attention_and_mlp_bias": ("llama", dict(attention_bias=True, mlp_bias=True),
                                     dict(attention_bias=False, mlp_bias=False), False),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True), dict(attention_bias=False),
                             False),
    "llama_head_dim_16": ("llama", dict(head_dim=16), None, False),
    "hidden_act_gelu": ("llama", dict(hidden_act="gelu"), dict(hidden_act="silu"), False),
    "hidden_act_gelu_pytorch_tanh": ("qwen2", dict(hidden_act="gelu_pytorch_tanh"),
                                     dict(hidden_act="silu"), False),
    "rms_norm_eps_0.5": ("llama", dict(rms_norm_eps=0.5), dict(rms_norm_eps=1e-6), False),
    "llama_tied_embeddings": ("llama", dict(tie_word_embeddings=True), None, False),
    "qwen2_sliding_window_unused": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=4), None, False),
}


def _respell_legacy(hf_dir: str) -> None:
    """config.json as written before transformers 5: `rope_scaling` + top-level `rope_theta`."""
    path = Path(hf_dir) / "config.json"
    cfg = json.loads(path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = params
    path.write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------- the launched script

def _reference(hf_dir: str, tokens, extras: dict | None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {}
    if extras is not None:
        kwargs["config"] = AutoConfig.from_pretrained(hf_dir, **extras)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model.eval()(tokens).logits.float()


def _world_max(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([math.inf if math.isnan(value) else value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_case(name: str, hf_dir: str, control: dict | None, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_logits
    from models.hf.io import SafetensorsReader, read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    cfg = read_config(hf_dir)
    tokens = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ),
                           generator=torch.Generator().manual_seed(7))
    ref = _reference(hf_dir, tokens, None)
    effect = (None if control is None or rank != 0
              else (ref - _reference(hf_dir, tokens, control)).abs().max().item())
    for layout, (tp, pp) in LAYOUTS.items():
        setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))
        chunks = build_model_chunks(cfg)
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    p.fill_(float("nan"))
        load_hf_weights(chunks, SafetensorsReader(hf_dir), cfg)
        logits = forward_logits(chunks, tokens, cfg["vocab_size"])
        diff = _world_max((logits - ref).abs().max().item())
        if rank == 0:
            print("RESULT " + json.dumps({"case": name, "layout": layout, "max_abs_diff": diff,
                                          "ref_std": ref.std().item(),
                                          "field_effect": effect}), flush=True)


def main() -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings
    warnings.filterwarnings("ignore")
    from parallel.process_groups import init_distributed, shutdown

    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, _ = init_distributed()
    for name, (hf_dir, control) in spec.items():
        run_case(name, hf_dir, control, rank)
    shutdown()
    return 0


# ---------------------------------------------------------------- pytest: mapped rows

@pytest.fixture(scope="module")
def mapped_results(pools, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """This file run as a script on 2 ranks (the session's rank pool, tests/pool.py)."""
    from tests.launch import result_lines
    from tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("fields")
    spec = {}
    for name, (arch, extras, control, legacy) in MAPPED.items():
        hf_dir = build_tiny_model(str(root / name), arch, hidden=64, layers=4, heads=8,
                                  kv_heads=2, seed=3, tokenizer=False, initializer_range=0.2,
                                  **extras)
        if legacy:
            _respell_legacy(hf_dir)
        spec[name] = (hf_dir, control)
    (root / "spec.json").write_text(json.dumps(spec))
    proc = pools.script(2, "tests/test_model_fields.py", str(root / "spec.json"), timeout=900)
    assert proc.returncode == 0, "model_fields run failed (output printed above)"
    return {(r["case"], r["layout"]): r for r in result_lines(proc.stdout)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", MAPPED)
def test_mapped_field_matches_transformers(mapped_results, case, layout):
    rec = mapped_results[(case, layout)]
    assert rec["ref_std"] > 0.5, rec
    assert math.isfinite(rec["max_abs_diff"]) and rec["max_abs_diff"] <= PARITY_TOL, rec
    if MAPPED[case][2] is not None:  # negative control: ignoring the field would show
        assert rec["field_effect"] > MIN_FIELD_EFFECT, rec


# ---------------------------------------------------------------- pytest: refused rows

_BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
             intermediate_size=128, vocab_size=200, max_position_embeddings=64,
             rope_theta=10000.0)
# name -> (config.json values, text the refusal must contain)
REFUSED: dict[str, tuple[dict, str]] = {
    "rope_dynamic": (dict(model_type="llama", rope_scaling=dict(rope_type="dynamic",
                                                                factor=2.0)),
                     "rope_parameters.rope_type='dynamic'"),
    "rope_longrope": (dict(model_type="qwen2", rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4, factor=2.0,
        original_max_position_embeddings=32)), "rope_parameters.rope_type='longrope'"),
    "rope_unknown_type": (dict(model_type="llama", rope_parameters=dict(
        rope_type="proportional", rope_theta=10000.0)),
                          "rope_parameters.rope_type='proportional'"),
    "partial_rotary_factor": (dict(model_type="llama", partial_rotary_factor=0.5),
                              "partial_rotary_factor=0.5 is not supported"),
    "hidden_act_relu": (dict(model_type="qwen3", hidden_act="relu"),
                        "hidden_act='relu' is not supported; supported: silu, gelu, "
                        "gelu_pytorch_tanh"),
    "attention_dropout": (dict(model_type="llama", attention_dropout=0.1),
                          "attention_dropout=0.1 is not supported"),
    "qwen2_sliding_window": (dict(model_type="qwen2", use_sliding_window=True,
                                  sliding_window=16, max_window_layers=2),
                             "use_sliding_window=True with sliding_window=16 and "
                             "max_window_layers=2 gives layers 2..3 sliding-window attention"),
    "qwen3_sliding_window": (dict(model_type="qwen3", use_sliding_window=True,
                                  sliding_window=16, max_window_layers=0),
                             "gives layers 0..3 sliding-window attention"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_field_is_named(case):
    from models.families.base import UnsupportedConfigError
    from models.hf.config import check_config

    values, needle = REFUSED[case]
    with pytest.raises(UnsupportedConfigError) as err:
        check_config({**_BASE, **values})
    message = str(err.value)
    assert needle in message and "\n" not in message, message


def test_every_table_row_has_a_description():
    from models.families.registry import FAMILIES

    for fam in FAMILIES.values():
        table = " ".join(rule.field for rule in fam.fields)
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "head_dim",
                    "tie_word_embeddings", "rms_norm_eps", "partial_rotary_factor",
                    "attention_dropout"):
            assert key in table, (fam.model_type, key)
        assert all(rule.supported for rule in fam.fields)


def _with_extra_tensor(hf_dir: Path, name: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors[name] = torch.zeros(2, 2)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def test_tensor_problems_name_leftover_and_missing(tmp_path):
    from models.families.tensors import tensor_problems
    from models.hf.io import SafetensorsReader, read_config, training_dir_problems
    from tools.tiny_models import build_tiny_model

    hf_dir = Path(build_tiny_model(str(tmp_path / "m"), "llama", layers=2, seed=1,
                                   tokenizer=False))
    cfg = read_config(hf_dir)
    names = SafetensorsReader(hf_dir).keys()
    assert tensor_problems(cfg, names) == []
    # transformers drops these on load too: old RoPE buffers; lm_head of a tied model
    ignored = ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert tensor_problems({**cfg, "tie_word_embeddings": True}, names + ignored) == []
    (problem,) = tensor_problems(cfg, names + ["model.layers.0.mlp.extra.weight"])
    assert "1 tensor(s) the llama mapping would not consume" in problem
    assert "model.layers.0.mlp.extra.weight" in problem
    (problem,) = tensor_problems(cfg, [n for n in names if "o_proj" not in n])
    assert "lacks 2 tensor(s)" in problem and "model.layers.1.self_attn.o_proj.weight" in problem
    _with_extra_tensor(hf_dir, "model.layers.1.self_attn.o_proj.lora_A.weight")
    assert any("model.layers.1.self_attn.o_proj.lora_A.weight" in p
               for p in training_dir_problems(hf_dir))


def test_convert_refuses_biases_the_config_does_not_declare(tmp_path):
    """A Llama whose config.json says attention_bias=false while its weights hold q/k/v/o
    biases: hf-to-mcore used to drop them silently (logits off by ~1.6). Refused before any
    process group: the command line's main(argv) in this process."""
    from tests.test_convert import convert_in_process
    from tools.tiny_models import build_tiny_model

    hf_dir = Path(build_tiny_model(str(tmp_path / "m"), "llama", layers=2, seed=1,
                                   tokenizer=False, attention_bias=True))
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    proc = convert_in_process("hf-to-mcore", "--hf-dir", str(hf_dir),
                              "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "would not consume" in errors[0], proc.stderr[-2000:]
    assert "model.layers.0.self_attn.k_proj.bias" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    raise SystemExit(main())
