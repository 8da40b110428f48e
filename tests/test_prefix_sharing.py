"""train.prefix_sharing against the unshared rows on the same batches (issue 91), through the
real engine: GRPO (log-prob stage, 3 policy updates with the full loss), SFT (3 steps), DPO
(3 steps with a frozen reference) and the PPO critic (values, GAE, 3 critic updates), at 1
process (with the negative controls; GRPO, SFT and DPO again with a LoRA policy) and at DP2
with gradient accumulation, TP2 with sequence parallelism (also with the loss on megatron's
logits instead of the chunked head), PP2, PP2 with virtual stages and CP2 (Ulysses, packed).
The harness: tests/multirank/prefix_sharing_check.py; the pieces: tests/test_prefix_tree.py."""
from __future__ import annotations

import json

import pytest

CHECK = "tests/multirank/prefix_sharing_check.py"
TOL = 1e-5
# DP2 with gradient accumulation, TP2 + SP, PP2, PP2 x VPP2, CP2 (Ulysses, packed)
LAYOUTS = ("1,1,1,mbs=1", "2,1,1,sp", "1,2,1", "1,2,1,vpp=2+mbs=1", "1,1,2")
LORA = "1,1,1,mbs=2+lora+obj=grpo/sft/dpo"   # a LoRA policy (all-linear adapters)
UNCHUNKED = "2,1,1,sp+unchunked+obj=grpo/sft"   # megatron's logits gathered (TP2 + SP)
# rows whose one shared micro-batch (40 tree tokens) runs unshared: 44 tokens against a budget
# of 40 (the harness's fallback_rows)
FALLBACK = "1,1,1,dyn=40+fallback+obj=sft"


def _lines(proc, tag: str) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines()
            if line.startswith(tag + " ")]


# the CPU's split tree attention (parallel.tree_attention_split) for every set of sibling runs:
# its SPLIT_MIN_KEYS (256) keeps these fixtures' short prompts on the per-run path otherwise
# (the MoE and bench cases below keep it, so both paths run through the engine)
SPLIT = {"PREFIX_SPLIT_MIN_KEYS": "1"}


@pytest.fixture(scope="module")
def one_process(pools, qwen3_dir):
    proc = pools.script(1, CHECK, qwen3_dir, "1,1,1,mbs=2+ctl", LORA, FALLBACK, timeout=600,
                        env=SPLIT)
    return _lines(proc, "RESULT"), _lines(proc, "CONTROL")


@pytest.fixture(scope="module")
def two_ranks(pools, qwen3_dir):
    proc = pools.script(2, CHECK, qwen3_dir, *LAYOUTS, UNCHUNKED, timeout=900, env=SPLIT)
    return _lines(proc, "RESULT")


# DPO's rewards/chosen, rewards/rejected and rewards/margins are beta times differences of the
# policy's and the frozen reference's log-prob sums (up to -118 on these fixtures; the rewards
# start at exactly 0 and stay below 1.4): their rounding is the sums' rounding, so
# they are compared relative to beta times the sums' size (logps/*, the largest over the
# steps), as tests/test_mtp.py judges a rounding residue by its size. Relative to their own
# small size they read up to 2.7e-5 on the split tree attention with LoRA (over the 1e-5
# tolerance; 2.0e-6 relative to the sums, which agree within 3.4e-8). Every other metric:
# relative to its own largest size (the harness).
DPO_BETA = 0.5   # tests/multirank/dpo_check.run_cfg's dpo.beta
REWARD_DIFFERENCES = ("rewards/chosen", "rewards/rejected", "rewards/margins")


def metric_rel(result: dict) -> float:
    """The largest relative difference of a result's compared metrics (the harness's
    metric_rel), DPO's reward differences relative to their log-prob sums (above)."""
    if result["objective"] != "dpo":
        return result["metric_rel"]
    from tests.multirank.prefix_sharing_check import SKIP

    scales, diffs = result["scales"], result["metric_abs"]
    sums = DPO_BETA * max(scales["logps/chosen"], scales["logps/rejected"])
    return max(d / (sums if k in REWARD_DIFFERENCES else max(scales[k], 1e-6))
               for k, d in diffs.items() if not k.startswith(SKIP))


