"""RL against a learned reward model (reward.model.*; engine.rl.policy.reward_model): the key
checks (refused by name before any process group), reward = reward.fn + weight x the model's
score in the collector (single-turn, multi-turn episodes scored on their whole trajectory), and
real `engine.rl` runs on the session's rank pool whose dumped rm_score equals transformers'
*ForSequenceClassification score of the same token ids (batch of 1, fp32) within 1e-5 relative:
one process (reward.fn + weight, the model offloaded to host memory), CP2 with packing
(multi-turn episodes, the model alone) and a disaggregated PP2 trainer (the training ranks score
the batch when it arrives). Negative control: the score of the second-to-last token (what an
off-by-one in the last position would give) differs by far more than the tolerance."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine.config.loading import load_config
from engine.config.schema import ConfigError, read_hf_config
from engine.rl.algo.advantages import ADVANTAGE_ESTIMATORS
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.checks import distill_problems, rl_problems, validate_rl
from engine.rl.collect.collector import RolloutCollector
from engine.rl.config import RLConfig
from engine.rl.policy.reward_model_checks import reward_model_problems
from engine.rl.rewards import load_reward_fn
from engine.generation import Generation
from engine.generation.pool import RolloutPool
from tests.metrics_docs import undocumented
from tests.generate_only import GenerateOnlyEngine
from tools.tiny_models import build_eos_model, build_tiny_model
from tests.rl_rewards import digit_reward

TOLERANCE = 1e-5   # relative, the engine's score vs transformers'


def build_reward_model(out_dir: str, layers: int = 2, vocab_size: int = 200, seed: int = 5,
                       bias: bool = False) -> str:
    """A tiny Qwen3ForSequenceClassification (num_labels 1, pad_token_id 0, seeded, norms away
    from 1 so a mis-mapped norm shows) with the tiny models' tokenizer; `bias` adds a
    score.bias (a critic's head, not a reward model's)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    build_tiny_model(out_dir, "qwen3", vocab_size=vocab_size, hidden=64, layers=layers, heads=8,
                     kv_heads=2, seed=seed, initializer_range=0.2)
    config = AutoConfig.from_pretrained(out_dir)
    config.num_labels, config.architectures = 1, ["Qwen3ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.remove(os.path.join(out_dir, "model.safetensors"))
    model.save_pretrained(out_dir, safe_serialization=True)
    if bias:
        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        save_file({**tensors, "score.bias": torch.zeros(1)}, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """policy: tiny Qwen3 (4 layers); rm: a 2-layer Qwen3 reward model with its vocabulary;
    eos: a Llama policy whose turns end (multi-turn), scored by the same Qwen3 reward model."""
    root = tmp_path_factory.mktemp("rm")
    out = {"root": root,
           "policy": build_tiny_model(str(root / "policy"), "qwen3", hidden=64, layers=4,
                                      heads=8, kv_heads=2, seed=0, initializer_range=0.2),
           "rm": build_reward_model(str(root / "rm")),
           "eos": build_eos_model(str(root / "eos"))}
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    out["prompts"] = str(prompts)
    return out


def _cfg(argv: list[str]) -> RLConfig:
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


# ------------------------------------------------------------------------------- key checks

def test_reward_model_keys_are_refused_by_name(models):
    """Each problem names its key: not a classifier (the policy's folder, a critic's head with a
    bias), another vocabulary (vocab_size; a tokenizer with two tokens swapped), a layout the
    model does not fit, a non-finite weight, offload without a model, dynamic sampling on
    disaggregated placement; validate_rl raises them before any process group exists."""
    root, policy = models["root"], models["policy"]
    base = [f"model.hf_path={policy}", f"data.train_files=[{models['prompts']}]"]
    hf = read_hf_config(policy, "model.hf_path")
    assert reward_model_problems(_cfg(base + [f"reward.model.path={models['rm']}"]), 2, hf) == []
    biased = build_reward_model(str(root / "biased"), bias=True)
    wide = build_reward_model(str(root / "wide"), vocab_size=256)
    swapped = str(root / "swapped")
    shutil.copytree(models["rm"], swapped)
    spec = json.load(open(os.path.join(swapped, "tokenizer.json")))
    words = [w for w in spec["model"]["vocab"] if w.isalpha()][:2]
    vocab = spec["model"]["vocab"]
    vocab[words[0]], vocab[words[1]] = vocab[words[1]], vocab[words[0]]
    json.dump(spec, open(os.path.join(swapped, "tokenizer.json"), "w"))
    cases = {policy: "no score.weight: not a *ForSequenceClassification checkpoint",
             biased: "it has score.bias",
             wide: "its vocab_size 256 is not model.hf_path's 200",
             swapped: "its tokenizer is not model.hf_path's (200 vs 200 tokens, 2 differ)"}
    for path, message in cases.items():
        problems = reward_model_problems(_cfg(base + [f"reward.model.path={path}"]), 2, hf)
        assert all(p.startswith(f"reward.model.path={path}: ") for p in problems), problems
        assert any(message in p for p in problems), problems
        with pytest.raises(ConfigError, match=re.escape(f"reward.model.path={path}: ")):
            validate_rl(_cfg(base + [f"reward.model.path={path}"]), 1)
    # the policy's 4 layers split over pp=4, the reward model's 2 do not
    [layout] = reward_model_problems(_cfg(base + [f"reward.model.path={models['rm']}",
                                                  "parallel.pp=4"]), 4, hf)
    assert layout.startswith(f"reward.model.path={models['rm']}: ") and "layers" in layout
    keys = {"reward.model.weight=nan": "reward.model.weight=nan must be a finite number",
            "reward.model.offload=true": "reward.model.offload=true needs a reward model"}
    for override, message in keys.items():
        assert any(message in p for p in rl_problems(_cfg(base + [override]))), override
    disaggregated = _cfg(base + [f"reward.model.path={models['rm']}", "algorithm=dapo",
                                 "rollout.placement=disaggregated", "rollout.num_ranks=1"])
    assert any(p.startswith("dapo.dynamic_sampling=true with reward.model.path is colocated "
                            "only") for p in rl_problems(disaggregated))
    colocated = _cfg(base + [f"reward.model.path={models['rm']}", "algorithm=dapo"])
    assert not any("reward.model" in p for p in rl_problems(colocated))


def test_reward_fn_defaults_to_none_with_a_reward_model_and_counts_as_a_reward(models):
    """reward.model.path alone: reward.fn is none (the model is the only reward source); an
    explicit reward.fn (command line or YAML) is kept. Dynamic sampling with reward.fn=none is
    refused for pure distillation only when no reward model scores."""
    rm = f"reward.model.path={models['rm']}"
    assert _cfg([]).reward.fn == "math" and _cfg([rm]).reward.fn == "none"
    assert _cfg([rm, "reward.fn=math"]).reward.fn == "math"
    teacher = [f"model.hf_path={models['policy']}", f"distill.teacher_path={models['policy']}",
               "dapo.dynamic_sampling=true"]
    assert any("dapo.dynamic_sampling=true with reward.fn=none" in p
               for p in distill_problems(_cfg(teacher + ["reward.fn=none"]), 1))
    assert distill_problems(_cfg(teacher + [rm]), 1) == []


# ---------------------------------------------------------------------------- the collector

class FixedEngine(GenerateOnlyEngine):
    """Sample j of every prompt answers "<j + 1>" + eos (a multi-turn trajectory's later turns
    too), rollout log-probs -0.5."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok = tokenizer

    def _generate(self, prompts, params):
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.tok.encode(str(i % 2 + 1), add_special_tokens=False)
            ids = (ids + [self.tok.eos_token_id])[:params.max_new_tokens]
            out.append(Generation(prompt, ids, [-0.5] * len(ids), "stop"))
        return out


def _collector(models, argv, scored: list):
    """A colocated collector over one FixedEngine whose pool scores each token-id list with
    sum(ids) / 100 (recording what it was given in `scored`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["policy"])
    cfg = _cfg(["rollout.n=2", "train.prompts_per_step=2", "rollout.max_new_tokens=6",
                "data.shuffle=false", "train.seq_length=96", f"reward.model.path={models['rm']}",
                "kl.beta=0"] + argv)
    pool = RolloutPool.local(FixedEngine(tok), cfg.rollout)

    def scorer(ids):
        scored.extend(list(x) for x in ids)
        return [sum(x) / 100 for x in ids]

    pool.scorer = scorer
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)}
            for a, b in [(1, 1), (1, 2)]]
    return RolloutCollector(pool, rows, tok, load_reward_fn(cfg.reward.fn), cfg), tok


