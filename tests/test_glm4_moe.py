"""GLM-4.5 MoE (`glm4_moe`) and the sigmoid routing it shares with DeepSeek-V3
(models.families.sigmoid_routed), on the tiny model of tests/glm4_moe_tiny.py:

- megatron's router function, fed the kwargs the family maps to, gives transformers' routing
  weights and choices exactly (grouped and ungrouped, scaling, renormalisation); the bias used
  for weighting too, and the shapes the family refuses, give other numbers (negative controls);
- refusals name the field; parameter counts equal transformers' per stage (dense + MoE layers,
  shared experts) and the GLM-4.5-Air preset counts 106.85 B (12.2 B active without the
  embeddings);
- hf-to-mcore -> mcore-to-hf is bitwise, the MTP layer included; `verify` at TP2, PP2 (a dense
  stage and a MoE stage) and EP2 is within 1e-4 of transformers; the megatron logits equal
  transformers' and the bias-weighting bug does not;
- the SFT invariance harness with the aux-loss-free bias update on (moe.bias_update_rate):
  TP2+SP, EP2, PP2, CP2 and packing equal the single process (loss, grad norm, parameters and
  the updated e_score_correction_bias, rel 1e-5); negative controls: per-rank token counts,
  padding counted;
- GRPO with the HF rollout backend at EP2 (weight sync of experts, shared experts and bias);
  a trained checkpoint exports its MTP tensors unchanged;
- PP2 with an all-dense stage (its expert optimizer empty: megatron's state_dict fails there
  without Apex / TE, the control) saves, and resumes at DP2 equal to the straight run.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.glm4_moe_tiny import CONFIG, build_glm4_moe
from tests.launch import result_lines

CONVERT = "tools/convert.py"
CHECK = "tests/multirank/glm4_moe_check.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    return build_glm4_moe(str(tmp_path_factory.mktemp("glm4_moe") / "model"))


def _routers(**values):
    """(HF Glm4MoeTopkRouter, megatron routing function kwargs) for the tiny config + values."""
    from transformers.models.glm4_moe import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from models.families.sigmoid_routed import routing_kwargs

    cfg = Glm4MoeConfig(**dict(CONFIG, **values))
    hf = Glm4MoeTopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(hf.num_experts, generator=gen))
    kw = routing_kwargs(cfg)
    return hf, dict(topk=cfg.num_experts_per_tok, num_groups=kw["moe_router_num_groups"],
                    group_topk=kw["moe_router_group_topk"], score_function="sigmoid",
                    scaling_factor=kw["moe_router_topk_scaling_factor"],
                    expert_bias=hf.e_score_correction_bias)


def _compare(hf, kw, route=None) -> float:
    """Max |megatron - HF| of the dense [tokens, experts] routing weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    x = torch.randn(256, hf.hidden_dim, generator=torch.Generator().manual_seed(4))
    _, weights, idx = hf(x)
    ref = torch.zeros(x.shape[0], hf.num_experts).scatter(1, idx, weights)
    probs, routing_map = (route or topk_routing_with_score_function)(x @ hf.weight.T, **kw)
    assert torch.equal(routing_map, ref > 0) or route is not None
    return float((probs - ref).abs().max())


@pytest.mark.parametrize("values", [
    {}, dict(n_group=1, topk_group=1), dict(n_routed_experts=16, num_experts_per_tok=4,
                                            n_group=4, topk_group=2),
    dict(n_group=4, topk_group=4, routed_scaling_factor=1.0)])
def test_megatron_router_equals_hf(values):
    hf, kw = _routers(**values)
    assert _compare(hf, kw) < 1e-6


def test_router_negative_controls():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from tests.multirank.glm4_moe_check import biased_weights

    hf, kw = _routers()
    assert _compare(hf, kw, biased_weights(topk_routing_with_score_function)) > 1e-2
    # refused shapes really differ: group scores of top-(k / topk_group) != top-2 ...
    hf, kw = _routers(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=1)
    assert _compare(hf, kw, topk_routing_with_score_function) > 1e-2
    # ... and no renormalisation in HF while megatron always renormalises
    hf, kw = _routers(norm_topk_prob=False)
    assert _compare(hf, kw, topk_routing_with_score_function) > 1e-2


