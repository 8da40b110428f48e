"""`engine.rm` through the command line, as a user runs it (`-m engine.rm` on the ranks of the
session's rank pool, as torchrun runs it): the demo's model and preference files
(tools/demo.py), LoRA on the body with the head trained in full, TRL RewardTrainer's metric names,
evaluation on held-out pairs, a resume (the head comes back from the LoRA checkpoint), the
export as a sequence classifier that transformers scores like the trainer, `--help` and
`--validate` of the H100 recipe; runs started from *ForSequenceClassification folders (tied
Qwen3, untied Llama) against a plain transformers loop that scores the end-of-turn token. The
layouts and the math: tests/test_rm.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import run_cli, run_python
from tests.metrics_docs import undocumented

REQUIRED = ("step", "loss", "grad_norm", "lr", "accuracy", "margin", "mean_reward", "min_reward",
            "max_reward", "rewards/chosen", "rewards/rejected", "num_pairs",
            "data/consumed_pairs")


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


def _side_ids(tokenizer, row: dict, side: str, end_of_turn: bool = True) -> list[int]:
    """The row's prompt + side rendered by transformers' apply_chat_template (ChatML:
    `... <|im_end|>\n`), cut after the last end-of-turn token `<|im_end|>` (the ids RL's
    responses end on), or whole (`end_of_turn=False`: the old rule's last rendered id, "\n")."""
    ids = list(tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=True,
                                             return_dict=False))
    if not end_of_turn:
        return ids
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids[-1] != eot                              # the template renders "\n" after it
    return ids[:len(ids) - ids[::-1].index(eot)]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _eval_chosen_scores(model_dir: str, assets: Path) -> list[float]:
    """transformers' scores of the held-out chosen sides, each alone, up to its end-of-turn
    token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "model"))
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([_side_ids(tokenizer, row, "chosen")]))
                      .logits[0, 0]) for row in _rows(assets / "dpo_eval.jsonl")]


def plain_reference(model_dir: str, rows: list[dict], steps: int, pairs: int, lr: float,
                    end_of_turn: bool = True) -> dict[str, list[float]]:
    """{loss, grad_norm}: a plain transformers AutoModelForSequenceClassification + torch AdamW
    loop (the engine's optim defaults: betas 0.9/0.95, eps 1e-8, no weight decay, clip 1,
    constant lr) on `pairs` rows per step in file order, each side rendered by
    apply_chat_template and scored alone at its end-of-turn token (transformers' last-token
    rule), the Bradley-Terry loss."""
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    out = {"loss": [], "grad_norm": []}
    for step in range(steps):
        batch = rows[step * pairs:(step + 1) * pairs]
        score = lambda row, side: model(input_ids=torch.tensor(
            [_side_ids(tokenizer, row, side, end_of_turn)])).logits[0, 0]
        rc = torch.stack([score(row, "chosen") for row in batch])
        rr = torch.stack([score(row, "rejected") for row in batch])
        loss = -F.logsigmoid(rc - rr).mean()
        opt.zero_grad()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        out["loss"].append(float(loss.detach()))
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_classifier_folder_trains_its_end_of_turn_token_from_the_command_line(
        pools, demo_assets, tmp_path, arch):
    """`-m engine.rm model.hf_path=<Qwen3ForSequenceClassification (tied) or
    LlamaForSequenceClassification (untied) folder>` (ChatML template: a side renders as
    `... <|im_end|>\n`) runs, and its per-step loss and grad norm are a plain transformers loop's
    that scores each side's end-of-turn token (rel 1e-4); the old rule (the last rendered id,
    the untrained "\n") misses. rm.init_std stays refused for such a folder."""
    from tests.test_reward_model_convert import build_reward_model

    model = build_reward_model(tmp_path / arch, arch, seed=1)
    steps, pairs, lr = (3, 8, 1e-3) if arch == "qwen3" else (2, 4, 1e-3)
    args = ["-m", "engine.rm", f"model.hf_path={model}",
            f"data.train_files=[{demo_assets / 'dpo_train.jsonl'}]", "data.shuffle=false",
            f"train.global_batch_size={pairs}", "train.micro_batch_size=2",
            "train.seq_length=64", f"train.max_steps={steps}", f"optim.lr={lr}",
            "optim.schedule=constant", "logging.progress_bar=false", f"logging.dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_interval=0"]
    refused = run_cli("engine.rm", *args[2:], "rm.init_std=0.1") if arch == "llama" else None
    proc = pools.script(1, *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with its score head" in proc.stdout
    rows = _metrics(tmp_path)
    rows_in = _rows(demo_assets / "dpo_train.jsonl")
    ref = plain_reference(model, rows_in, steps, pairs, lr)
    for k in ("loss", "grad_norm"):
        for r, b in zip(rows, ref[k]):
            assert r[k] == pytest.approx(b, rel=1e-4), (k, [r[k] for r in rows], ref[k])
    # RL scores prompt + response as generated (a stopped response ends on <|im_end|>): the
    # very ids the engine trained on, scored at the same last position
    from transformers import AutoTokenizer

    from engine.data.preference import load_preference_dataset
    from engine.rm.training import scored_ids

    tok = AutoTokenizer.from_pretrained(model)
    sides = load_preference_dataset([str(demo_assets / "dpo_train.jsonl")], tok, 63, "error")
    for i, row in enumerate(rows_in[:4]):
        prompt = list(tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
        response = tok.encode(row["chosen"][0]["content"], add_special_tokens=False)
        rl_ids = prompt + response + [tok.convert_tokens_to_ids("<|im_end|>")]
        assert scored_ids(sides[i].chosen) == rl_ids == _side_ids(tok, row, "chosen")
    old = plain_reference(model, rows_in, 1, pairs, lr, end_of_turn=False)

    assert abs(old["loss"][0] - rows[0]["loss"]) > 1e-3 * rows[0]["loss"], (old, rows[0])
    if refused is not None:
        assert refused.returncode == 2
        assert "rm.init_std=0.1: model.hf_path is a sequence classifier" in refused.stderr
    # SFT, DPO and RL need an LM head: the same folder is refused before any process group,
    # naming the entry point that trains it (the folder check itself now accepts classifiers)
    sft_rows = tmp_path / "sft.jsonl"
    sft_rows.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                                 {"role": "assistant", "content": "b"}]}) + "\n")
    for entry, data in (("engine.sft", sft_rows), ("engine.dpo", demo_assets / "dpo_train.jsonl")):
        other = run_cli(entry, f"model.hf_path={model}", f"data.train_files=[{data}]")
        assert other.returncode == 2, (entry, other.stderr[-2000:])
        assert "is a sequence classifier" in other.stderr and "python -m engine.rm" in \
            other.stderr, (entry, other.stderr[-2000:])


def test_run_logs_metrics_evaluates_resumes_and_exports(pools, demo_assets, tmp_path):
    proc = pools.script(2, *_args(demo_assets, tmp_path, 2), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "[rm] reward model:" in proc.stdout and "a new score head" in proc.stdout
    # a side may have train.seq_length ids (the RM reads the last one): the data line says so
    # (it said "train.seq_length=63 tokens" for train.seq_length=64)
    assert "sides longer than train.seq_length=64 ids cut on" in proc.stdout, proc.stdout
    assert "train.seq_length=63" not in proc.stdout
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["num_pairs"] == 8 and 0 <= r["accuracy"] <= 1
        assert r["margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"],
                                            abs=1e-6)
        assert r["mean_reward"] == pytest.approx(
            (r["rewards/chosen"] + r["rewards/rejected"]) / 2, abs=1e-6)
        assert r["min_reward"] <= min(r["rewards/chosen"], r["rewards/rejected"])
        assert r["max_reward"] >= max(r["rewards/chosen"], r["rewards/rejected"])
    assert "eval/accuracy" in rows[1] and "eval/loss" in rows[1] and "eval/margin" in rows[1]
    assert undocumented({k for r in rows for k in r}) == []   # docs/metrics.md names them all
    # the step-2 checkpoint as transformers' sequence classifier (LoRA merged): its mean score
    # of the held-out chosen sides (each up to its end-of-turn token, where RL's responses
    # end) is the engine's eval/rewards/chosen after step 2
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
