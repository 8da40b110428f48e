"""Mixtral family (models.families.mixtral) through tools/convert.py, with expert parallelism.

Fixture: a tiny MixtralForCausalLM (4 layers, hidden 64, 8 experts of width 32, top-2,
untied embeddings, random init with initializer_range 0.2) saved by transformers, whose
checkpoint names are `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w2/w3`
(transformers >= 5 holds them fused under `mlp` in memory); nothing is downloaded.

- The router is random (uneven expert loads); HF -> mcore -> HF on 1 process is bitwise
  equal to the original (names, dtypes, values).
- ONE 4-rank run of this file as a script (on the session's rank pool, tests/pool.py): hf-to-mcore at TP2 x EP2, then `verify --ep 2`
  at TP2 x EP2 (logits within 1e-4 of transformers'), then the Megatron -> HF export at
  TP2 x EP2 (experts gathered over EP and renamed) compared bitwise with the original.
    torchrun --nproc_per_node 4 tests/test_mixtral_convert.py HF_DIR CKPT_DIR
- The RL weight sync's checkpoint-name targets cover every Mixtral checkpoint tensor.
- Config refusals (router_jitter_noise, sliding_window) name the field; parameter counts:
  the fixture's tensor count and Mixtral-8x7B's published 46.7B total / 12.9B active.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

EXPERTS, LAYERS, HIDDEN, WIDTH = 8, 4, 64, 32
_DIFF = re.compile(r"max_abs_diff=([0-9.eE+-]+|nan|inf)")


# ---------------------------------------------------------------- the launched script

def _launch(hf_dir: str, ckpt: str) -> int:
    """hf-to-mcore at TP2 x EP2, verify at TP2 x EP2, export at TP2 x EP2 (bitwise)."""
    from argparse import Namespace

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from models.bridge.weights import export_hf_weights
    from models.bridge.checkpoint import load_model, read_hf_config
    from models.build.factory import build_model_chunks
    from tools.convert import hf_to_mcore, setup_layout
    from tools.convert_verify import verify

    layout = dict(tp=2, pp=1, ep=2)
    hf_to_mcore(Namespace(hf_dir=hf_dir, out=ckpt, **layout))
    dist.barrier()
    rc = verify(Namespace(hf_dir=hf_dir, ckpt=ckpt, dtype="float32", tolerance=None,
                          seq_len=32, batch=2, seed=0, **layout))
    cfg = read_hf_config(Path(ckpt))
    setup_layout(cfg, **layout)
    chunks = build_model_chunks(cfg)
    load_model(chunks, Path(ckpt))
    exported = dict(export_hf_weights(chunks, cfg))
    original = load_file(f"{hf_dir}/model.safetensors")
    same = sorted(exported) == sorted(original) and all(
        torch.equal(exported[n], original[n]) for n in original)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"export_bitwise": same, "tensors": len(exported)}),
              flush=True)
    return rc


def main() -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from parallel.process_groups import init_distributed, shutdown

    init_distributed()
    rc = _launch(sys.argv[1], sys.argv[2])
    shutdown()
    return rc


# ---------------------------------------------------------------- pytest

def build_mixtral(out_dir: Path, seed: int = 0, **extra) -> str:
    from tools.tiny_models import build_tiny_model

    return build_tiny_model(str(out_dir), "mixtral", hidden=HIDDEN, layers=LAYERS, heads=8,
                            kv_heads=2, intermediate=WIDTH, seed=seed, initializer_range=0.2,
                            **extra)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    return build_mixtral(tmp_path_factory.mktemp("mixtral") / "hf")


def test_fixture_holds_checkpoint_names(mixtral_dir):
    from tests.test_convert import _tensors

    names = _tensors(mixtral_dir)
    assert len(names) == 3 + LAYERS * (6 + 1 + 3 * EXPERTS)
    assert "model.layers.3.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


def test_fixture_routes_tokens_unevenly(mixtral_dir):
    """The router is really random: experts get different loads, so a mis-numbered or
    mis-routed expert changes the logits `verify` compares."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    load = torch.bincount(out.router_logits[0].topk(2, dim=-1).indices.flatten(),
                          minlength=EXPERTS)
    assert load.max() > load.min() and (load > 0).sum() >= 4, load
    assert out.logits.std() > 0.5


def test_roundtrip_on_one_process_is_bitwise(pools, mixtral_dir, tmp_path):
    from tests.test_convert import _assert_bitwise_equal, _tensors, convert

    t0 = time.time()
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    proc = convert(pools, 1, "hf-to-mcore", "--hf-dir", mixtral_dir, "--out", str(ckpt))
    assert proc.returncode == 0
    proc = convert(pools, 1, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0
    _assert_bitwise_equal(mixtral_dir, out)
    assert sum(".block_sparse_moe.experts." in n for n in _tensors(out)) == LAYERS * EXPERTS * 3
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (Path(mixtral_dir) / "config.json").read_text())
    print(f"mixtral round trip on 1 process: {time.time() - t0:.1f} s")