def test_refusals_name_the_field(glm_dir):
    from models.hf.config import config_problems
    from models.hf.io import read_config

    cfg = read_config(glm_dir)
    assert config_problems(cfg) == []
    wrong = {"n_group": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                             topk_group=1),
             "norm_topk_prob": dict(norm_topk_prob=False),
             "scoring_func": dict(scoring_func="softmax"),
             "topk_method": dict(topk_method="greedy"),
             "first_k_dense_replace": dict(first_k_dense_replace=5),
             "rope_type": dict(rope_parameters=dict(rope_type="linear", factor=2.0,
                                                    rope_theta=1e4)),
             "hidden_act": dict(hidden_act="relu")}
    for name, values in wrong.items():
        assert any(name in p for p in config_problems(dict(cfg, **values))), name


def test_parameter_counts_equal_transformers(glm_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.families.registry import model_presets
    from models.estimate.counting import padded_vocab_size, stage_parameters
    from models.hf.io import read_config

    cfg = read_config(glm_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(glm_dir))
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    counts = stage_parameters(cfg, 1, 2)
    assert stage_parameters(cfg, 1, 1).total == sum(sizes.values())
    first = sum(v for n, v in sizes.items() if "layers.0." in n or "embed" in n)
    last = sum(v for n, v in sizes.items() if "layers.1." in n or "lm_head" in n
               or n == "model.norm.weight")
    pad = (padded_vocab_size(cfg["vocab_size"]) - cfg["vocab_size"]) * cfg["hidden_size"]
    assert (counts.first_stage, counts.last_stage) == (first + pad, last + pad)
    air = stage_parameters(model_presets()["glm-4.5-air"], 1, 1)
    assert air.total == 106_852_245_504 and air.active == 13_424_123_904


def test_bias_update_key():
    from engine.config.moe_settings import MoEConfig, moe_overrides, moe_problems

    glm, qwen = {"model_type": "glm4_moe", **CONFIG}, {"model_type": "qwen3_moe"}
    cfg = SimpleNamespace(moe=MoEConfig(bias_update_rate=1e-3), parallel=SimpleNamespace(ep=1))
    assert moe_problems(cfg, glm) == []
    assert moe_overrides(cfg, glm)["moe_router_bias_update_rate"] == 1e-3
    assert moe_overrides(cfg, glm, forward_only=True)["moe_router_bias_update_rate"] == 0.0
    assert "moe.bias_update_rate" in " ".join(moe_problems(cfg, qwen))
    cfg.moe.bias_update_rate = -1.0
    assert "must be a number >= 0" in " ".join(moe_problems(cfg, glm))


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_convert_round_trip_verify_and_logits(pools, glm_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    pools.script(1, CONVERT, "hf-to-mcore", "--hf-dir", glm_dir, "--out", str(ckpt))
    pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    a, b = _tensors(Path(glm_dir)), _tensors(out)
    assert sorted(a) == sorted(b) and "model.layers.2.eh_proj.weight" in b  # MTP carried
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)
    for layout in (("--tp", "2"), ("--pp", "2"), ("--ep", "2")):
        proc = pools.script(2, CONVERT, "verify", "--hf-dir", glm_dir, "--ckpt", str(ckpt),
                            "--seq-len", "40", *layout)
        line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
        assert float(line.split("max_abs_diff=")[1].split()[0]) < 1e-4, layout
    [parity] = pools.run(1, "tests.multirank.glm4_moe_check:logits_parity", glm_dir)
    assert parity["max_abs"] < 1e-4 and parity["bug_max_abs"] > 1e-2, parity


BIAS = "bias=0.01+modes=token-mean"
SPECS = [f"2,1,0,1,16,sp+{BIAS}", f"1,1,0,1,4,ep=2+{BIAS}", f"1,2,0,1,4,{BIAS}",
         f"1,1,0,2,16,{BIAS}", f"1,1,0,1,16,packing+{BIAS}"]
CONTROLS = [f"1,1,0,1,16,bug=localbias+{BIAS}", f"1,1,0,1,4,bug=padcount+{BIAS}"]


def test_invariance_with_bias_update(pools, glm_dir, tmp_path):
    ref = str(tmp_path / "ref.pt")
    env = {"INV_ADAM_EPS": "1e-3"}
    first = pools.script(1, CHECK, glm_dir, ref, f"1,1,0,1,16,{BIAS}", env=env, timeout=900)
    assert result_lines(first.stdout)[0]["reference"]
    proc = pools.script(2, CHECK, glm_dir, ref, *SPECS, *CONTROLS, env=env, timeout=900)
    results = {r["spec"]: r for r in result_lines(proc.stdout)}
    assert len(results) == len(SPECS) + len(CONTROLS)
    for spec in SPECS:
        r = results[spec]
        assert r["loss_rel"] < TOL and r["grad_norm_rel"] < TOL and r["param_rel"] < TOL, r
    for spec in CONTROLS:
        assert results[spec]["param_rel"] > 1e-3, results[spec]


def _prompts(path: Path) -> str:
    with open(path, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"what is {i % 10} plus {(3 * i + 1) % 10} ?",
                                "answer": i % 10 + (3 * i + 1) % 10}) + "\n")
    return str(path)


