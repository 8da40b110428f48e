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


def _lines(proc, tag: str) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines()
            if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def one_process(pools, qwen3_dir):
    proc = pools.script(1, CHECK, qwen3_dir, "1,1,1,mbs=2+ctl", LORA, timeout=600)
    return _lines(proc, "RESULT"), _lines(proc, "CONTROL")


@pytest.fixture(scope="module")
def two_ranks(pools, qwen3_dir):
    proc = pools.script(2, CHECK, qwen3_dir, *LAYOUTS, UNCHUNKED, timeout=900)
    return _lines(proc, "RESULT")


def _check(result: dict) -> None:
    assert result["logprob_rel"] < TOL, result
    assert result["metric_rel"] < TOL, result
    assert result["ratio_off"] == 1.0, result
    assert result["ratio_on"] < (0.9 if result["objective"] == "dpo" else 0.5), result
    losses = result["losses"]
    assert len(losses) == 3 and len(set(losses)) == 3, result   # the model trains


def test_shared_equals_unshared_at_one_process(one_process):
    results, _ = one_process
    assert sorted((r["spec"], r["objective"]) for r in results) == sorted(
        [("1,1,1,mbs=2+ctl", o) for o in ("dpo", "grpo", "ppo", "sft")]
        + [(LORA, o) for o in ("dpo", "grpo", "sft")])
    for r in results:
        _check(r)


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
    (the short one runs unshared: ratio 1); no timing is asserted."""
    from tools.bench.common import last_json_line

    proc = pools.script(1, "-m", "tools.bench", "prefix_sharing", "--quick", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    work = {k.split("_")[-1]: v for k, v in summary.items() if isinstance(v, dict)
            and k.startswith("prefix_sharing_")}
    assert sorted(work) == ["agent", "dpo", "grpo", "short"]
    for w in work.values():
        assert w["loss_rel"] < 1e-5 and w["grad_norm_rel"] < 1e-5, w
        assert w["logprob_max_abs"] < 1e-4, w
    assert work["grpo"]["ratio"] < 0.3 and work["agent"]["ratio"] < 0.3, work
    assert 0.6 < work["dpo"]["ratio"] < 0.75 and work["short"]["ratio"] == 1.0, work
