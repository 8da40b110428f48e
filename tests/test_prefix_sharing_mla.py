"""train.prefix_sharing on multi-latent attention (issue 91): DeepSeek-V3 / Kimi-K2 shapes, the
tiny models of tests/deepseek_v3_tiny.py ("lora": q_lora_rank 32, YaRN with mscale, 2 layers;
"qproj": Moonlight's q_proj without q_lora_rank, default RoPE, 4 layers, initializer range
0.1). MLA's RoPE reaches megatron's thd rotary (models.layers.attention.packed_rope.apply_thd),
which reads the tree's depths from the cu_seqlens it is handed, so MLA shares as the standard
attention does.

- sharing on against off on the same batches through the real engine
  (tests/multirank/prefix_sharing_check.py: GRPO's log-prob stage + 3 policy updates, 3 SFT
  steps): "lora" at 1 process and TP2 + SP, "qproj" at 1 process and CP2 (Ulysses, packed):
  per-token log-probs within 1e-5 of the largest, loss, grad norm and every metric within rel
  1e-5; negative controls (1 process, "lora"): RoPE positions counted along the tree row (MLA's
  rope, the only attention these models have) and a row that sees its sibling branches;
- prompts of 260+ tokens (the CPU's split attention, parallel.tree_attention_split): MLA's value
  head dim (12) differs from its query/key dim (24), which the CPU flash kernel refuses; the
  split pads the smaller side. Log-probs and one SFT step on "lora" shared = unshared, and the
  split itself against the dense tree attention in float64 (v narrower and wider than q/k);
  negative control: the kernel without the pad raises;
- the MLA families are accepted by the settings check (MTP still refused).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.deepseek_v3_tiny import build_deepseek_v3

CHECK = "tests/multirank/prefix_sharing_check.py"
TOL = 1e-5
LORA_1 = "1,1,1,mbs=2+ctl+obj=grpo/sft"
QPROJ_1 = "1,1,1,mbs=2+obj=grpo/sft"
LORA_TP2 = "2,1,1,sp+obj=grpo/sft"
QPROJ_CP2 = "1,1,2,obj=grpo/sft"
LONG = dict(max_position_embeddings=512,   # rows of ~280 tokens; YaRN's factor 4 kept exact
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                 mscale_all_dim=0.8, original_max_position_embeddings=128))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mla")
    # initializer_range 0.1: at 0.2 its GRPO grad norm reaches ~400 at step 2 (clip 1.0) and
    # the two summation orders' rounding grows through Adam past 1e-5 (step 1: 2e-7)
    qproj = dict(q_lora_rank=None, rope_interleave=False, mtp=False, num_hidden_layers=4,
                 initializer_range=0.1,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return {"lora": build_deepseek_v3(str(root / "lora"), mtp=False, **LONG),
            "qproj": build_deepseek_v3(str(root / "qproj"), **qproj)}


def _lines(proc, tag: str) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines()
            if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def harness(pools, models):
    """RESULT and CONTROL lines of the four launches."""
    results, controls = [], []
    for world, model, spec in ((1, "lora", LORA_1), (1, "qproj", QPROJ_1),
                               (2, "lora", LORA_TP2), (2, "qproj", QPROJ_CP2)):
        proc = pools.script(world, CHECK, models[model], spec, timeout=600)
        results += [dict(r, model=model) for r in _lines(proc, "RESULT")]
        controls += _lines(proc, "CONTROL")
    return results, controls


def test_mla_shared_equals_unshared(harness):
    results, _ = harness
    assert sorted((r["model"], r["spec"], r["objective"]) for r in results) == sorted(
        (m, s, o) for m, s in (("lora", LORA_1), ("qproj", QPROJ_1), ("lora", LORA_TP2),
                               ("qproj", QPROJ_CP2)) for o in ("grpo", "sft"))
    for r in results:
        assert r["logprob_rel"] < TOL and r["metric_rel"] < TOL, r
        assert r["ratio_off"] == 1.0 and r["ratio_on"] < 0.5, r
        assert len(r["losses"]) == 3 and len(set(r["losses"])) == 3, r   # the model trains


def test_mla_negative_controls_are_caught(harness):
    """MLA's RoPE at positions along the tree row (not each token's depth), and a row seeing
    its sibling branches: both far outside the tolerance."""
    _, controls = harness
    assert sorted(c["kind"] for c in controls) == ["sibling_visible", "tree_positions"]
    for c in controls:
        assert c["logprob_rel"] > 1e-2 and c["metric_rel"] > 1e-2, c


def long_prompt_run(model_dir: str, sharing: bool) -> dict:
    """On a pool rank: the token log-probs of 2 prompts of 260-270 tokens x 4 replies, then one
    SFT step (token-mean) on the rows; plain numbers back."""
    from types import SimpleNamespace

    from engine.rl.policy.logprobs import compute_token_logprobs
    from engine.sft.training import SFT_REPORT_KEYS, sft_loss_fn
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.micro_batches import SequenceData
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from tests.multirank.rl_invariance import optim_settings
    import parallel.tree_attention as tree_attention

    setup_model_parallel(ParallelLayout(1))
    hf_config = read_config(model_dir)
    rng = random.Random(3)
    seqs = []
    for _ in range(2):
        prompt = [rng.randrange(4, 200) for _ in range(rng.randint(260, 270))]
        for _ in range(4):
            ids = prompt + [rng.randrange(4, 200) for _ in range(rng.randint(3, 12))]
            mask = [0] * (len(prompt) - 1) + [1] * (len(ids) - len(prompt)) + [0]
            seqs.append(SequenceData(ids, ids[1:] + [0], mask))
    train = SimpleNamespace(micro_batch_size=4, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=True, prefix_sharing=sharing)
    engine = TrainEngine.build(hf_config, optim_settings(), torch.float32, 1, train,
                               weights_dir=model_dir, loss_chunk_tokens=16)
    before = tree_attention.PATHS_RUN["split"]
    table = compute_token_logprobs(engine, seqs, 1.0)
    step = engine.train_batch(seqs, GlobalLossNormalizer("token-mean"),
                              sft_loss_fn(engine.vocab_size), SFT_REPORT_KEYS)
    engine.release()
    return {"table": table.tolist(), "split": tree_attention.PATHS_RUN["split"] - before,
            "loss": float(step["loss"]), "grad_norm": float(step["grad_norm"])}


def test_mla_long_prompts_take_the_split_attention(pools, models):
    target = "tests.test_prefix_sharing_mla:long_prompt_run"
    off, on = (pools.run(1, target, models["lora"], sharing, timeout=300)[0]
               for sharing in (False, True))
    assert off["split"] == 0 and on["split"] > 0
    a, b = (torch.tensor(r["table"], dtype=torch.float64) for r in (off, on))
    assert float(a.abs().max()) > 1.0
    assert float((a - b).abs().max() / a.abs().max()) < TOL, (a - b).abs().max()
    for key in ("loss", "grad_norm"):
        assert abs(on[key] - off[key]) < TOL * abs(off[key]), (key, off, on)


@pytest.mark.parametrize("dv", [12, 40])
def test_split_attention_with_its_own_value_head_dim(dv):
    """The split against the dense tree attention, float64, q/k head dim 24 (MLA: v 12 narrower,
    40 wider); forward and gradients. Negative control: the flash kernel without the pad."""
    from engine.training.prefix_tree import build_prefix_tree
    from parallel.tree_attention import dense_tree_attention, tree_params
    from parallel.tree_attention_split import (_SplitTreeAttention, _plan_of,
                                               split_tree_attention, splits)

    rng = random.Random(0)
    prompt = [rng.randrange(100) for _ in range(300)]
    tree = build_prefix_tree([prompt + [rng.randrange(100) for _ in range(rng.randint(3, 9))]
                              for _ in range(4)])
    n = tree.num_tokens
    params = tree_params(tree.segments, tree.subtree_end, tree.runs, torch.tensor(tree.depth), n)
    assert splits(params, n)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, 4, 24, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    v = torch.randn(n, 4, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    out = split_tree_attention(q, k, v, params, 0.2)
    ref = dense_tree_attention(q, k, v, tree.subtree_end, 0.2)
    assert out.shape == (n, 4, dv) and float((out - ref).abs().max()) < 1e-12
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for g, r in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert float((g - r).abs().max()) < 1e-12
    with pytest.raises(RuntimeError, match="same head size"):
        _SplitTreeAttention.apply(q, k, v, _plan_of(params, n), 0.2)


def test_mla_families_are_accepted():
    """DeepSeek-V3 and Kimi-K2 (MLA + sigmoid-routed experts) share; MTP is still refused."""
    from types import SimpleNamespace as NS

    from engine.config.prefix_sharing_settings import prefix_sharing_problems

    def cfg(mtp: bool):
        return NS(train=NS(prefix_sharing=True, compile="false"),
                  parallel=NS(cp=1, cp_comm_type="a2a"),
                  model=NS(hf_path="/m", mtp=NS(enabled=mtp)),
                  moe=NS(routing_replay=None, bias_update_rate=0.0, capacity_factor=None))
    for model_type in ("deepseek_v3", "kimi_k2"):
        assert prefix_sharing_problems(cfg(False), {"model_type": model_type}) == []
        problems = prefix_sharing_problems(cfg(True), {"model_type": model_type})
        assert len(problems) == 1 and "model.mtp.enabled" in problems[0], problems
