"""tinker-cookbook 0.6.1's own loops against `megatron-sft-engine tinker` (engine.tinker):
`recipes/sl_loop.py` and `recipes/rl_loop.py` run their unmodified `main` for 3 steps on a tiny
local Llama (tools.tiny_models; nothing is downloaded), served under a name the cookbook's model
registry knows (meta-llama/Llama-3.2-1B, whose recommended renderer is role_colon). Pointed at
local files are only the hub loaders: the tokenizer through the cookbook's own
`tokenizer_utils.register_tokenizer`, and `datasets.load_dataset` (No Robots and GSM8K rows
written here). sl_loop: its logged train_mean_nll falls over the 3 steps; rl_loop (loss_fn
importance_sampling; its default stable_reinforce is not served, docs/tinker.md) samples 4
groups of 4 replies per step through save_weights_and_get_sampling_client and logs their
reward at each step. A random tiny model boxes no answer, so every reward is 0 and the loop
itself skips its forward_backward (its "all advantages zero" branch); the RL losses' numbers
are checked in tests/test_tinker.py."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("tinker")
sl_loop = pytest.importorskip("tinker_cookbook.recipes.sl_loop")
rl_loop = pytest.importorskip("tinker_cookbook.recipes.rl_loop")

from tests.test_tinker import _serve  # noqa: E402
from tools.tiny_models import build_eos_model  # noqa: E402

NAME = "meta-llama/Llama-3.2-1B"
KEY = "tml-cookbook"
def _rows(kind: str, n: int) -> "object":
    import datasets

    if kind == "sl":
        rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i} ?"},
                              {"role": "assistant", "content": f"it is {2 * i} ."}]}
                for i in range(n)]
    else:
        rows = [{"question": f"what is {i % 3} plus 1 ?",
                 "answer": f"{i % 3} plus 1 is {i % 3 + 1}\n#### {i % 3 + 1}"} for i in range(n)]
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})


def _metrics(log_path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cookbook_server(tmp_path_factory):
    from transformers import AutoTokenizer

    from tinker_cookbook import tokenizer_utils

    root = tmp_path_factory.mktemp("cookbook")
    model = build_eos_model(str(root / "llama"))
    tokenizer_utils.register_tokenizer(NAME, lambda: AutoTokenizer.from_pretrained(model))
    info = _serve(["--model", model, "--served-model-name", NAME, "--api-key", KEY,
                   "--state-dir", str(root / "state")])
    yield info
    info["stop"]()


def test_sl_loop_trains_for_3_steps(cookbook_server, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: _rows("sl", 16))
    config = sl_loop.Config(base_url=cookbook_server["url"], log_path=str(tmp_path / "sl"),
                            model_name=NAME, batch_size=4, learning_rate=2e-2, lora_rank=4,
                            max_length=64, save_every=0, max_steps=3)
    sl_loop.main(config)
    steps = _metrics(tmp_path / "sl")
    nll = [s["train_mean_nll"] for s in steps]
    assert [s["step"] for s in steps] == [0, 1, 2] and nll[2] < nll[1] < nll[0], steps
    assert all(s["num_sequences"] == 4 for s in steps)


def test_rl_loop_samples_scores_and_trains_for_3_steps(cookbook_server, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: _rows("rl", 12))
    config = rl_loop.Config(base_url=cookbook_server["url"], log_path=str(tmp_path / "rl"),
                            model_name=NAME, batch_size=4, group_size=4, learning_rate=1e-3,
                            lora_rank=4, max_tokens=8, save_every=0, max_steps=3,
                            loss_fn="importance_sampling")
    rl_loop.main(config)
    steps = _metrics(tmp_path / "rl")
    assert [s["step"] for s in steps] == [0, 1, 2], steps
    assert all(s["reward/total"] == 0.0 for s in steps), steps
    assert all(s["progress/batch"] == i for i, s in enumerate(steps)), steps
