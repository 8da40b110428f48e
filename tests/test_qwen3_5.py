"""Qwen3.5 (Gated DeltaNet hybrids), dense and MoE: tiny models from tests/qwen3_5_tiny.py.

- the chunked gated delta rule equals the recurrent form (fp32 rounding), segments restart;
- the weight-layout transforms round-trip at TP1/TP2; refusals name the field;
- conversion HF -> mcore -> HF is bitwise; `verify` within 1e-4 of transformers at TP2 and
  PP2 (dense), TP2 and EP2 (MoE);
- one GDN-layer case on the rank pool (tests/multirank/qwen3_5_check.py): packing and CP2 equal the
  unpacked single process, with the negative controls (state leaking across packed
  sequences, CP without the exchange);
- the SFT invariance harness (tests/multirank/sft_invariance.py) on both models: TP2+SP,
  PP2 (a GDN/attention split), CP2, packing, CP2+packing, TP2+SP with full recompute, EP2 and
  MoE packing against the single-process reference (rel 1e-5).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.launch import result_lines
from tests.qwen3_5_tiny import build_qwen3_5

CONVERT = "tools/convert.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {"dense": Path(build_qwen3_5(str(root / "dense"))),
            "moe": Path(build_qwen3_5(str(root / "moe"), moe=True))}


def _inputs(t: int, seed: int = 0):
    from models.layers.gated_delta_net.rule import l2norm

    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 16, 8
    q, k = (l2norm(torch.randn(b, t, h, dk, generator=gen)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.5
    beta = torch.rand(b, t, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("t,chunk", [(1, 64), (63, 64), (150, 64), (150, 16)])
def test_chunked_rule_equals_recurrent(t, chunk):
    from models.layers.gated_delta_net.rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

    args = _inputs(t)
    out, state = chunk_gated_delta_rule(*args, chunk_size=chunk)
    ref, ref_state = recurrent_gated_delta_rule(*args)
    assert (out - ref).abs().max() < 1e-6 and (state - ref_state).abs().max() < 1e-6


def test_segments_restart_state():
    from models.layers.gated_delta_net.rule import chunk_gated_delta_rule, segmented_gated_delta_rule

    q, k, v, g, beta = (x[:1] for x in _inputs(70))
    out = segmented_gated_delta_rule(q, k, v, g, beta, [0, 30, 70])
    alone = [chunk_gated_delta_rule(*(x[:, a:e] for x in (q, k, v, g, beta)))[0]
             for a, e in ((0, 30), (30, 70))]
    assert torch.equal(out, torch.cat(alone, dim=1))
    leaked = segmented_gated_delta_rule(q, k, v, g, beta)
    assert (leaked[:, 30:] - alone[1]).abs().max() > 1e-3   # negative control


@pytest.mark.parametrize("tp", [1, 2])
def test_layout_transforms_round_trip(tp):
    from models.layers.gated_delta_net.mapping import hybrid_export, hybrid_local_shard

    cfg = dict(linear_key_head_dim=8, linear_num_key_heads=4, linear_value_head_dim=8,
               linear_num_value_heads=8, num_attention_heads=4, num_key_value_heads=2)
    qkv, z, b, a = torch.randn(128, 64), torch.randn(64, 64), torch.randn(8, 64), torch.randn(8,
                                                                                          64)
    cases = {"gdn_in": [qkv, z, b, a], "gdn_conv": [torch.randn(128, 1, 4)],
             "gdn_heads": [torch.randn(8)],
             "qkv_gated": [torch.randn(128, 64), torch.randn(32, 64), torch.randn(32, 64)]}
    for kind, hf in cases.items():
        shards = [hybrid_local_shard(kind, hf, cfg, tp, r) for r in range(tp)]
        back = hybrid_export(kind, shards, cfg)
        assert all(torch.equal(x, y) for x, y in zip(back, hf)), kind


def test_refusals_name_the_field(models):
    from models.hf.config import config_problems
    from models.hf.io import read_config

    cfg = read_config(models["dense"])
    assert config_problems(cfg) == []
    wrong = [dict(cfg, attention_bias=True), dict(cfg, hidden_act="gelu"),
             dict(cfg, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4))]
    for bad, name in zip(wrong, ("attention_bias", "hidden_act", "rope_type")):
        assert any(name in p for p in config_problems(bad)), name


def test_gdn_heads_must_divide_tp_cp():
    from models.layers.gated_delta_net.module import GatedDeltaNetError, _check_heads  # noqa: PLC2701

    _check_heads(4, 8, 2, 2)
    with pytest.raises(GatedDeltaNetError, match="linear_num_key_heads=2"):
        _check_heads(2, 8, 2, 2)


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def convert_round_trip(pools, model: Path, ckpt: Path, out: Path) -> None:
    """tools/convert.py hf-to-mcore of `model` into `ckpt`, then mcore-to-hf into `out`, one
    rank each."""
    for args in (("hf-to-mcore", "--hf-dir", model, "--out", ckpt),
                 ("mcore-to-hf", "--ckpt", ckpt, "--out", out)):
        proc = pools.script(1, CONVERT, *map(str, args))
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _verify(pools, model: Path, ckpt: Path, *layout: str) -> float:
    proc = pools.script(2, CONVERT, "verify", "--hf-dir", str(model), "--ckpt", str(ckpt),
                        "--seq-len", "70", *layout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "max_abs_diff=" in x)
    return float(line.split("max_abs_diff=")[1].split()[0])


@pytest.mark.parametrize("kind,layouts", [("dense", (("--tp", "2"), ("--pp", "2"))),
                                          ("moe", (("--tp", "2"), ("--ep", "2")))])
def test_convert_round_trip_and_verify(pools, models, tmp_path, kind, layouts):
    model, ckpt, out = models[kind], tmp_path / "ckpt", tmp_path / "hf"
    convert_round_trip(pools, model, ckpt, out)
    a, b = _tensors(model), _tensors(out)
    assert sorted(a) == sorted(b)
    assert all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)
    for layout in layouts:
        assert _verify(pools, model, ckpt, *layout) < 1e-4, layout


def test_gdn_packing_and_cp_with_controls(pools):
    proc = pools.script(2, "tests/multirank/qwen3_5_check.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["check"]: r for r in result_lines(proc.stdout)}
    for check in ("packing", "cp2", "cp2_packed"):
        assert results[check]["out_rel"] < TOL and results[check]["grad_rel"] < TOL, check
    for control in ("packing_leak_control", "cp2_no_exchange_control",
                    "cp2_packed_no_exchange_control"):
        assert results[control]["out_rel"] > 1e-2, control


SPECS = ["2,1,0,1,16,sp", "1,2,0,1,4", "1,1,0,2,16", "1,1,0,1,16,packing",
         "1,1,0,2,16,packing", "2,1,0,1,3,sp+recompute=full", "1,1,0,1,4,moe+ep=2",
         "1,1,0,1,16,moe+packing"]


def test_sft_invariance(pools, models, tmp_path):
    script, ref = "tests/multirank/sft_invariance.py", tmp_path / "ref.json"
    # Adam eps 1e-3 (the harness default 1e-4 lets fp32 reduction-order noise on near-zero
    # gradients, e.g. lm_head rows of unseen tokens, reach 1.7e-5 of a parameter at TP2+SP)
    env = {"INV_MOE_MODEL_DIR": str(models["moe"]), "INV_ADAM_EPS": "1e-3"}
    one = "modes=token-mean"
    first = pools.script(1, script, str(models["dense"]), str(ref), f"1,1,0,1,16,{one}",
                         f"1,1,0,1,16,moe+{one}", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    specs = [s + ("+" if len(s.split(",")) > 5 else ",") + one for s in SPECS]
    proc = pools.script(2, script, str(models["dense"]), str(ref), *specs, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = result_lines(proc.stdout)
    assert len(results) == len(SPECS)
    for r in results:
        assert r["loss_rel"] < TOL and r["grad_norm_rel"] < TOL and r["param_rel"] < TOL, r


RL_KEYS = ("policy/loss", "policy/pg_loss", "policy/kl", "policy/entropy", "grad_norm",
           "reward/mean")


def _grpo(pools, model: Path, out: Path, nproc: int, *extra: str) -> list[dict]:
    """Two GRPO steps with the HF rollout backend (transformers' Qwen3.5 with the trainer's
    weights synced into it before step 2) on the session's `nproc`-rank pool."""
    import json

    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus 1 ?", "answer": i + 1})
                               + "\n" for i in range(8)))
    proc = pools.script(
        nproc, "-m", "engine.rl", f"model.hf_path={model}", f"data.train_files=[{prompts}]",
        "reward.fn=tests.rl_rewards:digit_reward", "kl.beta=0.05", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.mini_batches_per_step=1",
        "train.micro_batch_size=1", "train.max_steps=2", "train.seq_length=48", "optim.lr=1e-2",
        f"data.cache_dir={out}/cache", "data.num_workers=0", f"logging.dir={out}/run",
        f"logging.rollout_dir={out}/dump", "logging.progress_bar=false", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _stale_engine_gap(model: Path, dump: Path) -> float:
    """Mean |dumped rollout log-prob - transformers' log-prob at the INITIAL weights| over the
    sampled tokens of step 2: what rollout/logprob_diff would show if the weight sync had left
    the engine at its initial weights (the negative control of the logprob_diff check)."""
    import json

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    gaps = []
    for line in open(dump):
        r = json.loads(line)
        ids = torch.tensor([r["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
        mine = logp.gather(1, ids[0, 1:, None])[:, 0]
        gaps += [abs(r["rollout_logprobs"][j] - float(mine[j - 1]))
                 for j in range(1, len(r["token_ids"])) if r["loss_mask"][j]]
    return sum(gaps) / len(gaps)


def test_grpo_with_the_hf_backend_is_layout_invariant(pools, models, tmp_path):
    """GRPO (k3 KL to a frozen reference) on both tiny models with transformers' own Qwen3.5 as
    the rollout engine: the recomputed log-probs equal the engine's (rollout/logprob_diff,
    step 2 after a weight sync of the GDN, attention and expert weights) and every layout gives
    the one-process metrics: dense TP2+SP, PP2 (a GDN/attention split), CP2 with packing; MoE
    TP2+SP, EP2 with R3 routing replay (the engine's routing replayed in training), R2 at one
    rank. Negative control: an engine left at the initial weights would be off by far more."""
    runs = {
        "dense": [(1, ()), (2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
                  (2, ("parallel.pp=2",)),
                  (2, ("parallel.cp=2", "train.packing=true",
                       "train.max_tokens_per_micro_batch=64"))],
        "moe": [(1, ()), (2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
                (2, ("parallel.ep=2", "moe.routing_replay=R3")), (1, ("moe.routing_replay=R2",))],
    }
    for kind, layouts in runs.items():
        (nproc, extra), *others = layouts
        one = _grpo(pools, models[kind], tmp_path / f"{kind}_one", nproc, *extra)
        assert len(one) == 2 and one[0]["grad_norm"] > 0
        for m in one:
            assert m["rollout/logprob_diff"] < 1e-5 and m["rollout/logprob_diff_max"] < 1e-4, m
        assert _stale_engine_gap(models[kind], tmp_path / f"{kind}_one" / "dump" /
                                 "step_2.jsonl") > 1e-3
        for i, (nproc, extra) in enumerate(others):
            other = _grpo(pools, models[kind], tmp_path / f"{kind}_{i}", nproc, *extra)
            for a, b in zip(one, other):
                assert b["rollout/logprob_diff"] < 1e-5, (kind, extra, b)
                assert b.get("moe/replay_mismatch", 0.0) == 0.0, (kind, extra, b)
                assert b.get("moe/rollout_replay_mismatch", 0.0) == 0.0, (kind, extra, b)
                for key in RL_KEYS:
                    assert math.isclose(a[key], b[key], rel_tol=TOL, abs_tol=1e-7), \
                        (kind, extra, key, a[key], b[key])