def _check(result: dict) -> None:
    assert result["logprob_rel"] < TOL, result
    assert metric_rel(result) < TOL, result
    assert result["ratio_off"] == 1.0, result
    assert result["ratio_on"] < (0.9 if result["objective"] == "dpo" else 0.5), result
    losses = result["losses"]
    assert len(losses) == 3 and len(set(losses)) == 3, result   # the model trains


def test_shared_equals_unshared_at_one_process(one_process):
    results, _ = one_process
    assert sorted((r["spec"], r["objective"]) for r in results) == sorted(
        [("1,1,1,mbs=2+ctl", o) for o in ("dpo", "grpo", "ppo", "sft")]
        + [(LORA, o) for o in ("dpo", "grpo", "sft")] + [(FALLBACK, "sft")])
    for r in results:
        if r["spec"] != FALLBACK:
            _check(r)


def test_unshared_fallback_replanned_within_budget_equals_unshared(one_process):
    """A micro-batch that falls back to its unshared rows (its tree saves under 10 %) over the
    token budget is re-planned by the unshared planner (prefix_tree.unshared_within_budget):
    2 micro-batches, not one of 44 tokens against 40 (tests/test_prefix_tree.py checks every
    micro-batch's tokens), and the 3 SFT steps equal the unshared run's."""
    (r,) = [r for r in one_process[0] if r["spec"] == FALLBACK]
    assert r["logprob_rel"] < TOL and metric_rel(r) < TOL, r
    assert r["ratio_off"] == r["ratio_on"] == 1.0 and r["micro_batches_on"] == 2, r
    assert len(set(r["losses"])) == 3, r


def test_negative_controls_are_caught(one_process):
    """A row seeing its sibling branches, or RoPE positions counted along the tree row, are
    far outside the tolerance of the same comparison."""
    _, controls = one_process
    assert sorted(c["kind"] for c in controls) == ["sibling_visible", "tree_positions"]
    for c in controls:
        assert c["logprob_rel"] > 1e-2 and c["metric_rel"] > 1e-2, c


def test_shared_equals_unshared_at_every_layout(two_ranks):
    specs = {(r["spec"], r["objective"]) for r in two_ranks}
    assert specs == {(s, o) for s in LAYOUTS for o in ("grpo", "sft", "dpo", "ppo")} | {
        (UNCHUNKED, "grpo"), (UNCHUNKED, "sft")}
    for r in two_ranks:
        _check(r)


