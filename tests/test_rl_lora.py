"""RL with LoRA adapters (docs/lora.md#rl): GRPO end to end on the HF rollout backend with the
merged-weight sync, layout invariance, the KL reference inside the policy (no second model:
its frozen base with fresh adapters, the starting adapter, frozen, from model.lora.init_from,
also after a resume), every algorithm and policy loss running, only the adapters trained.

Pool cases on the tiny Qwen3 (4 layers, hidden 64): the `engine.rl` command line at one process,
TP2 + SP and PP2 (GRPO with a KL term), one step each of DAPO, PPO (critic) and on-policy
distillation, and tests/multirank/lora_rl_check.py at TP2 + SP (every policy loss, the frozen
base, the reference against a separately built base model).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.config.loading import load_config
from engine.rl.algo.presets import apply_algorithm_defaults, explicit_keys
from engine.rl.config import RLConfig
from tools.tiny_models import build_peft_adapter, build_tiny_model

HARNESS = "tests/multirank/lora_rl_check.py"
LORA = ("model.lora.rank=4", "model.lora.alpha=8")
# rollout/logprob_diff is rounding (1e-6) between two programs, not compared across layouts
KEYS = ("policy/loss", "policy/kl", "policy/entropy", "grad_norm", "reward/mean",
        "response/length_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("rl_lora") / "qwen3"), "qwen3",
                            hidden=64, layers=4, heads=8, kv_heads=2, seed=0,
                            initializer_range=0.2)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rl_lora_data") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                            + "\n" for i in range(8)))
    return path


def _run(pools, nproc, model_dir, prompts, out, *extra, steps=2) -> list[dict]:
    """One `engine.rl` LoRA run on the `nproc`-rank pool; its metrics.jsonl rows."""
    proc = pools.script(
        nproc, "-m", "engine.rl", f"model.hf_path={model_dir}", f"data.train_files=[{prompts}]",
        *LORA, "reward.fn=tests.test_rl_loop:digit_reward", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=1",
        f"train.max_steps={steps}", "train.seq_length=48", "optim.lr=1e-2",
        f"data.cache_dir={out}/cache", "data.num_workers=0", f"logging.dir={out}/run",
        f"logging.rollout_dir={out}/dump", "logging.progress_bar=false", *extra, timeout=400)
    assert proc.returncode == 0
    with open(f"{out}/run/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _cfg(argv) -> RLConfig:
    cfg, _ = load_config(RLConfig, argv)
    return apply_algorithm_defaults(cfg, explicit_keys(argv))


def test_kl_reference_under_lora_builds_no_model():
    """build_auxiliary with LoRA and kl.beta > 0: no frozen reference engine (it would need
    process groups and weights), the policy's base instead; without LoRA the flag is off."""
    from engine.rl.policy.train_step import build_auxiliary

    aux = build_auxiliary(_cfg([*LORA, "kl.beta=0.05"]), {}, torch.float32, None, 0, 1)
    assert aux.reference is None and aux.reference_is_base
    assert aux.teacher is None and aux.critic is None
    off = build_auxiliary(_cfg([*LORA, "kl.beta=0"]), {}, torch.float32, None, 0, 1)
    assert off.reference is None and not off.reference_is_base


def _transformers_logprobs(model_dir: str, records: list[dict], temperature: float) -> list:
    """The HF base model's log-prob of every sampled token of `records` (dump rows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for r in records:
        ids = r["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        out += [(float(logp[j - 1]), r["rollout_logprobs"][j])
                for j in range(1, len(ids)) if r["loss_mask"][j]]
    return out


def test_grpo_with_lora_syncs_merged_weights_and_is_layout_invariant(pools, model_dir, prompts,
                                                                    tmp_path):
    """GRPO + k3 KL to the frozen base, 2 mini-batches per step: at step 2 (after a weight
    sync of the merged adapters) the HF engine's log-probs equal the trainer's
    (rollout/logprob_diff < 1e-3, logits after the sync within 1e-4); TP2 + SP and PP2 give the
    one-process metrics (rel 1e-5). Negative control: the base model's log-probs of the step-2
    tokens (what an unmerged sync would serve) are far from the rollout's."""
    extra = ("kl.beta=0.05", "train.mini_batches_per_step=2", "rollout.check_weight_sync=true")
    one = _run(pools, 1, model_dir, prompts, tmp_path / "one", *extra)
    assert len(one) == 2
    for m in one:
        assert m["rollout/logprob_diff"] < 1e-3 and m["debug/sync_logit_max_diff"] < 1e-4
        assert m["debug/sync_logit_change"] > 1e-2 and m["grad_norm"] > 0
    assert one[1]["policy/kl"] > 1e-4   # the adapters moved away from the frozen base
    records = [json.loads(line) for line in open(tmp_path / "one" / "dump" / "step_2.jsonl")]
    pairs = _transformers_logprobs(model_dir, records, 1.0)
    base_gap = sum(abs(a - b) for a, b in pairs) / len(pairs)
    assert base_gap > 30 * one[1]["rollout/logprob_diff"] and base_gap > 1e-2, base_gap
    for name, layout in (("tp2_sp", ("parallel.tp=2", "parallel.sequence_parallel=true")),
                         ("pp2", ("parallel.pp=2",))):
        other = _run(pools, 2, model_dir, prompts, tmp_path / name, *extra, *layout)
        for a, b in zip(one, other):
            for key in KEYS:  # policy/loss: O(1) terms with whitened advantages that nearly
                # cancel (as in tests/test_rl_ppo.py): its rounding is judged against 1
                absolute = 2e-6 if key == "policy/loss" else 1e-7
                # TP2 + SP: adapter entries with gradients near Adam's eps turn the rounding of
                # the differently ordered TP sums into parameter differences after the first
                # mini-batch (tests/test_dpo.py measured 3.04e-5 in the adapters); step 2's
                # policy/kl carried 1.09e-5 of it on AVX2 hosts without AMX. Step 1 stays at 1e-5
                rel = 1e-4 if name == "tp2_sp" and a is not one[0] else 1e-5
                assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=absolute), \
                    (name, key, a[key], b[key])