def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_hf_rollouts_at_ep2(pools, glm_dir, tmp_path):
    """GRPO at DP2 x EP2 with the HF rollout backend, R3 routing replay (the engine's routing
    of the MoE layer; the dense layer's columns unused) and the bias update on: the weight sync
    (experts gathered over EP, shared experts, the updated e_score_correction_bias) makes the
    engine's logits equal the trainer's after the weights moved; rollout/logprob_diff < 1e-3.
    The trained checkpoint exports its MTP tensors unchanged, beside moved weights and bias."""
    log_dir, ckpt, out = tmp_path / "rl", tmp_path / "ckpt", tmp_path / "hf"
    pools.script(
        2, "-m", "engine.rl", f"model.hf_path={glm_dir}",
        f"data.train_files=[{_prompts(tmp_path / 'p.jsonl')}]", "parallel.ep=2",
        "moe.bias_update_rate=0.01", "moe.routing_replay=R3", "rollout.n=4", "rollout.max_new_tokens=8",
        "train.prompts_per_step=4", "train.mini_batches_per_step=2",
        "train.micro_batch_size=2", "train.max_steps=2", "train.seq_length=64",
        "optim.lr=1e-3", "kl.beta=0.05", "reward.fn=tests.rl_rewards:digit_reward",
        "rollout.check_weight_sync=true", f"logging.dir={log_dir}", f"checkpoint.dir={ckpt}",
        "logging.progress_bar=false", timeout=400)
    steps = _metrics(log_dir)
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_diff"] < 1e-3, m
        assert m["debug/sync_logit_max_diff"] < 1e-4 and m["debug/sync_logit_change"] > 1e-2
        assert m["grad_norm"] > 0 and m["reward/std"] > 0
        assert m["moe/rollout_replay_mismatch"] < 0.02, m  # engine routes as the trainer
    pools.script(1, CONVERT, "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    a, b = _tensors(Path(glm_dir)), _tensors(out)
    mtp = [n for n in a if n.startswith("model.layers.2.")]
    assert sorted(a) == sorted(b) and len(mtp) == 6
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in mtp)
    for name in ("model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.shared_experts.up_proj.weight"):
        assert not torch.equal(a[name], b[name]), name


def test_r2_replays_the_sigmoid_group_routing_exactly(pools, glm_dir, tmp_path):
    """R2 (the old-log-prob forward's routing replayed in the update) with sigmoid scores,
    the selection-only bias, group-limited top-k and routed scaling: with one mini-batch per
    step the update's weights are those of the recording, so a replay that picks the same
    experts AND weights them as the router does gives the run without replay exactly (loss,
    grad norm, KL, log-prob diff; moe/replay_mismatch 0). A replay that weighted the choices
    otherwise (softmax, the bias in the weights, no scaling) would move the loss: the router
    tests above show those give other weights."""
    args = ("-m", "engine.rl", f"model.hf_path={glm_dir}",
            f"data.train_files=[{_prompts(tmp_path / 'p.jsonl')}]", "rollout.n=2",
            "rollout.max_new_tokens=6", "train.prompts_per_step=2",
            "train.mini_batches_per_step=1", "train.micro_batch_size=2", "train.max_steps=2",
            "train.seq_length=64", "optim.lr=1e-2", "kl.beta=0.05",
            "reward.fn=tests.rl_rewards:digit_reward", "logging.progress_bar=false")
    runs = {}
    for name, extra in (("plain", ()), ("r2", ("moe.routing_replay=R2",))):
        pools.script(1, *args, *extra, f"logging.dir={tmp_path / name}", timeout=300)
        runs[name] = _metrics(tmp_path / name)
    assert len(runs["r2"]) == 2 and runs["r2"][1]["grad_norm"] > 0
    for a, b in zip(runs["plain"], runs["r2"]):
        assert b["moe/replay_mismatch"] == 0.0, b
        assert b["rollout/logprob_diff"] < 1e-3, b
        for key in ("policy/loss", "grad_norm", "policy/kl", "rollout/logprob_diff",
                    "reward/mean"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a[key], b[key])


