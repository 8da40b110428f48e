"""`engine.rm` through the command line, as a user runs it (`-m engine.rm` on the ranks of the
session's rank pool, as torchrun runs it): the demo's model and preference files
(tools/demo.py), LoRA on the body with the head trained in full, the issue's metric names,
evaluation on held-out pairs, a resume (the head comes back from the LoRA checkpoint), the
export as a sequence classifier that transformers scores like the trainer, `--help` and
`--validate` of the H100 recipe. The layouts and the math: tests/test_rm.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import run_cli, run_python
from tests.metrics_docs import undocumented

REQUIRED = ("step", "loss", "grad_norm", "lr", "accuracy", "rewards/chosen", "rewards/rejected",
            "rewards/margins", "num_pairs", "data/consumed_pairs")


def _args(assets, log_dir, steps, *extra):
    return ["-m", "engine.rm", f"model.hf_path={assets / 'model'}",
            f"data.train_files=[{assets / 'dpo_train.jsonl'}]",
            f"data.eval_files=[{assets / 'dpo_eval.jsonl'}]", "train.eval_interval=2",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
            f"train.max_steps={steps}", "optim.lr=1e-3", "optim.schedule=constant",
            "model.lora.rank=4", "rm.center_rewards_coefficient=0.01",
            "logging.progress_bar=false", f"logging.dir={log_dir}",
            f"checkpoint.dir={log_dir / 'ckpt'}", "checkpoint.save_interval=2", *extra]


def _metrics(log_dir):
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def _eval_chosen_scores(model_dir: str, assets: Path) -> list[float]:
    """transformers' scores of the held-out chosen sides (the engine's rendering of the rows,
    each side scored alone: its last token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from engine.data.preference import load_preference_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "model"))
    pairs = load_preference_dataset([str(assets / "dpo_eval.jsonl")], tokenizer, 63, "error")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for i in range(len(pairs)):
            side = pairs[i].chosen
            ids = torch.tensor([list(side.tokens) + [side.labels[-1]]])
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_run_logs_metrics_evaluates_resumes_and_exports(pools, demo_assets, tmp_path):
    proc = pools.script(2, *_args(demo_assets, tmp_path, 2), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "[rm] reward model:" in proc.stdout and "a new score head" in proc.stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["num_pairs"] == 8 and 0 <= r["accuracy"] <= 1
        assert r["rewards/margins"] == pytest.approx(
            r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    assert "eval/accuracy" in rows[1] and "eval/loss" in rows[1]
    assert undocumented({k for r in rows for k in r}) == []   # docs/metrics.md names them all
    # the step-2 checkpoint as transformers' sequence classifier (LoRA merged): its mean score
    # of the held-out chosen sides is the engine's eval/rewards/chosen after step 2
    out = tmp_path / "hf"
    conv = run_python("tools/convert.py", "mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"),
                      "--out", str(out), "--merge", "--base", str(demo_assets / "model"))
    assert conv.returncode == 0, conv.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    scores = _eval_chosen_scores(str(out), demo_assets)
    assert sum(scores) / len(scores) == pytest.approx(rows[1]["eval/rewards/chosen"], rel=1e-5,
                                                      abs=1e-6)
    resumed = pools.script(2, *_args(demo_assets, tmp_path, 3), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["data/consumed_pairs"] == 24


def test_help_lists_the_rm_keys():
    proc = run_cli("engine.rm", "--help")
    assert proc.returncode == 0
    for key in ("rm.init_std", "rm.center_rewards_coefficient", "model.hf_path",
                "train.global_batch_size"):
        assert key in proc.stdout, key


def test_h100_recipe_validates():
    proc = run_cli("engine.rm", "--config", "recipes/rm/qwen3_8b_rm_h100.yaml", "--validate")
    assert proc.returncode == 0, proc.stderr
    assert "pairs: 64 per step (128 sequences), 1 per micro-batch" in proc.stdout
    assert "Bradley-Terry" in proc.stdout


def test_refusals_name_the_key(demo_assets):
    proc = run_cli("engine.rm", *_args(demo_assets, Path("unused"), 1)[2:], "rm.init_std=-1",
                   "rm.center_rewards_coefficient=0")
    assert proc.returncode == 2
    assert "rm.init_std=-1.0 must be null or > 0" in proc.stderr, proc.stderr
    assert "rm.center_rewards_coefficient=0.0 must be null (off) or > 0" in proc.stderr


def test_demo_rows_are_valid_preference_pairs(tmp_path):
    """recipes/rm_cpu_demo.sh's rows (tools/demo.py rm-data): 80 training and 20 held-out pairs
    on disjoint prompts, each read by the preference loader; SFT rows in both formats."""
    import json

    from tools.demo import make_rm_data

    make_rm_data(tmp_path)
    train = [json.loads(l) for l in (tmp_path / "rm_train.jsonl").read_text().splitlines()]
    held = [json.loads(l) for l in (tmp_path / "rm_eval.jsonl").read_text().splitlines()]
    assert len(train) == 80 and len(held) == 20
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}
    assert not prompts(train) & prompts(held)
    assert all(r["chosen"][0]["content"] == "the answer is " + r["rejected"][0]["content"]
               for r in train + held)
    assert len((tmp_path / "rm_sft.jsonl").read_text().splitlines()) == 200