def test_first_rollout_comes_from_the_adapter_and_from_the_resumed_checkpoint(
        pools, model_dir, prompts, tmp_path):
    """The engines load model.hf_path; the policy starts elsewhere. From a PEFT adapter with
    non-zero B (model.lora.init_from): step 1 is sampled from the merged adapter
    (rollout/logprob_diff < 1e-5 at step 1). Negative control: the base model's log-probs of
    those tokens, what an engine left with model.hf_path would serve, are far from the rollout's.
    The run stops after step 1 with a checkpoint and resumes: the resumed step is exact too.
    At DP2: a LoRA checkpoint written by two data-parallel ranks (their adapters are replicas;
    megatron numbered them both replica 0 until the adapters passed their DP x CP group, and
    the save failed with "Invalid access pattern").
    The KL reference (kl.beta 0.001, GRPO's default) is the starting adapter, frozen: at step 1
    the policy is the reference (policy/kl measured 0.0; the bare base, the reference before
    issue 67, gives 0.111 here), and after the resume it is still the starting adapter, not
    the checkpoint's (which would give 0 at step 2; measured 0.188)."""
    adapter = build_peft_adapter(model_dir, str(tmp_path / "adapter"), rank=4, alpha=8)
    ck = tmp_path / "ck"
    extra = (f"model.lora.init_from={adapter}", f"checkpoint.dir={ck}",
             "checkpoint.save_interval=1")
    (first,) = _run(pools, 2, model_dir, prompts, tmp_path / "run", *extra,
                    "train.exit_interval=1")
    assert first["rollout/logprob_diff"] < 1e-5, first
    assert first["policy/kl"] < 1e-9, first
    records = [json.loads(line) for line in open(tmp_path / "run" / "dump" / "step_1.jsonl")]
    pairs = _transformers_logprobs(model_dir, records, 1.0)
    base_gap = max(abs(a - b) for a, b in pairs)
    assert base_gap > 1e-2, base_gap
    both = _run(pools, 2, model_dir, prompts, tmp_path / "run", *extra)
    assert len(both) == 2 and both[1]["rollout/logprob_diff"] < 1e-5, both
    assert both[1]["policy/kl"] > 1e-5, both


def test_every_algorithm_runs_one_step_with_lora(pools, model_dir, prompts, tmp_path):
    """DAPO (dynamic sampling, overlong shaping), PPO (a full critic beside the LoRA policy)
    and on-policy distillation (a frozen teacher) each train one step with the adapters."""
    teacher = build_tiny_model(str(tmp_path / "teacher"), "qwen3", hidden=64, layers=2, heads=8,
                               kv_heads=2, seed=7, initializer_range=0.2)
    runs = {"dapo": ("algorithm=dapo", "dapo.max_gen_batches=2", "optim.lr=1e-2"),
            "ppo": ("algorithm=ppo", "kl.beta=0.05", "critic.lr=2e-3"),
            "distill": (f"distill.teacher_path={teacher}", "distill.coef=0.5", "reward.fn=none",
                        "kl.beta=0")}
    for name, extra in runs.items():
        (m,) = _run(pools, 1, model_dir, prompts, tmp_path / name, *extra, steps=1)
        assert m.get("train/optimizer_steps", 0) >= 1, (name, m)   # DAPO: a full batch came
        assert m["rollout/logprob_diff"] < 1e-3, (name, m)
        assert m["grad_norm"] > 0 and math.isfinite(m["policy/loss"]), (name, m)
        if name == "ppo":
            assert m["critic/grad_norm"] > 0 and m["critic/value_loss"] > 0
        if name == "distill":
            assert m["distill/reverse_kl"] > 0.05


