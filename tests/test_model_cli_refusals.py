"""HF models the bridge cannot convert exactly are refused at `engine.sft` / `engine.rl` start,
before any process group exists: exit code 2, one `error:` line naming the config field (or the
leftover tensors), no traceback through our code. Run as in tests/test_cli_errors.py: the
module's `main(argv)` in this process as rank 0 of a 1-rank job.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_cli_errors import Case, assert_reported_once, chat_row, launch, write_lines
from tools.tiny_models import build_tiny_model

CASES = [
    Case("sft_rope_dynamic", ("model.hf_path={dynamic}",), needles=(
        "model.hf_path={dynamic}: qwen3 (Qwen3ForCausalLM) cannot be converted exactly",
        "rope_parameters.rope_type='dynamic'", "supported: default, linear, llama3, yarn")),
    Case("rl_sliding_window", ("model.hf_path={sliding}",), module="engine.rl", data="prompts",
         needles=("model.hf_path={sliding}: ", "use_sliding_window=True with sliding_window=8 "
                  "and max_window_layers=2 gives layers 2..3 sliding-window attention")),
    Case("sft_leftover_tensor", ("model.hf_path={leftover}",), needles=(
        "model.hf_path={leftover}: the checkpoint holds 1 tensor(s) the qwen3 mapping would "
        "not consume", "model.layers.1.mlp.extra_proj.weight")),
]


def _edit_config(src: Path, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("model_refusals")
    model = Path(build_tiny_model(str(root / "model"), "qwen3", hidden=64, layers=4, heads=8,
                                  kv_heads=2, intermediate=64))
    leftover = Path(_edit_config(model, root / "leftover"))
    tensors = load_file(str(leftover / "model.safetensors"))
    tensors["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(leftover / "model.safetensors"), metadata={"format": "pt"})
    return {
        "model": str(model), "tmp": str(root), "leftover": str(leftover),
        "dynamic": _edit_config(model, root / "dynamic", rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "sliding": _edit_config(model, root / "sliding", use_sliding_window=True,
                                sliding_window=8, max_window_layers=2, layer_types=None),
        "train": write_lines(root / "train.jsonl", [chat_row(a, 5) for a in range(5, 9)]),
        "prompts": write_lines(root / "prompts.jsonl",
                               [{"prompt": f"what is {a} + 1 ?", "answer": str(a + 1)}
                                for a in range(4)]),
    }


@pytest.fixture(scope="module")
def outcomes(paths) -> dict:
    return {c.name: launch(c, paths) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused_at_start(case, paths, outcomes):
    assert_reported_once(outcomes[case.name], case.expected(paths))