def test_bench_quick_reports_equal_numbers_and_ratios(pools):
    """`python -m tools.bench prefix_sharing --quick` (one rank of the pool): every workload's
    loss, grad norm and log-probs equal between the modes, the token ratios of its workloads
    (the short one runs unshared: ratio 1), and 2 timed repeats whose median and spread the
    speed-up and its verdict are (judge); no timing is asserted."""
    from tools.bench.common import last_json_line, median
    from tools.bench.prefix_sharing import judge

    proc = pools.script(1, "-m", "tools.bench", "prefix_sharing", "--quick", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    work = {k.split("_")[-1]: v for k, v in summary.items() if isinstance(v, dict)
            and k.startswith("prefix_sharing_")}
    assert sorted(work) == ["agent", "dpo", "grpo", "short"]
    for w in work.values():
        assert w["loss_rel"] < 1e-5 and w["grad_norm_rel"] < 1e-5, w
        assert w["logprob_max_abs"] < 1e-4, w
        ratios = w["speedups"]
        assert len(ratios) == 2 and w["spread"] == [min(ratios), max(ratios)], w
        assert w["speedup"] == median(ratios) and w["met"] == judge(ratios, w["goal"]), w
    assert work["grpo"]["ratio"] < 0.3 and work["agent"]["ratio"] < 0.3, work
    assert 0.6 < work["dpo"]["ratio"] < 0.75 and work["short"]["ratio"] == 1.0, work


MOE_EP2 = "1,1,1,ep=2+mbs=2+ctl+obj=grpo/sft"   # Qwen3-MoE, EP2 (DP2), router losses off
MOE_AUX = "1,1,1,ep=2+mbs=2+aux+obj=grpo"       # the same with the router losses on


@pytest.fixture(scope="module")
def moe_ep2(pools, tmp_path_factory):
    from tests.conftest import INIT_RANGE
    from tools.tiny_models import build_tiny_model

    moe = build_tiny_model(str(tmp_path_factory.mktemp("moe")), "qwen3_moe", layers=2,
                           initializer_range=INIT_RANGE)
    proc = pools.script(2, CHECK, moe, MOE_EP2, MOE_AUX, timeout=600)
    return _lines(proc, "RESULT"), _lines(proc, "CONTROL")


def test_moe_ep2_shared_equals_unshared(moe_ep2):
    """Qwen3-MoE at EP2 (8 experts, top-2): log-probs, loss, grad norm and every non-moe/*
    metric equal over 3 steps with the router losses off; the moe/* metrics count the tokens
    the model runs (a shared token once: engine.training.router_losses), so the expert-load
    ratio differs. The negative controls are caught here too."""
    results, controls = moe_ep2
    exact = {r["objective"]: r for r in results if r["spec"] == MOE_EP2}
    assert sorted(exact) == ["grpo", "sft"]
    for r in exact.values():
        _check(r)
        assert r["moe_rel"]["moe/expert_load_max_over_mean"] > 1e-3, r
    assert sorted(c["kind"] for c in controls) == ["sibling_visible", "tree_positions"]
    for c in controls:
        assert c["logprob_rel"] > 1e-2 and c["metric_rel"] > 1e-2, c


def test_moe_router_losses_count_tokens_run(moe_ep2):
    """With the load-balancing and z losses on, they count a shared token once (like
    packing): the first step's forward (log-probs, loss) is still equal, but its gradient
    and the moe/aux_loss and moe/z_loss metrics differ. This is the documented choice, not
    an exactness claim (docs/prefix-sharing.md)."""
    results, _ = moe_ep2
    (aux,) = [r for r in results if r["spec"] == MOE_AUX]
    assert aux["logprob_rel"] < TOL and aux["first_loss_rel"] < TOL, aux
    assert aux["first_grad_norm_rel"] > 1e-5, aux
    assert aux["moe_rel"]["moe/aux_loss"] > 1e-3 and aux["moe_rel"]["moe/z_loss"] > 1e-3, aux


def test_moe_settings_refused_by_name():
    """MoE families share, with routing replay too (tests/test_prefix_sharing_replay.py); the
    expert-bias update and capacity dropping are refused with sharing on, each naming its key
    (and nothing else is refused)."""
    from engine.config.prefix_sharing_settings import prefix_sharing_problems
    from types import SimpleNamespace as NS

    def cfg(**moe):
        return NS(train=NS(prefix_sharing=True, compile="false"),
                  parallel=NS(cp=1, cp_comm_type="a2a"),
                  model=NS(hf_path="/m", mtp=NS(enabled=False)),
                  moe=NS(**{**dict(routing_replay=None, bias_update_rate=0.0,
                                   capacity_factor=None), **moe}))
    for model_type in ("qwen3_moe", "mixtral", "glm4_moe"):
        assert prefix_sharing_problems(cfg(), {"model_type": model_type}) == []
    for replay in ("R2", "R3"):
        assert prefix_sharing_problems(cfg(routing_replay=replay),
                                       {"model_type": "qwen3_moe"}) == []
    for moe, word in ((dict(bias_update_rate=1e-3), "moe.bias_update_rate"),
                      (dict(capacity_factor=1.5), "moe.capacity_factor")):
        problems = prefix_sharing_problems(cfg(**moe), {"model_type": "qwen3_moe"})
        assert len(problems) == 1 and word in problems[0], problems