def test_every_policy_loss_trains_only_the_adapters_and_the_reference_is_the_base(pools,
                                                                                  model_dir):
    """tests/multirank/lora_rl_check.py at TP2 + SP: one update per policy loss, estimator and
    rollout-correction mode (ppo_clip + KL, gspo, geo_mean, cispo, sapo, two bypass modes);
    afterwards every base parameter is bitwise its loaded value and every adapter moved; DDP
    holds exactly the adapters, as many as models.estimate.lora counts for a TP2 rank; the
    reference log-probs (adapters switched off) equal a separately built base model's."""
    proc = pools.script(2, HARNESS, model_dir, timeout=400)
    assert proc.returncode == 0
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[7:])
    assert [u["name"] for u in r["updates"]] == ["grpo_kl", "gspo", "geo_mean", "cispo",
                                                 "sapo", "bypass_reinforce", "bypass_ppo_clip"]
    for u in r["updates"]:
        assert math.isfinite(u["loss"]) and u["grad_norm"] > 0 and u["skipped"] == 0, u
    assert r["updates"][0]["kl"] == 0.0   # fresh adapters (B = 0): the policy IS the base
    assert r["updates"][1]["kl"] > 0
    assert r["base_changed"] == 0 and r["adapters_unmoved"] == 0 and r["wrong_trainable"] == 0
    assert r["adapter_numel"] == r["ddp_numel"] == r["counted_numel"] == 12800
    assert r["ref_rel"] < 1e-6, r          # measured: 0.0 (bitwise)
    assert r["control_rel"] > 1e-2, r      # adapters on: another distribution
    assert r["restored_rel"] == 0.0, r     # the switch turns them back on


@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss", "qwen3_5_moe", "deepseek_v3",
                                    "qwen3_moe", "qwen3_5_conditional"])
def test_grpo_with_lora_on_each_2026_family(pools, prompts, tmp_path, family):
    """GRPO with LoRA from a PEFT adapter peft made (non-zero B), every one holding expert
    adapters: on GLM-4.5 (q/k/v biases, q/k norms, partial RoPE, sigmoid-routed MoE with a
    shared expert) and Qwen3-MoE with peft's all-linear (attention, fused experts with
    gate_up_proj at 2r, router), gpt-oss (biased attention with sinks, sliding windows, biased
    experts) with its attention, experts and router, Qwen3.5-MoE with peft's all-linear there
    (gated attention, Gated DeltaNet, shared expert and its gate) and the experts, its
    published checkpoint with every projection and the experts, DeepSeek-V3 (rope_interleave
    false) with its MLA projections and gate/up/down_proj (peft: the routed experts), at DP2
    with the HF backend and model.lora.init_from alone: the merged weights (base + adapter,
    biases kept; routers and the shared expert's gate too; for Qwen3.5 the fused in_proj and
    gated q rows mapped back to HF's) reach the engine before the first rollout and after
    every update: rollout/logprob_diff < 1e-5 at both steps, and the update trains (grad
    norm > 0). The KL reference (kl.beta 0.001) is the starting adapter, frozen, with its
    expert, router and shared-gate matrices: policy/kl 0 at step 1, > 0 at step 2."""
    from tests.deepseek_v3_tiny import build_deepseek_v3
    from tests.glm4_moe_tiny import build_glm4_moe
    from tests.gpt_oss_tiny import build_gpt_oss
    from tests.qwen3_5_tiny import build_qwen3_5, build_qwen3_5_conditional
    from tests.test_lora_layouts import ATTENTION, EXPERTS, MLA, MLP, QWEN3_5

    build = {"glm4_moe": build_glm4_moe, "gpt_oss": build_gpt_oss,
             "qwen3_5_moe": lambda path: build_qwen3_5(path, moe=True),
             "qwen3_5_conditional": lambda path: build_qwen3_5_conditional(path, moe=True),
             "deepseek_v3": lambda path: build_deepseek_v3(path, mtp=False,
                                                           rope_interleave=False),
             "qwen3_moe": lambda path: build_tiny_model(path, "qwen3_moe",
                                                        initializer_range=0.2)}[family]
    base = build(str(tmp_path / family))
    # (peft's target_modules, target_parameters): all-linear adds the experts itself where
    # peft converts names (GLM-4.5, Qwen3-MoE), as do the MLP names on DeepSeek-V3
    targets, parameters = {
        "glm4_moe": ("all-linear", None), "qwen3_moe": ("all-linear", None),
        "gpt_oss": (ATTENTION, EXPERTS + ["mlp.router.weight"]),
        "qwen3_5_moe": ("all-linear", EXPERTS), "qwen3_5_conditional": (QWEN3_5, EXPERTS),
        "deepseek_v3": (MLA + MLP, None)}[family]
    adapter = build_peft_adapter(base, str(tmp_path / "adapter"), rank=4, alpha=8,
                                 targets=targets, parameters=parameters)
    # no model.lora.target_modules: the adapter's own (its target_parameters: experts)
    metrics = _run(pools, 2, base, prompts, tmp_path / "run", f"model.lora.init_from={adapter}")
    assert len(metrics) == 2
    for m in metrics:
        assert m["rollout/logprob_diff"] < 1e-5 and m["grad_norm"] > 0, m
    assert metrics[0]["policy/kl"] < 1e-9 < metrics[1]["policy/kl"], metrics