def empty_expert_optimizer_probe(model_dir: str) -> dict:
    """On a pool rank at PP2 (stage 0 holds the dense layer 0 only): after one step, the
    number of this rank's DistributedOptimizers without parameters, whether megatron's own
    state_dict raises on them (the failure engine.checkpoint.empty_optimizer answers) and the
    step the answered state dict carries."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from engine.checkpoint.empty_optimizer import empty_optimizers_answered
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from engine.training.micro_batches import SequenceData

    cfg = read_config(model_dir)
    setup_model_parallel(ParallelLayout(2, pp=2))
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    engine = TrainEngine.build(cfg, optim, torch.float32, 1, train, weights_dir=model_dir)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, cfg["vocab_size"], (13,), generator=gen).tolist() for _ in range(4)]
    seqs = [SequenceData(x[:-1], x[1:], [1] * 12) for x in ids]
    train_step(engine, seqs, GlobalLossNormalizer("token-mean"))
    empty = [o for o in engine.optimizer.chained_optimizers
             if isinstance(o, DistributedOptimizer)
             and not any(g["params"] for g in o.optimizer.param_groups)]
    raised = []
    for opt in empty:
        try:
            opt.state_dict()
            raised.append(False)
        except AssertionError:
            raised.append(True)
    with empty_optimizers_answered(engine.optimizer):
        steps = [g["step"] for o in empty for g in o.state_dict()["optimizer"]["param_groups"]]
    engine.release()
    return {"empty": len(empty), "raised": raised, "steps": steps}


def test_pp2_with_an_all_dense_stage_saves_and_resumes(pools, glm_dir, tmp_path):
    """PP2 puts GLM-4.5's dense layer 0 alone on stage 0, whose expert optimizer then holds
    no parameter: megatron's state_dict fails there without Apex / Transformer Engine (probe,
    the control), engine.checkpoint.empty_optimizer answers it. A PP2 run saves at step 2;
    resumed from it at DP2 (resharded), steps 3-4 equal the straight run's (rel 1e-6)."""
    probe = pools.run(2, "tests.test_glm4_moe:empty_expert_optimizer_probe", glm_dir)
    assert probe[0] == {"empty": 1, "raised": [True], "steps": [1.0]}, probe
    assert probe[1]["empty"] == 0, probe
    rows = [{"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                          {"role": "assistant", "content": f"w{i + 2} w{i + 3}"}]}
            for i in range(16)]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ("-m", "engine.sft", f"model.hf_path={glm_dir}", f"data.train_files=[{data}]",
              "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
              "train.max_steps=4", "optim.lr=1e-2", "logging.progress_bar=false",
              "checkpoint.save_interval=2", f"data.cache_dir={tmp_path / 'cache'}")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pools.script(2, *common, "parallel.pp=2", f"logging.dir={straight}",
                 f"checkpoint.dir={straight / 'ckpt'}")
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(straight / "ckpt" / "iter_0000002", resumed / "ckpt" / "iter_0000002")
    (resumed / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    proc = pools.script(2, *common, f"logging.dir={resumed}", f"checkpoint.dir={resumed / 'ckpt'}")
    assert "resumed from" in proc.stdout, proc.stdout[-2000:]

    def metrics(run: Path) -> dict:
        return {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text()
                                          .splitlines())}
    a, b = metrics(straight), metrics(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm"):
            assert abs(b[step][key] - a[step][key]) <= 1e-6 * abs(a[step][key]), (step, key)


def test_param_state_is_left_out_of_the_cross_rank_comparison():
    """The common state megatron compares across ranks before a save leaves out each chained
    optimizer's param_state: the empty expert optimizer of an all-dense stage keeps its empty
    one in the common state, where the other stage's is sharded ("Rank 1 common state dict
    differs ... ('optimizer', 1, 'param_state')" at every save of the PP2 run above, before)."""
    from engine.checkpoint.checkpointing import common_state_to_compare

    chained = {"optimizer": {0: {"optimizer": {"lr": 1}, "param_state": None},
                             1: {"optimizer": {"lr": 1}, "param_state": {}}}, "data": 3}
    assert common_state_to_compare(chained) == {"optimizer": {0: {"optimizer": {"lr": 1}},
                                                              1: {"optimizer": {"lr": 1}}},
                                                "data": 3}
    one = {"optimizer": {"optimizer": {"lr": 1}, "param_state": None}}
    assert common_state_to_compare(one) == {"optimizer": {"optimizer": {"lr": 1}}}
