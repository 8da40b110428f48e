"""tools/bench/ (`python -m tools.bench`): the fast benchmarks end to end (balance, sync, mfu
skip on CPU) and the pieces of arithmetic the reports rest on, each against an independent
reference."""
from __future__ import annotations

import json
import pytest
import torch

from tools.bench import __main__ as bench
from tools.bench import async_rl as bench_async
from tools.bench import balance as bench_balance
from tools.bench import mfu as bench_mfu
from tools.bench import overhead as bench_overhead
from tools.bench import sync as bench_sync
from tools.bench.common import last_json_line

BENCH = ("-m", "tools.bench")


def _run(*args: str, pools, timeout: int = 300) -> tuple[str, dict]:
    """`python -m tools.bench ARGS` on the session's 1-rank pool (tests/pool.py: no process
    start or imports of its own; the launches a benchmark starts from there get none of the
    rank's launcher variables: tools.bench.common.subprocess_env)."""
    proc = pools.script(1, *BENCH, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, last_json_line(proc.stdout)


def test_balance_quick_meets_goals(pools, tmp_path):
    plot = tmp_path / "balance.png"
    out, result = _run("balance", "--quick", "--plot", str(plot), pools=pools)
    assert "| distribution | DP |" in out  # a readable table precedes the JSON line
    for key in ("balance_max_over_mean", "naive_balance_max_over_mean", "padding_fraction"):
        assert key in result
    assert 1.0 <= result["balance_max_over_mean"] <= 1.02
    assert result["padding_fraction"] < 0.01
    # the baselines are far from balanced on these distributions (the benchmark discriminates)
    assert result["naive_balance_max_over_mean"] > 1.3
    assert result["sorted_rr_max_over_mean"] > result["balance_max_over_mean"] + 0.05
    assert result["padded_padding_fraction"] > 0.3
    assert result["goals"]["balance_max_over_mean"]["met"] is True
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_quick_reports_throughput(pools):
    out, result = _run("sync", "--quick", pools=pools)
    assert "GB/s" in out
    assert result["weight_sync_params"] >= 100_000_000
    assert result["weight_sync_bytes"] == 4 * result["weight_sync_params"]  # fp32, every weight
    assert set(result["weight_sync_per_bucket_gbps"]) == {"32", "128", "512"}
    # the headline is the RL default bucket size (engine.rl.config rollout.sync_bucket_mb)
    from engine.config.rollout_settings import RolloutConfig

    assert bench_sync.DEFAULT_BUCKET_MB == RolloutConfig().sync_bucket_mb
    assert result["weight_sync_gbps"] == result["weight_sync_per_bucket_gbps"]["512"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip path")
def test_mfu_skips_without_cuda(pools):
    out, result = _run("mfu", timeout=120, pools=pools)
    assert "skipped: no CUDA" in out
    assert result["mfu"] is None and result["tflops_per_gpu"] is None


def test_plan_padding_matches_engine_builders():
    """The balance benchmark's padding arithmetic equals what pack_sequences / pad_batch produce
    for the engine's plan (dummy micro-batches: pad_multiple masked tokens each)."""
    from engine.training.batching import pack_sequences, pad_batch
    from engine.training.plan import plan_mini_batch

    lengths = [5, 17, 3, 40, 9, 12, 1, 30, 8, 22, 2]
    sample = lambda n: ([7] * n, [7] * n, [1] * n)
    for packing, pad_multiple, mbs, budget in ((True, 4, 1, 45), (False, 1, 2, None),
                                               (False, 4, 1, 45), (True, 1, 1, 45)):
        plan = plan_mini_batch(lengths, 3, True, mbs, budget)
        expected = 0
        for rank in plan.ranks:
            for mb in rank:
                if not mb:
                    expected += pad_multiple
                elif packing:
                    expected += pack_sequences([sample(lengths[i]) for i in mb],
                                               pad_multiple).num_padding
                else:
                    expected += pad_batch([sample(lengths[i]) for i in mb],
                                          pad_multiple)["num_padding"]
        got = bench_balance.plan_padding(lengths, 3, packing, pad_multiple, mbs, budget)
        assert got == (expected, sum(lengths))


def test_imbalance_lower_bound_by_hand():
    # works L + L^2/4096: 4096 -> 8192, 1024 -> 1280; 2 ranks, mean 4736: bound 8192/4736
    result = bench_balance.imbalances([4096, 1024, 1024, 1024, 1024, 1024, 1024], 2)
    assert result["lower_bound"] == pytest.approx(8192 / ((8192 + 6 * 1280) / 2))
    assert result["balanced"] == pytest.approx(result["lower_bound"])  # optimal: big one alone
    assert result["contiguous"] == pytest.approx((8192 + 3 * 1280) / ((8192 + 6 * 1280) / 2))


def test_train_flops_by_hand():
    cfg = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               head_dim=4, intermediate_size=16, vocab_size=10)
    # per token weights: 2 layers x (8*(8+2*4) + 8*8 + 3*8*16) + 8*10 = 2*576 + 80 = 1232
    # attention: lengths 3 and 2 -> 6 + 3 = 9 causal pairs; 2 layers x 2 x 2 x 8 x 9 = 576
    forward = 2 * 1232 * 5 + 576
    assert bench_mfu.train_flops(cfg, [3, 2]) == 3 * forward


def test_peak_lookup():
    assert bench_mfu.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench_mfu.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_mfu.peak_bf16_tflops("NVIDIA H200") == 989.4
    assert bench_mfu.peak_bf16_tflops("Some Other GPU") is None


def test_count_parameters_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from models.hf.io import read_config
    from tools.tiny_models import build_tiny_model

    d = build_tiny_model(str(tmp_path / "m"), "qwen3", vocab_size=96, hidden=32, layers=2,
                         heads=4, kv_heads=2, intermediate=48, tokenizer=False, head_dim=8)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert bench_sync.count_parameters(read_config(d)) == sum(p.numel()
                                                              for p in model.parameters())


def test_overhead_ratio_of_medians_and_goals():
    raw = {"engine_s": [1.0, 1.2, 5.0], "bare_s": [1.0, 0.9, 1.1], "build_s": [0.01] * 3,
           "engine_loss": 2.0, "bare_loss": 2.0 + 2e-7,
           "layout": "world=4 dp=2 tp=2 pp=1 cp=1", "model": "m", "warmup": 1, "seconds": 9.0}
    summary = bench_overhead.overhead_result(raw, quick=True).summary
    assert summary["overhead_ratio"] == pytest.approx(1.2 / 1.0)  # medians, not means
    assert summary["overhead_paired_ratio"] == pytest.approx(1.2 / 0.9)  # pairs 1, 4/3, 50/11
    assert summary["overhead_loss_rel_diff"] == pytest.approx(1e-7)
    goals = bench.goal_report({"overhead_ratio": 1.2, "padding_fraction": 0.004,
                               "generate_once_speedup": None})
    assert goals["overhead_ratio"]["met"] is False
    assert goals["padding_fraction"]["met"] is True
    assert goals["generate_once_speedup"]["met"] is None
    assert "balance_max_over_mean" not in goals
    json.dumps(goals)


def test_all_keeps_going_when_one_benchmark_fails(monkeypatch):
    from types import SimpleNamespace

    def fake_run_one(name, args):
        if name == "sync":
            raise RuntimeError("boom\ntraceback lines")
        return bench.BenchResult([], {"overhead_ratio": 1.01} if name == "overhead" else {})

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    summary = bench.run_all(SimpleNamespace(quick=True, plot=None)).summary
    assert summary["errors"] == {"sync": "RuntimeError: boom"}
    assert summary["weight_sync_gbps"] is None and summary["overhead_ratio"] == 1.01
    assert summary["goals"]["overhead_ratio"]["met"] is True
    assert summary["goals"]["generate_once_speedup"]["met"] is None  # not run: no verdict
    json.dumps(summary)


def test_data_quick_reports_rates_first_steps_and_memory(pools):
    """`data --quick`: 500 chat rows rendered with 0/1/2 workers,
    two 2-rank SFT launches (empty cache, built cache); the 4-rank one is left to the full
    size."""
    out, result = _run("data", "--quick", timeout=900, pools=pools)
    assert "| workers | rows | seconds | rows/s | M tokens/s |" in out
    assert set(result["data_rows_per_s_by_workers"]) == {"0", "1", "2"}
    assert result["data_rows"] == 500 and result["data_tokens"] > 700_000
    assert result["data_rows_per_s"] == max(result["data_rows_per_s_by_workers"].values()) > 0
    assert 0 < result["first_step_s_cached"] and 0 < result["first_step_s_uncached"]
    assert 100 < result["rss_mb_per_rank"] < 4000 and result["rss_mb_per_rank_4"] is None
    assert set(result["goals"]) == {"first_step_s_uncached", "first_step_s_cached"}


def _async_steps(rows):
    keys = ("time/step_s", "time/generate_s", "time/train_s", "time/rollout_wait_s",
            "time/weight_sync_s", "rollout/idle_s", "rollout/staleness")
    # the last steps send no weights (no remaining batch needs them): the key is absent
    return [{**{k: v for k, v in zip(keys, row) if v is not None},
             "response/length_mean": 90.0, "reward/mean": 0.414} for row in rows]


def test_async_summary_by_hand():
    """Measured metrics (2-core VM, 2026-11-23, 5 steps, 128 new tokens), rounded: step 0 is
    left out; fractions are ratios of sums over steps 1..4."""
    s0 = _async_steps([(1.509, 0.685, 0.844, 0.649, 0.016, 0.0, 0.0),
                       (1.461, 0.632, 0.802, 0.629, 0.029, 0.862, 0.0),
                       (1.397, 0.565, 0.807, 0.568, 0.021, 0.837, 0.0),
                       (1.530, 0.675, 0.848, 0.669, 0.013, 0.831, 0.0),
                       (1.589, 0.667, 0.922, 0.666, None, 0.863, 0.0)])
    s1 = _async_steps([(1.479, 0.638, 0.853, 0.604, 0.022, 0.0, 0.0),
                       (0.826, 0.612, 0.805, 0.001, 0.020, 0.0, 1.0),
                       (0.910, 0.607, 0.895, 0.002, 0.013, 0.265, 1.0),
                       (0.918, 0.661, 0.916, 0.001, None, 0.226, 1.0),
                       (0.867, 0.668, 0.865, 0.002, None, 0.254, 1.0)])
    out = bench_async.async_summary(s0, s1)
    assert out["async_step_s_s0"] == pytest.approx(5.977 / 4)
    assert out["async_step_s_s1"] == pytest.approx(3.521 / 4)
    assert out["async_step_time_ratio"] == pytest.approx(3.521 / 5.977)  # 0.589
    assert out["async_generate_s_s0"] == pytest.approx(2.539 / 4)
    assert out["async_train_s_s0"] == pytest.approx(3.379 / 4)
    assert out["async_ideal_ratio"] == pytest.approx(3.379 / 5.977)  # max(gen, train) / step
    assert out["async_trainer_idle_fraction_s0"] == pytest.approx(2.532 / 5.977)
    assert out["async_trainer_idle_fraction_s1"] == pytest.approx(0.006 / 3.521)
    assert out["async_weight_sync_fraction_s0"] == pytest.approx(0.063 / 5.977)
    assert out["async_weight_sync_fraction_s1"] == pytest.approx(0.033 / 3.521)
    assert out["async_rollout_idle_fraction_s0"] == pytest.approx(3.393 / (2.539 + 3.393))
    assert out["async_rollout_idle_fraction_s1"] == pytest.approx(0.745 / (2.548 + 0.745))
    assert bench.goal_report(out)["async_step_time_ratio"]["met"] is True  # <= 0.6
    bench_async.check_runs(s0, s1)
    with pytest.raises(RuntimeError, match="rollout/staleness"):
        bench_async.check_runs(s0, s0)  # "s=1" that never lagged
    with pytest.raises(RuntimeError, match="step 0 reward/mean differs"):
        bench_async.check_runs(s0, [{**s1[0], "reward/mean": 0.5}] + s1[1:])
    with pytest.raises(ValueError, match="nothing left"):
        bench_async.run_stats(s0[:1])
    json.dumps(out)


def test_partial_quick_counts_steps_fill_and_staleness():
    """`tools.bench partial --quick` on hf: the three modes train the same 48 groups; off decodes
    8 engine steps per group (each batch of 8 groups runs to its 64-token reply), rounds fewer,
    the driver fewest; partial modes restart nothing (3ee2763's rule) and span versions;
    a --set key other than rollout.partial_* is refused by name."""
    from tools.bench.partial import run_partial
    s = run_partial(True, "hf").summary
    assert [s[f"partial_{m}_groups"] for m in ("off", "rounds", "on")] == [48.0] * 3
    assert s["partial_off_engine_steps_per_completed_group"] == 8.0
    assert s["partial_on_engine_steps_per_completed_group"] < \
        s["partial_rounds_engine_steps_per_completed_group"] < 8.0
    assert s["partial_rounds_restarts"] == s["partial_on_restarts"] == 0
    assert s["partial_off_partial_share"] == 0 < s["partial_on_partial_share"]
    assert s["partial_off_engine_fill"] < s["partial_rounds_engine_fill"]
    with pytest.raises(ValueError, match="rollout.partial_driver"):
        run_partial(True, "hf", ("rollout.partial_driver=true",))


def test_partial_vllm_engine_takes_the_gpu_settings_on_a_cuda_host(monkeypatch):
    """tools.bench partial --backend vllm: bf16 and engine_args' GPU settings (not eager, no
    spawned CPU worker) when CUDA is there; float32 and the CPU settings without (this host)."""
    from tools.bench.partial import vllm_engine_settings
    dtype, cpu = vllm_engine_settings(96)
    assert dtype == torch.float32 and cpu["enforce_eager"] is True
    assert cpu["distributed_executor_backend"] == "mp"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dtype, gpu = vllm_engine_settings(96)
    assert dtype == torch.bfloat16 and gpu["enforce_eager"] is False
    assert "distributed_executor_backend" not in gpu and gpu["max_model_len"] == 96


def test_rewards_quick_scores_equal_and_reports_every_number():
    """`tools.bench rewards --quick`: the pool's scores equal serial scoring for math_verify
    and code, and the overlapped GRPO rollout's rewards equal scoring after generation (the
    benchmark raises otherwise); every summary number is there and positive."""
    import os   # the CPUs this process may use: the pool's default size
    from tools.bench.rewards import run_rewards
    s = run_rewards(True).summary
    for key in ("rewards_math_verify_speedup", "rewards_code_speedup",
                "rewards_overlap_wait_ratio", "rewards_after_wait_s", "rewards_pool_startup_s"):
        assert s[key] > 0, key
    assert s["rewards_workers"] == float(len(os.sched_getaffinity(0)))


def test_prefix_sharing_goal_is_judged_against_the_spread():
    """tools.bench prefix_sharing: met when every repeat's speed-up reaches the goal, missed
    when none does, undecided (None) when the goal lies within the spread."""
    from tools.bench.prefix_sharing import judge

    assert judge([3.1, 3.4], 3.0) is True and judge([3.0], 3.0) is True
    assert judge([2.5, 2.9], 3.0) is False
    assert judge([0.68, 1.02], 0.97) is None and judge([2.9, 3.0, 3.2], 3.0) is None


def test_trl_quick_runs_both_sides_with_their_stages(pools):
    """`trl --quick --workloads grpo_shared,dpo`: TRL's GRPOTrainer and DPOTrainer and the
    engine's defaults each ran their 2 steps in a process of their own; the tables have both
    rows and the stage columns, every stage of the timed step is positive."""
    out, result = _run("trl", "--quick", "--workloads", "grpo_shared,dpo", timeout=1200,
                       pools=pools)
    for workload, trainer in (("grpo_shared", "GRPOTrainer"), ("dpo", "DPOTrainer")):
        table = out.split(f"### {workload}: TRL {trainer} vs the engine")[1].split("###")[0]
        assert [line.split("|")[1].strip() for line in table.splitlines()
                if line.startswith("| ") and "row" not in line] == [f"TRL {trainer}",
                                                                    "engine, defaults"]
        for side in ("trl", "engine"):
            assert result[f"trl_{workload}_{side}_step_s"] > 0
            assert result[f"trl_{workload}_{side}_logprob_s"] > 0
            assert result[f"trl_{workload}_{side}_update_s"] > 0
    for side in ("trl", "engine"):
        assert result[f"trl_grpo_shared_{side}_generation_s"] > 0
    assert result["trl_grpo_shared_speedup"] == pytest.approx(
        result["trl_grpo_shared_trl_step_s"] / result["trl_grpo_shared_engine_step_s"])
    assert "errors" not in result and result["trl_quick"] is True


def test_generate_vs_hf_quick_greedy_equal_and_timed(pools):
    """`generate_vs_hf --quick`: greedy tokens of the engine's generate and step driver equal
    transformers' (the run raises otherwise) on both prompt sets; every path timed."""
    out, result = _run("generate_vs_hf", "--quick", "--threads", "1", pools=pools)
    assert "Generation: the hf backend against transformers' generate" in out
    for name in ("shared", "distinct"):
        for path in ("transformers", "engine_generate", "engine_batch_prefill",
                     "engine_copied_kv_heads", "step_driver"):
            assert result[f"generate_{name}_{path}_s"] > 0
    assert result["generate_shared_prompt_tokens"] > 2 * result["generate_distinct_prompt_tokens"]


def test_unread_positions_quick_equal_numbers_and_skipped_rows(pools):
    """tools.bench unread_positions --quick: each workload's loss and grad norm equal with the
    skip on and off (the same weights), the share of skipped MLP rows is the untrained share of
    its rows (the prompts), and both modes were timed (no speed asserted: a loaded host)."""
    out, result = _run("unread_positions", "--quick", pools=pools)
    assert "| workload      | rows |" in out
    shares = {name: result[f"unread_{name}"]["skipped_share"]
              for name in ("grpo_shared", "grpo_distinct", "sft", "dpo", "grpo_tree")}
    assert shares["grpo_shared"] > shares["grpo_distinct"] > shares["sft"] > 0.4, shares
    # the tree runs each prompt once: a smaller share of its rows is prompt
    assert 0.2 < shares["grpo_tree"] < shares["grpo_shared"] - 0.3, shares
    for name in shares:
        r = result[f"unread_{name}"]
        assert r["loss_rel"] < 1e-6 and r["grad_norm_rel"] < 1e-5, (name, r)
        assert r["on_s"] > 0 and r["off_s"] > 0 and len(r["speedup_quartiles"]) == 2
