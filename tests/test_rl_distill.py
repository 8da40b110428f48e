"""On-policy distillation (distill.teacher_path, distill.coef; engine.rl.algo.distill): the
advantage formula on sampled tokens only, the key checks, and real runs of `engine.rl` at one
process and at every layout that agree, log distill/reverse_kl, and dump the teacher's log-probs, which
equal transformers' log-probs of the teacher on the same tokens."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from engine.config.loading import load_config
from engine.rl.algo.distill import apply_distillation
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import distill_problems
from engine.rl.config import RLConfig
from engine.training.micro_batches import SequenceData
from tools.tiny_models import build_tiny_model


def _seq(mask, adv, old, teacher) -> SequenceData:
    n = len(mask)
    return SequenceData(tokens=[1] * n, labels=[2] * n, loss_mask=list(mask),
                        extras={"advantages": list(adv), "old_logprobs": list(old),
                                "teacher_logprobs": list(teacher)})


def test_advantage_shift_and_reverse_kl_on_sampled_tokens_only():
    """A'_t = A_t - coef (old - teacher) where sampled; elsewhere untouched; the metric is the
    token mean of old - teacher over sampled tokens of the whole batch (not a mean of means)."""
    a = _seq([0, 1, 1, 0], [0.0, 1.0, 1.0, 0.0], [0, -1.0, -2.0, -5.0], [0, -1.5, -1.0, -1.0])
    b = _seq([0, 1], [0.0, -0.5], [0, -0.2], [0, -0.7])
    # rollout correction rejected a's third token (loss mask 0) but it was sampled: it counts
    a.loss_mask[2] = 0
    out = apply_distillation([a, b], [[0, 1, 1, 0], [0, 1]], coef=0.5)
    assert a.extras["advantages"] == pytest.approx([0.0, 1.0 - 0.25, 1.0 + 0.5, 0.0])
    assert b.extras["advantages"] == pytest.approx([0.0, -0.5 - 0.25])
    # gaps: 0.5, -1.0, 0.5 -> mean 0 over 3 tokens; the mean of per-sequence means is 0.125
    assert out["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-12)
    control = (((0.5 - 1.0) / 2) + 0.5) / 2
    assert abs(control - out["distill/reverse_kl"]) > 0.1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Student: tiny Qwen3 (4 layers). Teacher: another tiny Qwen3 with the same tokenizer
    (2 layers, other weights). Stranger: the teacher with two tokens swapped in its tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    student = build_tiny_model(str(root / "student"), "qwen3", hidden=64, layers=4, heads=8,
                               kv_heads=2, seed=0, initializer_range=0.2)
    teacher = build_tiny_model(str(root / "teacher"), "qwen3", hidden=64, layers=2, heads=8,
                               kv_heads=2, seed=7, initializer_range=0.2)
    stranger = str(root / "stranger")
    shutil.copytree(teacher, stranger)
    tok_file = os.path.join(stranger, "tokenizer.json")
    spec = json.load(open(tok_file))
    vocab = spec["model"]["vocab"]
    words = [w for w in vocab if w.isalpha()][:2]
    vocab[words[0]], vocab[words[1]] = vocab[words[1]], vocab[words[0]]
    json.dump(spec, open(tok_file, "w"))
    return {"student": student, "teacher": teacher, "stranger": stranger, "root": root}


def _cfg(argv):
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def test_distill_keys_are_checked_by_name(models):
    base = [f"model.hf_path={models['student']}"]
    assert distill_problems(_cfg(base + [f"distill.teacher_path={models['teacher']}"]), 2) == []
    [coef] = distill_problems(_cfg(base + [f"distill.teacher_path={models['teacher']}",
                                           "distill.coef=-1"]), 2)
    assert coef == "distill.coef=-1.0 must be a number > 0"
    [vocab] = distill_problems(_cfg(base + [f"distill.teacher_path={models['stranger']}"]), 2)
    assert "distill.teacher_path=" in vocab and "tokenizer is not model.hf_path's" in vocab
    assert "2 differ" in vocab
    problems = distill_problems(_cfg(base + [f"distill.teacher_path={models['root']}/none",
                                             "reward.fn=none", "dapo.dynamic_sampling=true"]), 2)
    assert any("dapo.dynamic_sampling=true with reward.fn=none" in p for p in problems)
    assert any(p.startswith("distill.teacher_path=") for p in problems)
    [layout] = distill_problems(_cfg(base + [f"distill.teacher_path={models['teacher']}",
                                             "parallel.pp=4"]), 4)
    assert layout.startswith("distill.teacher_path=") and "layers" in layout
    [placed] = distill_problems(_cfg(base + [f"distill.teacher_path={models['teacher']}",
                                             "rollout.placement=disaggregated"]), 2)
    assert "colocated only" in placed
    [alone] = distill_problems(_cfg(base + ["distill.offload=true"]), 2)
    assert alone == "distill.offload=true needs a teacher (distill.teacher_path is null)"


def test_host_offload_frees_the_weights_and_restores_them_bitwise():
    """engine.training.host_offload: offloaded, every parameter holds an empty tensor on its
    device and the host copy holds every byte; reloaded, the same Parameter objects hold the
    same values; a trainable model is refused."""
    from engine.training.host_offload import HostOffload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).requires_grad_(
        False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    x = torch.randn(3, 8)
    expected = model(x)
    offload = HostOffload([model])
    offload.offload()
    assert offload.offloaded and all(p.numel() == 0 for p in model.parameters())
    assert offload.host_bytes() == sum(t.numel() * 4 for t in before.values())
    offload.reload()
    assert not offload.offloaded and offload.host_bytes() == 0
    assert list(model.parameters()) == params
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(model(x), expected)
    with pytest.raises(ValueError, match="frozen models only"):
        HostOffload([torch.nn.Linear(2, 2)])


def _run(pools, nproc, models, prompts, out, *extra):
    """One `engine.rl` run on the session's `nproc`-rank pool (as torchrun would run it)."""
    proc = pools.script(
        nproc, "-m", "engine.rl", f"model.hf_path={models['student']}",
        f"data.train_files=[{prompts}]", f"distill.teacher_path={models['teacher']}",
        "distill.coef=0.5", "reward.fn=none", "kl.beta=0", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.mini_batches_per_step=1",
        "train.micro_batch_size=1", "train.max_steps=2", "train.seq_length=48", "optim.lr=1e-2",
        f"data.cache_dir={out}/cache", "data.num_workers=0", f"logging.dir={out}/run",
        f"logging.rollout_dir={out}/dump", "logging.progress_bar=false", *extra, timeout=400)
    assert proc.returncode == 0
    with open(f"{out}/run/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_distillation_is_layout_invariant_and_dumps_the_teachers_logprobs(pools, models,
                                                                         tmp_path):
    """TP2 + SP, PP2, DP2 and CP2 with packing and token-budget micro-batches give the
    one-process numbers at both steps (the mean-of-means negative control of the metric is in
    the first test); the dumped teacher log-probs are transformers' teacher's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    one = _run(pools, 1, models, prompts, tmp_path / "one")
    # the teacher in host memory between steps: the same numbers, bit for bit
    offloaded = _run(pools, 1, models, prompts, tmp_path / "offload", "distill.offload=true")
    assert [{k: m[k] for k in ("distill/reverse_kl", "policy/loss", "grad_norm")}
            for m in offloaded] == [{k: m[k] for k in ("distill/reverse_kl", "policy/loss",
                                                       "grad_norm")} for m in one]
    layouts = {"tp2_sp": ("parallel.tp=2", "parallel.sequence_parallel=true"),
               "pp2": ("parallel.pp=2",), "dp2": (),
               "cp2_packed": ("parallel.cp=2", "train.packing=true",
                              "train.max_tokens_per_micro_batch=64")}
    for name, extra in layouts.items():
        other = _run(pools, 2, models, prompts, tmp_path / name, *extra)
        for a, b in zip(one, other):
            for key in ("distill/reverse_kl", "policy/loss", "grad_norm"):
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (name, key, a, b)
    assert one[0]["distill/reverse_kl"] > 0.05 and one[0]["reward/mean"] == 0.0
    assert one[0]["policy/loss"] != 0.0  # the teacher alone drives the update
    # the dump's teacher log-probs are transformers' teacher at the rollout temperature
    from transformers import AutoModelForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"], torch_dtype=torch.float32)
    records = [json.loads(line) for line in open(tmp_path / "one" / "dump" / "step_1.jsonl")]
    assert len(records) == 4
    for r in records:
        ids, mask, got = r["token_ids"], r["loss_mask"], r["teacher_logprobs"]
        assert len(got) == len(ids) and all(g == 0.0 for g, m in zip(got, mask) if not m)
        with torch.no_grad():
            logits = teacher(torch.tensor([ids])).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        for j in range(1, len(ids)):
            if mask[j]:
                assert abs(got[j] - float(ref[j - 1])) < 1e-4, (j, got[j], float(ref[j - 1]))
