"""checkpoint.save_hf: every saved checkpoint also holds `iter_NNNNNNN/hf/`, the folder
`tools/convert.py mcore-to-hf` writes from that checkpoint (engine.checkpoint.hf_export, the
export both share), written from the training model at save time; the checkpoint's own source
files (HF config, tokenizer, pass-through tensors) are in `iter_NNNNNNN/hf_source/`.

Real `-m engine.sft` runs of a tiny Qwen3 on the session's rank pool (tests/pool.py):
  one process, 3 steps, a save every step, keep_last=2: iter_0000003/hf/ against
      convert's output of iter_0000003: the same files, the same tensors (names, dtypes,
      shapes, bytes), byte-equal config/tokenizer files, and model.safetensors byte for byte;
      it loads in transformers (one forward). Negative controls: iter_0000002's folder (one
      step older) differs from it, and so does the source model. keep_last removed
      iter_0000001 with its folder; complete.json lists the folder's files;
  the same checkpoint in the layout written before hf_source/ (its own folder as hf/, no
      export): it converts to the same folder bitwise, and a run resumes from it; convert
      reads hf_source/ when both folders are there (control: a changed hf/config.json is not
      read), and refuses --out on the old layout's own folder;
  PP2 on two ranks, in bf16: the pipeline's second stage is handed to rank 0, and the weights
      are upcast as convert reads a bf16 checkpoint back (fp32): bitwise equal to convert;
  LoRA on one process: hf/ is the peft adapter folder convert writes (adapter tensors
      bitwise, adapter_config.json equal);
  GLM-4.5 (MoE) training its MTP layer at EP2: experts and the MTP layer bitwise;
  PPO (engine.rl, one process): the critic's folder (*ForTokenClassification) and the
      policy's, each bitwise equal to convert's; with a LoRA policy too (the critic is a full
      model: convert once read its config.yaml's model.lora.* and failed on it);
  a reward model (engine.rm) at TP2 on two ranks, started from a causal LM: the score head
      gathered over TP, config.json (one label, pad_token_id), the scoring chat template and
      README.md (engine.rm.export, handed to the save by the RM run) equal to convert's, the
      README naming its own folder (convert's names --out: equal once that path is replaced;
      control: the unreplaced READMEs differ); the scoring template ends a reply on its
      end-of-turn token in transformers' apply_chat_template, and the folder scores in
      transformers' sequence classifier. Control: the source model differs from it;
  a reward model with LoRA at PP2 on two ranks: hf/ is convert's peft SEQ_CLS adapter (the
      score head, trained in full on the last stage, in modules_to_save; adapter tensors
      bitwise, adapter_config.json equal); peft loads it on the base as a sequence classifier
      with that head. Control: the step-older folder differs (score head and adapters).
Refusals (in this process): save_hf without checkpoint.dir; a reward-model run's save_hf with
a pad id that is the end-of-turn id the model scores (LoRA is not refused); a reward model's
full folder without its run's scoring files (engine.checkpoint.hf_export.save_hf_problem).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.io import (LATEST_FILE, checkpoint_problems, iteration_dir, iteration_of,
                                  read_latest)
from models.bridge.checkpoint import LEGACY_SOURCE_DIR, SOURCE_DIR, source_dir
from tests.conftest import CONVERT
from tests.launch import run_main
from tools.convert import main as convert_main

EXPORT = "hf"            # checkpoint.save_hf's folder (engine.checkpoint.hf_export.HF_EXPORT_DIR)


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from tools.demo import chat_row
    from tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("save_hf")
    model = build_tiny_model(str(root / "model"), "qwen3", vocab_size=200,
                             initializer_range=0.1)
    train = _write_jsonl(root / "train.jsonl", [chat_row(a, b) for a in range(8)
                                                for b in range(2)])
    return {"root": root, "model": model, "train": train}


def _sft(pools, assets, world: int, name: str, *extra: str) -> Path:
    """A tiny SFT run with checkpoint.save_hf=true; returns its checkpoint.dir."""
    run = assets["root"] / name
    proc = pools.script(world, "-m", "engine.sft", f"model.hf_path={assets['model']}",
                        f"data.train_files=[{assets['train']}]", "model.dtype=float32",
                        "train.global_batch_size=4", "train.micro_batch_size=2",
                        "train.seq_length=32", "optim.lr=1e-2", "optim.eps=1e-4",
                        "logging.progress_bar=false", f"logging.dir={run}",
                        f"checkpoint.dir={run / 'ckpt'}", "checkpoint.save_interval=1",
                        "checkpoint.save_hf=true", *extra, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"[checkpoint] {EXPORT}/ written: " in proc.stdout
    return run / "ckpt"


def _convert(pools, ckpt: Path, out: Path) -> Path:
    proc = pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out),
                        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return out


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _tensors(folder: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(folder / name))


def _differences(a: dict, b: dict) -> list[str]:
    """Why two tensor dicts are not bitwise equal ([]: they are)."""
    if sorted(a) != sorted(b):
        return [f"names differ: {sorted(set(a) ^ set(b))[:4]}"]
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or a[n].view(torch.uint8).flatten().tolist() != b[n].view(torch.uint8).flatten()
            .tolist()]


def _assert_same_folder(saved: Path, converted: Path, weights: str = "model.safetensors"):
    assert _files(saved) == _files(converted)
    assert _differences(_tensors(saved, weights), _tensors(converted, weights)) == []
    for name in _files(converted):
        if not name.endswith(".safetensors"):   # config, tokenizer, chat template
            assert (saved / name).read_bytes() == (converted / name).read_bytes(), name


@pytest.fixture(scope="module")
def one_process(pools, assets) -> Path:
    return _sft(pools, assets, 1, "one", "train.max_steps=3", "checkpoint.keep_last=2")


def test_save_hf_equals_convert_bitwise_and_loads(pools, one_process, assets, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = one_process
    assert read_latest(ckpt) == 3
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    saved = iteration_dir(ckpt, 3) / EXPORT
    converted = _convert(pools, iteration_dir(ckpt, 3), tmp_path / "converted")
    _assert_same_folder(saved, converted)
    assert "model.safetensors" in _files(saved) and "config.json" in _files(saved)
    assert (saved / "model.safetensors").read_bytes() == \
        (converted / "model.safetensors").read_bytes()
    # the folder is part of the checkpoint: its files are in the completeness marker
    marker = json.loads((iteration_dir(ckpt, 3) / "complete.json").read_text())
    assert f"{EXPORT}/model.safetensors" in marker["files"]
    assert checkpoint_problems(iteration_dir(ckpt, 3)) == []
    # negative controls: a step older, and the source model, differ from it
    now = _tensors(saved)
    assert _differences(_tensors(iteration_dir(ckpt, 2) / EXPORT), now)
    assert _differences(_tensors(Path(assets["model"])), now)
    model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 42, 9]])).logits
    assert logits.shape == (1, 4, 200) and torch.isfinite(logits).all()


def _as_legacy(ckpt: Path, root: Path) -> Path:
    """A copy of the checkpoint `ckpt` (save_hf's layout) as one written before hf_source/:
    its own folder under hf/ and no export, complete.json listing the files so, in the run
    directory `root` whose latest file names it."""
    it = iteration_of(ckpt)
    old = iteration_dir(root, it)
    shutil.copytree(ckpt, old)
    shutil.rmtree(old / EXPORT)
    (old / SOURCE_DIR).rename(old / LEGACY_SOURCE_DIR)
    marker = json.loads((old / "complete.json").read_text())
    moved = {}
    for rel, size in marker["files"].items():
        if rel.startswith(f"{SOURCE_DIR}/"):
            moved[f"{LEGACY_SOURCE_DIR}/{rel[len(SOURCE_DIR) + 1:]}"] = size
        elif not rel.startswith(f"{EXPORT}/"):
            moved[rel] = size
    marker["files"] = moved
    (old / "complete.json").write_text(json.dumps(marker))
    (root / LATEST_FILE).write_text(f"{it}\n")
    return old


def test_old_layout_converts_and_resumes(pools, one_process, assets, tmp_path):
    new = iteration_dir(one_process, 3)
    # the new layout: the checkpoint's own folder beside save_hf's export
    assert (new / SOURCE_DIR / "config.json").is_file()
    assert not (new / SOURCE_DIR / "model.safetensors").exists()
    assert source_dir(new) == new / SOURCE_DIR
    old = _as_legacy(new, tmp_path / "old")
    assert checkpoint_problems(old) == [] and not (old / SOURCE_DIR).exists()
    assert source_dir(old) == old / LEGACY_SOURCE_DIR
    _assert_same_folder(new / EXPORT, _convert(pools, old, tmp_path / "from_old"))
    refused = run_main(convert_main, ["mcore-to-hf", "--ckpt", str(old), "--out",
                                      str(old / LEGACY_SOURCE_DIR), "--overwrite"])
    assert refused.returncode == 2 and "the checkpoint's own folder" in refused.stderr
    assert (old / LEGACY_SOURCE_DIR / "config.json").is_file()   # nothing removed
    # both folders present: hf_source/ is read; a changed hf/config.json (control) is not
    both = tmp_path / "both" / new.name
    shutil.copytree(new, both)
    config = json.loads((both / EXPORT / "config.json").read_text())
    (both / EXPORT / "config.json").write_text(json.dumps({**config, "vocab_size": 7}))
    _assert_same_folder(new / EXPORT, _convert(pools, both, tmp_path / "from_both"))
    # a run resumes from the old layout (3 steps done, one more) and saves the new one
    resumed = _sft(pools, assets, 1, "resumed", "train.max_steps=4",
                   "checkpoint.schedule=config", f"checkpoint.resume={old}")
    assert sorted(p.name for p in resumed.glob("iter_*")) == ["iter_0000004"]
    assert (iteration_dir(resumed, 4) / SOURCE_DIR / "config.json").is_file()
    assert checkpoint_problems(iteration_dir(resumed, 4)) == []


def test_pp2_bf16_save_hf_equals_convert_bitwise(pools, assets, tmp_path):
    ckpt = _sft(pools, assets, 2, "pp2", "train.max_steps=1", "parallel.pp=2",
                "model.dtype=bfloat16")
    saved = iteration_dir(ckpt, 1) / EXPORT
    assert not list(saved.glob(".stage*"))   # the second stage's hand-over file is gone
    converted = _convert(pools, iteration_dir(ckpt, 1), tmp_path / "converted")
    _assert_same_folder(saved, converted)
    tensors = _tensors(saved)
    assert {t.dtype for t in tensors.values()} == {torch.float32}   # as convert reads bf16
    assert all(torch.equal(t, t.bfloat16().float()) for t in tensors.values())
    assert "model.layers.3.mlp.down_proj.weight" in tensors   # the last stage's layer


def test_lora_save_hf_is_converts_peft_adapter(pools, assets, tmp_path):
    ckpt = _sft(pools, assets, 1, "lora", "train.max_steps=1", "model.lora.rank=4",
                "model.lora.alpha=8")
    saved = iteration_dir(ckpt, 1) / EXPORT
    converted = _convert(pools, iteration_dir(ckpt, 1), tmp_path / "converted")
    assert _files(saved) == ["adapter_config.json", "adapter_model.safetensors"]
    _assert_same_folder(saved, converted, "adapter_model.safetensors")
    b = [t for n, t in _tensors(saved, "adapter_model.safetensors").items() if "lora_B" in n]
    assert b and any(t.abs().max() > 0 for t in b)   # trained: B starts at zero


def test_moe_ep2_trained_mtp_save_hf_equals_convert_bitwise(pools, tmp_path):
    """GLM-4.5 (MoE) training its MTP layer at EP2 on two ranks: the experts gathered over
    the expert-parallel group, the MTP layer and its copies of the embedding and head."""
    from tests.glm4_moe_tiny import build_glm4_moe
    from tools.demo import chat_row

    model = build_glm4_moe(str(tmp_path / "model"), mtp="full", num_hidden_layers=4)
    assets = {"root": tmp_path, "model": model, "train": _write_jsonl(
        tmp_path / "train.jsonl", [chat_row(a, b) for a in range(4) for b in range(2)])}
    ckpt = _sft(pools, assets, 2, "mtp", "train.max_steps=1", "parallel.ep=2",
                "model.mtp.enabled=true")
    saved = iteration_dir(ckpt, 1) / EXPORT
    converted = _convert(pools, iteration_dir(ckpt, 1), tmp_path / "converted")
    _assert_same_folder(saved, converted)
    tensors = _tensors(saved)
    assert "model.layers.4.eh_proj.weight" in tensors   # the trained MTP layer
    assert any(".mlp.experts." in n for n in tensors)
    assert _differences(_tensors(Path(model)), tensors)   # trained: not the source


def _ppo(pools, assets, run: Path, *extra: str) -> None:
    """A one-process, one-step RL run with a PPO critic and checkpoint.save_hf=true."""
    prompts = _write_jsonl(run.with_suffix(".jsonl"), [{"prompt": f"what is {i} plus 1 ?",
                                                        "answer": i + 1} for i in range(4)])
    proc = pools.script(
        1, "-m", "engine.rl", f"model.hf_path={assets['model']}", f"data.train_files=[{prompts}]",
        "algorithm=ppo", "critic.lr=2e-3", "reward.fn=tests.test_rl_loop:digit_reward",
        "kl.beta=0", "rollout.n=2", "rollout.max_new_tokens=4", "train.prompts_per_step=2",
        "train.micro_batch_size=1", "train.max_steps=1", "train.seq_length=32",
        f"data.cache_dir={run}/cache", "data.num_workers=0", f"logging.dir={run}",
        "logging.progress_bar=false", f"checkpoint.dir={run / 'ckpt'}",
        "checkpoint.save_hf=true", *extra, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_ppo_critic_and_policy_save_hf_equal_convert(pools, assets, tmp_path):
    """An RL run with a PPO critic (one process, one step): checkpoint.dir/critic/iter_*/
    hf/ is convert's *ForTokenClassification folder of the critic checkpoint, and the
    policy's folder is convert's of the policy checkpoint."""
    run = tmp_path / "ppo"
    _ppo(pools, assets, run)
    for ckpt in (run / "ckpt" / "critic", run / "ckpt"):
        saved = iteration_dir(ckpt, 1) / EXPORT
        converted = _convert(pools, iteration_dir(ckpt, 1), tmp_path / f"conv_{ckpt.name}")
        _assert_same_folder(saved, converted)
    critic = _tensors(iteration_dir(run / "ckpt" / "critic", 1) / EXPORT)
    assert "score.weight" in critic and "score.bias" in critic and "lm_head.weight" not in critic
    config = json.loads((iteration_dir(run / "ckpt" / "critic", 1) / EXPORT / "config.json")
                        .read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"]


def test_ppo_lora_policy_critic_save_hf_equals_convert(pools, assets, tmp_path):
    """PPO with a LoRA policy: the critic is a full model (engine.rl.policy.train_step), so
    its checkpoint (whose config.yaml names the policy's model.lora.*) converts, and saves,
    as the full *ForTokenClassification folder; the policy's folder is its peft adapter."""
    run = tmp_path / "ppo_lora"
    _ppo(pools, assets, run, "model.lora.rank=4", "model.lora.alpha=8")
    critic = iteration_dir(run / "ckpt" / "critic", 1)
    saved = critic / EXPORT
    _assert_same_folder(saved, _convert(pools, critic, tmp_path / "conv_critic"))
    tensors = _tensors(saved)
    assert "score.weight" in tensors and not any("lora" in n for n in tensors)
    policy = iteration_dir(run / "ckpt", 1)
    assert _files(policy / EXPORT) == ["adapter_config.json", "adapter_model.safetensors"]
    _assert_same_folder(policy / EXPORT, _convert(pools, policy, tmp_path / "conv_policy"),
                        "adapter_model.safetensors")



def _train_rm(pools, assets, run: Path, *overrides: str):
    """engine.rm on two pool ranks for 2 steps with checkpoint.save_hf=true on tools.demo's
    preference pairs, at `overrides` (the layout, LoRA, the save interval): (run folder, the
    finished process), its exit 0 and its export line checked."""
    from tools.demo import preference_rows

    pairs = _write_jsonl(run.parent / f"{run.name}_pairs.jsonl", preference_rows(
        [(a, b) for a in range(4) for b in range(2)]))
    proc = pools.script(2, "-m", "engine.rm", f"model.hf_path={assets['model']}",
                        f"data.train_files=[{pairs}]", "model.dtype=float32",
                        "train.global_batch_size=4", "train.micro_batch_size=2",
                        "train.seq_length=48", "train.max_steps=2", "optim.lr=1e-2",
                        "logging.progress_bar=false", f"logging.dir={run}",
                        f"checkpoint.dir={run / 'ckpt'}", "checkpoint.save_hf=true",
                        *overrides, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[checkpoint] {EXPORT}/ written: " in proc.stdout
    return run, proc

def test_reward_model_tp2_save_hf_equals_convert(pools, assets, tmp_path):
    """engine.rm at TP2 with checkpoint.save_hf: iter_0000002/hf/ is convert's folder of that
    checkpoint, its scoring files (chat template, README, config.json) included."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run, proc = _train_rm(pools, assets, tmp_path / "rm", "parallel.tp=2",
                          "checkpoint.save_interval=2")
    assert "chat_template.jinja renders a chat ending in an assistant turn" in proc.stdout
    ckpt = iteration_dir(run / "ckpt", 2)
    saved, converted = ckpt / EXPORT, _convert(pools, ckpt, tmp_path / "converted")
    assert {"chat_template.jinja", "README.md", "config.json"} <= set(_files(saved))
    readme = (saved / "README.md").read_text()
    assert f'path = "{saved}"' in readme           # it names its own (published) folder
    assert readme != (converted / "README.md").read_text()   # control: convert's names --out
    (converted / "README.md").write_text((converted / "README.md").read_text()
                                         .replace(str(converted), str(saved)))
    _assert_same_folder(saved, converted)
    tensors = _tensors(saved)
    assert tensors["score.weight"].shape == (1, 64) and "lm_head.weight" not in tensors
    assert _differences(_tensors(Path(assets["model"])), tensors)   # trained, and a classifier
    config = json.loads((saved / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert config["num_labels"] == 1 and config["pad_token_id"] is not None
    tokenizer = AutoTokenizer.from_pretrained(str(saved))
    chat = [{"role": "user", "content": "what is 1 + 1 ?"},
            {"role": "assistant", "content": "the answer is 2"}]
    ids = tokenizer.apply_chat_template(chat, return_dict=True)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"   # the scored token
    model = AutoModelForSequenceClassification.from_pretrained(str(saved),
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        score = model(torch.tensor([ids])).logits
    assert score.shape == (1, 1) and torch.isfinite(score).all()


def test_lora_reward_model_pp2_save_hf_is_converts_seq_cls_adapter(pools, assets, tmp_path):
    """engine.rm with LoRA at PP2 on two ranks: iter_0000002/hf/ is convert's peft SEQ_CLS
    adapter of that checkpoint, the score head (on the last pipeline stage only) handed to
    rank 0 with the second stage's adapters."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    run, proc = _train_rm(pools, assets, tmp_path / "rm_lora", "parallel.pp=2",
                          "model.lora.rank=4", "model.lora.alpha=8",
                          "checkpoint.save_interval=1")
    ckpt, adapter = iteration_dir(run / "ckpt", 2), "adapter_model.safetensors"
    saved, converted = ckpt / EXPORT, _convert(pools, ckpt, tmp_path / "converted")
    assert _files(saved) == ["adapter_config.json", adapter]
    assert not list(saved.glob(".stage*"))   # the second stage's hand-over file is gone
    _assert_same_folder(saved, converted, adapter)
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    tensors = _tensors(saved, adapter)
    score = tensors["base_model.model.score.weight"]
    assert score.shape == (1, 64) and score.dtype == torch.float32
    assert any(".layers.3." in n and "lora_B" in n for n in tensors)   # the last stage's
    # control: one step older, the score head and the adapters differ
    older = _differences(_tensors(iteration_dir(run / "ckpt", 1) / EXPORT, adapter), tensors)
    assert "base_model.model.score.weight" in older and any("lora_B" in n for n in older)
    base = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1,
                                                              dtype=torch.float32)
    assert not torch.equal(base.score.weight.detach(), score)   # control: a fresh head
    model = PeftModel.from_pretrained(base, str(saved)).eval()
    loaded = [p for n, p in model.named_parameters() if n.endswith("score.modules_to_save."
                                                                   "default.weight")]
    assert len(loaded) == 1 and torch.equal(loaded[0].detach(), score)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 17, 42, 9]])).logits
    assert out.shape == (1, 1) and torch.isfinite(out).all()


