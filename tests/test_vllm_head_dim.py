"""A model vLLM's CPU attention cannot run is refused at start (issue 90, item 5), not at its
first request: `serve --backend vllm` exits 2 before vLLM is imported, and rollout.backend=vllm
fails its config check, both naming the head dim and the smallest one vLLM runs
(engine.generation.vllm.attention.head_dim_problem). Positive controls: a 32-dim model passes
both checks, the hf backend takes the 16-dim one, and `demo model --head-dim 32` builds a demo
model the vllm backend takes (the default 16 it refuses). No vLLM engine starts here (that
vLLM's own list of head sizes is CPU_HEAD_DIMS: tests/test_vllm_failures.py, which imports
vLLM).
"""
from __future__ import annotations

import json

import pytest

from engine.config.schema import load_config
from engine.generation.vllm.attention import CPU_HEAD_DIMS, head_dim_problem
from engine.generation.vllm.settings import vllm_problems
from engine.rl.config import RLConfig
from engine.serve.__main__ import main as serve_main
from engine.serve.run import backend_problem
from tools.tiny_models import build_tiny_model


def test_head_dims_outside_vllms_cpu_attention_are_named():
    assert head_dim_problem({"hidden_size": 128, "num_attention_heads": 4}) is None
    assert head_dim_problem({"model_type": "x", "head_dim": 64}) is None
    assert head_dim_problem({}) is None                     # nothing to say about
    assert head_dim_problem({"head_dim": 16, "kv_lora_rank": 32}) is None   # MLA: CPU_MLA
    why = head_dim_problem({"hidden_size": 64, "num_attention_heads": 4})
    assert why.startswith("the model's head dim (hidden_size 64 / num_attention_heads 4) "
                          "is 16; vLLM's CPU attention runs head dims of at least 32")
    assert "head_dim is 48;" in head_dim_problem({"text_config": {"head_dim": 48}})
    assert CPU_HEAD_DIMS[0] == 32 and 48 not in CPU_HEAD_DIMS


def _cfg(*argv: str) -> RLConfig:
    return load_config(RLConfig, ["model.hf_path=/nonexistent", *argv])[0]


def test_rollout_backend_vllm_refuses_small_heads_by_name():
    small = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4}
    problems = vllm_problems(_cfg("rollout.backend=vllm"), small)
    assert any(p.startswith("rollout.backend=vllm on a CPU host: the model's head dim "
                            "(hidden_size 64 / num_attention_heads 4) is 16") and
               "at least 32" in p for p in problems), problems
    assert vllm_problems(_cfg("rollout.backend=vllm"), {**small, "hidden_size": 128}) == []
    assert vllm_problems(_cfg("rollout.backend=hf"), small) == []


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("heads")
    return {dim: build_tiny_model(str(root / str(dim)), "llama", hidden=4 * dim, layers=1,
                                  heads=4, kv_heads=2, intermediate=64)
            for dim in (16, 32)}


def test_serve_backend_vllm_refuses_small_heads_before_loading(folders, capsys):
    assert serve_main(["--model", folders[16], "--backend", "vllm"]) == 2
    err = capsys.readouterr().err
    assert f"error: --model {folders[16]!r} does not run on the vllm backend on a CPU host: " \
           "the model's head_dim is 16; vLLM's CPU attention runs head dims of at least 32" in err
    assert err.rstrip().endswith("use --backend hf")
    assert json.loads(open(f"{folders[32]}/config.json").read())["head_dim"] == 32
    for dim, backend in ((32, "vllm"), (16, "hf")):    # positive controls
        assert backend_problem(backend, folders[dim]) is None


def test_demo_model_with_head_dim_32_passes_the_vllm_check(tmp_path):
    from tools.demo import main as demo_main

    for dim, ok in ((32, True), (16, False)):
        out = str(tmp_path / str(dim))
        argv = ["model", out, "--layers", "1"] + (["--head-dim", "32"] if ok else [])
        assert demo_main(argv) == 0
        config = json.loads(open(f"{out}/config.json").read())
        assert (config["num_attention_heads"], config["head_dim"]) == (4, dim)
        assert (backend_problem("vllm", out) is None) == ok