def test_collector_adds_the_weighted_model_score_before_the_advantages(models, tmp_path):
    """reward.fn=math + 0.5 x the model's score: the scores, rewards (with the overlong
    penalty), group advantages, reward/* metrics and the dump's reward and rm_score; the
    model saw each prompt + response exactly as generated."""
    scored: list = []
    collector, tok = _collector(models, ["reward.fn=math", "reward.model.weight=0.5",
                                         "dapo.overlong_buffer=2",
                                         f"logging.rollout_dir={tmp_path}"], scored)
    batch = collector.collect(dump_step=1)
    assert scored == [list(p) + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    rm = [sum(x) / 100 for x in scored]
    fn = [0.0, 1.0, 0.0, 0.0]   # 1 + 1: "1" wrong, "2" right; 1 + 2: both wrong
    lengths = [len(r) for r in batch.response_ids]      # 2 tokens of 6: no penalty
    assert batch.scores == pytest.approx([f + 0.5 * s for f, s in zip(fn, rm)])
    assert batch.rewards == pytest.approx(batch.scores) and max(lengths) <= 4
    m = batch.metrics
    assert m["reward/model_mean"] == pytest.approx(sum(rm) / 4)
    assert m["reward/mean"] == pytest.approx(sum(batch.scores) / 4)
    grpo = ADVANTAGE_ESTIMATORS["grpo"]
    adv = grpo(torch.tensor(batch.rewards), 2, collector.cfg.advantage, torch.tensor(lengths))
    assert batch.advantages == pytest.approx(adv.tolist())
    without = grpo(torch.tensor(fn), 2, collector.cfg.advantage, torch.tensor(lengths))
    assert max(abs(a - b) for a, b in zip(batch.advantages, without.tolist())) > 0.1
    records = [json.loads(x) for x in open(tmp_path / "step_1.jsonl")]
    assert [r["rm_score"] for r in records] == pytest.approx(rm)
    assert [r["reward"] for r in records] == pytest.approx(batch.scores)
    assert [r["token_ids"] for r in records] == scored


def test_multi_turn_episodes_are_scored_on_their_whole_trajectory(models):
    """env.fn: the model scores prompt + every turn + every observation as the trajectory holds
    them, once per episode after its last turn; the episode's reward is the env's plus the
    model's (weight 1, reward.fn not called)."""
    scored: list = []
    collector, tok = _collector(models, ["env.fn=tests.test_rl_env:CountEnv", "env.max_turns=3",
                                         "env.kwargs.turns=2"], scored)
    batch = collector.collect()
    assert len(scored) == 4   # one call's worth: after the episodes ended
    assert scored == [list(p) + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    for masks in batch.response_masks:  # sampled turns with an observation between them
        assert masks[0] == 1 and 0 in masks and masks[-1] == 1
    # CountEnv: 0.25 per step, two steps
    assert batch.scores == pytest.approx([0.5 + sum(x) / 100 for x in scored])


# ------------------------------------------------------------------------------ real runs

def _run(pools, nproc: int, out, *extra, policy: str, **kw):
    proc = pools.script(
        nproc, "-m", "engine.rl", f"model.hf_path={policy}", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.max_steps=2",
        "train.seq_length=64", "optim.lr=1e-2", "kl.beta=0", "data.num_workers=0",
        f"data.cache_dir={out}/cache", f"logging.dir={out}/run",
        f"logging.rollout_dir={out}/dump", "logging.progress_bar=false", *extra,
        timeout=400, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in open(f"{out}/run/metrics.jsonl")]
    assert undocumented({k for m in steps for k in m}) == []   # docs/metrics.md names them
    dumps = [[json.loads(x) for x in open(f"{out}/dump/step_{k}.jsonl")] for k in (1, 2)]
    return steps, dumps


def _check_scores(rm_dir: str, steps: list[dict], dumps: list[list[dict]]) -> tuple[float, float]:
    """Every record's rm_score vs transformers' score of its token_ids (batch of 1, fp32;
    the score at the last position), and the step's reward/model_mean. Returns (largest relative
    difference, the same for the negative control: the second-to-last token's score)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    worst = control = 0.0
    for m, records in zip(steps, dumps):
        assert m["reward/model_mean"] == pytest.approx(
            sum(r["rm_score"] for r in records) / len(records), rel=1e-6)
        for r in records:
            with torch.no_grad():
                values = model.score(model.model(torch.tensor([r["token_ids"]]))
                                     .last_hidden_state)[0, :, 0]
                if 0 not in r["token_ids"]:   # transformers' own pooling: the last non-pad
                    pooled = model(torch.tensor([r["token_ids"]])).logits[0, 0]
                    assert float(pooled) == float(values[-1])
            ref, prev = float(values[-1]), float(values[-2])
            worst = max(worst, abs(r["rm_score"] - ref) / abs(ref))
            control = max(control, abs(r["rm_score"] - prev) / abs(ref))
    print(f"rm_score vs transformers: max relative difference {worst:.3g}; negative control "
          f"(second-to-last token) {control:.3g}")
    assert worst <= TOLERANCE and control > 100 * TOLERANCE, (worst, control)
    return worst, control


def test_one_process_scores_equal_transformers_with_reward_fn_and_offload(pools, models,
                                                                          tmp_path):
    """One process, reward.fn + 0.5 x the model (offloaded to host memory between its
    passes): each dumped rm_score is transformers' score of the record's token ids, each reward
    is digit_reward of the response plus 0.5 x rm_score."""
    steps, dumps = _run(pools, 1, tmp_path, f"data.train_files=[{models['prompts']}]",
                        f"reward.model.path={models['rm']}", "reward.model.weight=0.5",
                        "reward.model.offload=true",
                        "reward.fn=tests.rl_rewards:digit_reward",
                        policy=models["policy"])
    _check_scores(models["rm"], steps, dumps)
    _check_rewards(models["policy"], steps, dumps, 0.5)
    assert all(m["grad_norm"] > 0 for m in steps)


def _check_rewards(policy: str, steps: list[dict], dumps: list[list[dict]], weight: float):
    """Each record's reward is digit_reward of its response plus weight x its rm_score; the
    step's reward/mean is their mean."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    for m, records in zip(steps, dumps):
        for r in records:
            response = r["token_ids"][r["loss_mask"].index(1):]
            fn = digit_reward("", tok.decode(response, skip_special_tokens=True), "")
            assert r["reward"] == pytest.approx(fn + weight * r["rm_score"], rel=1e-6, abs=1e-6)
        assert m["reward/mean"] == pytest.approx(sum(r["reward"] for r in records) / 4,
                                                 rel=1e-6)


def test_cp2_multi_turn_episodes_score_equal_transformers(pools, models, tmp_path):
    """CP2 with packing (each trajectory's last token on one CP rank), multi-turn episodes of a
    Llama policy scored by the Qwen3 reward model alone (reward.fn defaults to none): each
    episode's rm_score is transformers' score of its whole trajectory; its reward is the env's
    plus the model's."""
    steps, dumps = _run(pools, 2, tmp_path, f"data.train_files=[{models['prompts']}]",
                        f"reward.model.path={models['rm']}", "parallel.cp=2",
                        "train.packing=true", "train.max_tokens_per_micro_batch=128",
                        "env.fn=tests.test_rl_env:CountEnv", "env.max_turns=2",
                        "train.seq_length=96", policy=models["eos"])
    _check_scores(models["rm"], steps, dumps)
    assert max(r["turns"] for d in dumps for r in d) == 2
    for records in dumps:
        for r in records:
            assert r["reward"] == pytest.approx(0.25 * r["turns"] * (r["error"] is None)
                                                + r["rm_score"], rel=1e-6, abs=1e-6)


def test_disaggregated_pp2_trainer_scores_the_batch_it_receives(pools, models, tmp_path):
    """rollout.placement=disaggregated (2 training ranks at PP2, 1 rollout rank): the training
    ranks score each batch when it arrives; the dump's rm_score (written by training rank 0)
    is transformers' score and reward/mean includes 0.5 x the model's score."""
    steps, dumps = _run(pools, 3, tmp_path, f"data.train_files=[{models['prompts']}]",
                        f"reward.model.path={models['rm']}", "reward.model.weight=0.5",
                        "reward.fn=tests.rl_rewards:digit_reward", "parallel.pp=2",
                        "rollout.placement=disaggregated", "rollout.num_ranks=1",
                        "rollout.peer_timeout_s=120", policy=models["policy"], own_world=True)
    _check_scores(models["rm"], steps, dumps)
    _check_rewards(models["policy"], steps, dumps, 0.5)


# -------------------------------------------------------------------------------- --validate

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "rl" / "qwen3_8b_grpo_h100.yaml"


def test_validate_counts_the_reward_model(tmp_path, capsys):
    """--validate of the Qwen3-8B GRPO recipe with a Qwen3-8B-shaped reward model (its
    config.json only): its own line, its frozen weights at tp 2 in bf16 added to both phases
    (resident), or with reward.model.offload to the rollout phase only (where it scores); on a
    disaggregated run to the training GPUs. Not on this machine: reported as not counted.
    Another vocabulary: refused by key name."""
    from engine.rl.recipe_check import disaggregated_memory, rl_memory, rl_validate_main
    from models.estimate.counting import stage_parameters
    from models.estimate.training_memory import GIB
    from models.families.presets import MODEL_SHAPES

    hf = MODEL_SHAPES["qwen3-8b"]
    config = {**hf, "architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1}
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    stage = stage_parameters(config, 2, 1)
    gib = max(stage.first_stage, stage.last_stage) * 2 / GIB

    def cfg(*extra):
        argv = ["--config", str(GRPO), *extra]
        loaded, _ = load_config(RLConfig, argv)
        return apply_algorithm_defaults(loaded, explicit_keys(argv))

    rm = f"reward.model.path={tmp_path / 'rm'}"
    t0, r0, _ = rl_memory(cfg(), hf, 32, None, 2)
    t1, r1, lines = rl_memory(cfg(rm), hf, 32, None, 2, rm=config)
    assert (t1 - t0, r1 - r0) == pytest.approx((gib, gib), rel=1e-9)
    assert any(line.startswith(f"reward model per GPU (estimate, GiB): weights {gib:.1f} "
                               "(qwen3, 8.19 B parameters, frozen, bfloat16, at tp=2 pp=1)")
               for line in lines), lines
    t2, r2, _ = rl_memory(cfg(rm, "reward.model.offload=true"), hf, 32, None, 2, rm=config)
    assert (t2 - t0, r2 - r0) == pytest.approx((0.0, gib), abs=1e-9)
    dis = ("rollout.placement=disaggregated", "rollout.num_ranks=16")
    d0 = disaggregated_memory(cfg(*dis), hf, 16)[0]
    assert disaggregated_memory(cfg(*dis, rm), hf, 16, config)[0] - d0 == pytest.approx(gib)

    assert rl_validate_main(["--config", str(GRPO), "--validate", "--nodes", "4", rm]) == 0
    out = capsys.readouterr().out
    assert f"+ reward model {gib:.1f}" in out and "recipe OK on 4 node(s)" in out
    assert rl_validate_main(["--config", str(GRPO), "--validate", "--nodes", "4",
                             "reward.model.path=/models/rm"]) == 0
    assert ("reward model: NOT counted in the memory estimate (reward.model.path=/models/rm is "
            "not on this machine") in capsys.readouterr().out
    (tmp_path / "rm" / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    assert rl_validate_main(["--config", str(GRPO), "--validate", "--nodes", "4", rm]) == 2
    assert (f"reward.model.path={tmp_path / 'rm'}: its vocab_size 1000 is not model.hf_path's "
            f"{hf['vocab_size']}") in capsys.readouterr().err