def test_save_hf_refusals(assets):
    from transformers import AutoTokenizer

    from engine.config.loading import load_config
    from engine.checkpoint.hf_export import save_hf_problem
    from engine.rm.export import end_of_turn_id, hf_extras, save_hf_problems
    from models.bridge.reward_model import reward_model_hf_config
    from engine.config.rm_settings import RMConfig
    from engine.config.schema import SFTConfig, checkpoint_config_problems

    assert not load_config(SFTConfig, [])[0].checkpoint.save_hf   # off by default
    cfg = load_config(SFTConfig, ["checkpoint.save_hf=true"])[0]
    assert checkpoint_config_problems(cfg) == [
        "checkpoint.save_hf=true needs a checkpoint.dir (the HF folder is written into each "
        "saved checkpoint)"]
    assert checkpoint_config_problems(load_config(SFTConfig, [
        "checkpoint.save_hf=true", "checkpoint.dir=/tmp/x_save_hf_never_made"])[0]) == []
    # a reward model's run: allowed (engine.rm.export writes its scoring files; with LoRA
    # the peft SEQ_CLS adapter), except with a pad id that is the scored token
    rm = load_config(RMConfig, ["checkpoint.save_hf=true", "checkpoint.dir=/tmp/x",
                                f"model.hf_path={assets['model']}"])[0]
    assert checkpoint_config_problems(rm) == []
    hf_config = json.loads((Path(assets["model"]) / "config.json").read_text())
    assert save_hf_problems(rm, hf_config) == []
    assert save_hf_problems(load_config(RMConfig, [f"model.hf_path={assets['model']}"])[0],
                            {**hf_config, "pad_token_id": 3}) == []   # save_hf off: no check
    rm.model.lora.rank = 4
    assert save_hf_problems(rm, hf_config) == []
    rm.model.lora.rank = 0
    # the save's own guard: a reward model's full folder needs its run's scoring files
    classifier = reward_model_hf_config(hf_config)
    full = save_hf_problem(classifier, None, lora=False) or ""
    assert full.startswith("checkpoint.save_hf=true: a reward model's HF folder is written "
                           "with its scoring files")
    assert save_hf_problem(classifier, None, lora=True) is None   # convert writes none there
    assert save_hf_problem(classifier, hf_extras(), lora=False) is None
    assert save_hf_problem(hf_config, None, lora=False) is None   # control: a causal LM
    eot = end_of_turn_id(AutoTokenizer.from_pretrained(assets["model"]))
    (pad,) = save_hf_problems(rm, {**hf_config, "pad_token_id": eot})
    assert pad.startswith(f"checkpoint.save_hf=true: pad_token_id={eot} (config.json's "
                          "pad_token_id in ") and pad.endswith(", then train again")