def test_tp2_ep2_write_verify_and_export(pools, mixtral_dir, tmp_path):
    from tests.launch import result_lines

    t0 = time.time()
    proc = pools.script(4, "tests/test_mixtral_convert.py", mixtral_dir,
                        str(tmp_path / "ckpt"), timeout=600)
    assert proc.returncode == 0, "mixtral launch failed (output printed above)"
    diffs = _DIFF.findall(proc.stdout)
    assert len(diffs) == 1 and "ep=2" in proc.stdout, proc.stdout
    print(f"mixtral TP2 x EP2 launch: {time.time() - t0:.1f} s, max_abs_diff={diffs[0]}")
    assert float(diffs[0]) < 1e-4
    (result,) = result_lines(proc.stdout)
    assert result == {"export_bitwise": True, "tensors": 3 + LAYERS * (6 + 1 + 3 * EXPERTS)}


def test_rollout_targets_cover_every_checkpoint_tensor(mixtral_dir):
    """engine.generation.hf.targets maps each checkpoint name (what the weight sync streams)
    to the transformers tensor holding it: the router renamed from `mlp.gate`, the experts
    as views of the fused `mlp.experts.gate_up_proj` / `down_proj`."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.generation.hf.targets import checkpoint_targets

    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    targets, canonical = checkpoint_targets(model)
    stored = load_file(f"{mixtral_dir}/model.safetensors")
    assert sorted(targets) == sorted(stored) == sorted(canonical)
    for name, tensor in stored.items():
        assert torch.equal(targets[name], tensor), name
    view = targets["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    fused = model.model.layers[2].mlp.experts.gate_up_proj
    assert view.data_ptr() == fused[5, WIDTH:].data_ptr()  # writes land in the fused tensor


_CONFIG = dict(model_type="mixtral", vocab_size=200, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, intermediate_size=32,
               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)


@pytest.mark.parametrize("extra,needle", [
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
    (dict(sliding_window=128), "sliding_window=128 is not supported"),
    (dict(sliding_window=511), "max_position_embeddings=512"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
])
def test_refused_fields_are_named(extra, needle):
    from models.families.base import UnsupportedConfigError
    from models.hf.config import check_config

    with pytest.raises(UnsupportedConfigError) as err:
        check_config({**_CONFIG, **extra})
    message = str(err.value)
    assert message.startswith("mixtral (MixtralForCausalLM) cannot be converted exactly")
    assert needle in message and message.count("config.json field") == 1, message


def test_accepted_fields():
    from models.hf.config import config_problems

    assert config_problems(_CONFIG) == []
    # a window no position within max_position_embeddings reaches cannot mask anything
    assert config_problems({**_CONFIG, "sliding_window": 512}) == []
    assert config_problems({**_CONFIG, "sliding_window": None}) == []


def test_sequences_longer_than_the_window_are_refused():
    """An accepted window (>= max_position_embeddings) still bounds train.seq_length: beyond
    it HF would mask keys the bridge attends to."""
    from types import SimpleNamespace

    from engine.config.schema import length_problems

    def problems(seq_length, window):
        cfg = SimpleNamespace(train=SimpleNamespace(seq_length=seq_length))
        return length_problems(cfg, {**_CONFIG, "sliding_window": window})

    assert problems(512, 512) == [] and problems(4096, None) == []
    (message,) = problems(513, 512)
    assert message.startswith("train.seq_length=513 exceeds the model's sliding_window=512")
    assert "supported: train.seq_length <= 512" in message
    assert length_problems(SimpleNamespace(train=SimpleNamespace(seq_length=10**6)),
                           {"model_type": "qwen3"}) == []


def test_moe_queries_and_registry():
    from models.families.base import UnsupportedArchitectureError
    from models.families.registry import expert_naming, experts_per_layer, family_of, is_moe

    assert is_moe(_CONFIG) and experts_per_layer(_CONFIG) == 8
    assert expert_naming(_CONFIG).expert(3, "up") == "block_sparse_moe.experts.3.w3.weight"
    assert not is_moe({"model_type": "llama"}) and experts_per_layer({"model_type": "x"}) == 0
    with pytest.raises(UnsupportedArchitectureError, match=r"mixtral \(MixtralForCausalLM\)"):
        family_of({"model_type": "mistral"})


def test_parameter_counts(mixtral_dir):
    from models.estimate.counting import stage_parameters
    from models.families.presets import MODEL_SHAPES
    from tests.test_convert import _tensors

    cfg = json.loads((Path(mixtral_dir) / "config.json").read_text())
    total = sum(t.numel() for t in _tensors(mixtral_dir).values())
    assert stage_parameters(cfg, 1, 1).total == total == 265792
    # one rank at TP2 x PP2 x EP2 holds 2 layers' 4 local experts split over 2 TP ranks
    assert stage_parameters(cfg, 2, 2, 2).expert_stage == 2 * 4 * 3 * HIDDEN * WIDTH // 2
    big = stage_parameters(MODEL_SHAPES["mixtral-8x7b"], 1, 1)
    assert round(big.total / 1e9, 1) == 46.7 and round(big.active / 1e9, 1) == 12.9


if __name__ == "__main__":
    from engine.cli import exit_process

    exit_process(main())
