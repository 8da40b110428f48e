"""`python -m tools.bench trl` (tools/bench/trl*.py) and its GPU checklist item on the CPU,
without running a trainer: the rows each call plans, the engine's command (the workload's sizes,
the engine's defaults left alone), the per-stage arithmetic of both sides (TRL's method timers,
the engine's time/* metrics), the table (medians of steps 2..N, min-max, speedups, a failed
row), and the gpu item's command, requirement and report. The quick end-to-end run is in
tests/test_bench.py (second tier)."""
from __future__ import annotations

import json

import pytest

from tools.bench import trl, trl_engine, trl_side
from tools.bench.gpu.items import ITEMS, ORDER, build_items
from tools.bench.gpu.plan import missing_reason
from tools.bench.gpu.report import key_numbers, read_metrics


def test_rows_planned_per_workload():
    full = trl.plan_rows(list(trl.WORKLOADS), quick=False, with_vllm=False)
    assert [(r.workload, r.key) for r in full] == [
        ("grpo_shared", "trl"), ("grpo_shared", "engine"), ("grpo_shared", "engine_prefix_on"),
        ("grpo_shared", "engine_prefix_off"), ("grpo_distinct", "trl"),
        ("grpo_distinct", "engine"), ("sft", "trl"), ("sft", "engine"), ("dpo", "trl"),
        ("dpo", "engine")]
    assert [r.args for r in full if r.side == "engine" and r.args] == [
        ("train.prefix_sharing=true",), ("train.prefix_sharing=false",)]
    quick = trl.plan_rows(["grpo_shared", "sft"], quick=True, with_vllm=False)
    assert [(r.workload, r.side) for r in quick] == [("grpo_shared", "trl"),
                                                     ("grpo_shared", "engine"),
                                                     ("sft", "trl"), ("sft", "engine")]
    gpu = trl.plan_rows(["grpo_distinct", "dpo"], quick=False, with_vllm=True)
    assert [r.key for r in gpu] == ["trl", "trl_vllm", "engine", "engine_vllm", "trl", "engine"]
    assert gpu[1].args == ("--vllm",) and gpu[3].args == ("rollout.backend=vllm",)
    with pytest.raises(ValueError, match=r"\['kto'\] unknown; valid: grpo_shared"):
        trl.plan_rows(["sft", "kto"], quick=True, with_vllm=False)


def test_engine_command_sets_the_workload_and_leaves_the_defaults():
    cmd = trl_engine.engine_command("grpo_shared", "/m", "/d.jsonl", 5, "/log",
                                    ("train.prefix_sharing=true",))
    assert cmd[1:3] == ["-m", "engine.rl"] and cmd[-1] == "train.prefix_sharing=true"
    for setting in ("rollout.n=8", "train.prompts_per_step=2", "rollout.max_new_tokens=32",
                    "rollout.temperature=1.0", "kl.beta=0.01", "optim.lr=1e-5",
                    "train.max_steps=5", "data.train_files=[/d.jsonl]"):
        assert setting in cmd
    defaults = trl_engine.engine_command("grpo_distinct", "/m", "/d", 5, "/log")
    # the point of the comparison: the engine's own batching defaults, nothing tuned
    assert not [a for a in defaults if a.startswith(("train.micro_batch_size",
                                                     "train.max_tokens_per_micro_batch",
                                                     "train.prefix_sharing", "rollout.hf."))]
    assert trl_engine.engine_command("dpo", "/m", "/d", 3, "/log")[1:3] == ["-m", "engine.dpo"]
    assert "train.global_batch_size=8" in trl_engine.engine_command("sft", "/m", "/d", 3, "/l")
    with pytest.raises(ValueError, match="workload 'ppo' unknown"):
        trl_engine.engine_command("ppo", "/m", "/d", 3, "/log")


def test_engine_stages_from_its_time_metrics():
    grpo = trl_engine.engine_records("grpo_shared", [
        {"time/step_s": 5.0, "time/rollout_s": 1.5, "time/train_s": 3.4,
         "time/logprob_s": 1.0}])
    assert grpo == [{"step_s": 5.0, "generation_s": 1.5, "logprob_s": 1.0,
                     "update_s": pytest.approx(2.4)}]
    dpo = trl_engine.engine_records("dpo", [{"time/step_s": 2.0, "time/reference_s": 0.5}])
    assert dpo == [{"step_s": 2.0, "logprob_s": 0.5, "update_s": 1.5}]
    assert trl_engine.engine_records("sft", [{"time/step_s": 1.0}]) == [{"step_s": 1.0}]
    text = "[rl] old log-probs: from the training forward\n[rl] grpo: 64 prompts\nnoise"
    assert trl_engine.header_lines(text) == ["[rl] old log-probs: from the training forward"]


def test_trl_stage_timers_nest_as_the_engine_stages():
    """TimedGRPO's wrappers on a fake trainer: the log-prob passes count only inside
    _generate_and_score_completions (the update's forward is the update's); generation is the
    rollout minus them; update = step - rollout."""
    import time as clock

    calls = []

    class Fake:
        def _generate(self, prompts):
            calls.append("generate")

        def _get_per_token_logps_and_entropies(self, model):
            calls.append(model)
            clock.sleep(0.01)

        def _generate_and_score_completions(self, batch):
            self._generate(batch)
            self._get_per_token_logps_and_entropies("ref")
            return batch

    times, fake = trl_side.StageTimes(), Fake()
    trl_side.instrument_grpo(fake, times)
    fake._generate_and_score_completions([1])
    fake._get_per_token_logps_and_entropies("policy")   # the update's forward: not counted
    c = times.current
    assert calls == ["generate", "ref", "policy"]
    assert c["logprob_s"] >= 0.01 and c["rollout_s"] >= c["logprob_s"] + c["generate_s"]
    assert c["logprob_s"] < 0.02 + (c["rollout_s"] - 0.01)   # one sleep counted, not two
    record = times.close(1.0)
    assert record["generation_s"] == pytest.approx(c["rollout_s"] - c["logprob_s"])
    assert record["update_s"] == pytest.approx(1.0 - c["rollout_s"])
    assert times.current == {} and times.steps == [record]
    times.add("reference_s", 0.25)   # DPO: the reference model's forward
    assert times.close(1.0) == {"step_s": 1.0, "logprob_s": 0.25, "update_s": 0.75}
    assert times.close(0.5) == {"step_s": 0.5}   # SFT


def _run(steps: list[dict], load=(1.0, 2.0)) -> trl.RunResult:
    return trl.RunResult(records=steps, load=load)


def test_table_medians_spread_speedups_and_a_failed_row():
    """Medians over steps 2..N (step 1, warm-up, left out), min-max, speedup = TRL / row;
    a failed row is shown and keeps the others; the goal keys of issue 102."""
    g = lambda s, gen, lp: {"step_s": s, "generation_s": gen, "logprob_s": lp,
                            "update_s": s - gen - lp}
    rows = trl.plan_rows(["grpo_shared"], quick=False, with_vllm=False)
    results = {"trl": _run([g(50.0, 1, 1), g(4.0, 1.0, 0.8), g(5.0, 1.2, 0.8),
                            g(4.6, 1.1, 0.8)]),
               "engine": _run([g(60.0, 1, 1), g(2.0, 0.5, 0.2), g(1.8, 0.4, 0.2),
                               g(1.9, 0.5, 0.2)]),
               "engine_prefix_on": _run([g(9.0, 1, 1), g(1.0, 0.5, 0.1), g(1.0, 0.5, 0.1),
                                         g(1.0, 0.5, 0.1)]),
               "engine_prefix_off": "RuntimeError: boom"}
    table, s = trl.workload_table("grpo_shared", rows, results, 2)
    assert s["trl_grpo_shared_trl_step_s"] == 4.6 and s["trl_grpo_shared_engine_step_s"] == 1.9
    assert s["trl_grpo_shared_engine_step_range_s"] == [1.8, 2.0]
    assert s["trl_grpo_shared_speedup"] == s["trl_grpo_shared_engine_speedup"] == \
        pytest.approx(4.6 / 1.9)
    assert s["trl_grpo_shared_engine_prefix_on_speedup"] == pytest.approx(4.6)
    assert s["trl_grpo_shared_engine_generation_s"] == 0.5
    assert "trl_grpo_shared_prefix_off_speedup" not in s   # it failed
    by_label = {r[0]: r for r in table.rows}
    assert by_label["engine, defaults"][1:4] == ["1.90", "1.80-2.00", "x2.42"]
    assert by_label["engine, defaults"][4] == "0.50 (x2.20)"   # generation: 1.1 / 0.5
    assert by_label["engine, train.prefix_sharing=false"][1] == "failed: RuntimeError: boom"
    assert table.headers == ["row", "step s", "step min-max", "speedup", "generation s",
                             "log-prob stage s", "update s", "load"]
    from tools.bench.__main__ import goal_report   # the goals are checked by name

    goals = goal_report({**s, "trl_sft_speedup": 0.9})
    assert goals["trl_grpo_shared_speedup"]["goal"] == ">= 2.5"
    assert goals["trl_grpo_shared_speedup"]["met"] is False   # 2.42
    assert goals["trl_sft_speedup"]["met"] is False
    with pytest.raises(ValueError, match="nothing left after the warm-up step"):
        trl.spread([{"step_s": 1.0}], "step_s")
    _, no_base = trl.workload_table("sft", trl.plan_rows(["sft"], True, False),
                                    {"trl": "RuntimeError: x",
                                     "engine": _run([{"step_s": 2.0}, {"step_s": 1.0}])}, 2)
    assert no_base["trl_sft_engine_speedup"] is None


def test_gpu_item_trl_command_needs_and_report(tmp_path):
    """`--items trl`: not in the default plan; prep bench-json of `tools.bench trl` (--quick
    for the CPU smoke); skipped by name without trl; its summary read into speedups."""
    assert "trl" in ITEMS and "trl" not in ORDER
    (item,) = build_items(["trl"], tmp_path, smoke=False)
    assert item.commands[-1][-3:] == ["bench-json", str(tmp_path / "trl.json"), "trl"]
    assert "cuda" in item.needs and "trl" in item.needs and item.estimate_s == 540
    (smoke,) = build_items(["trl"], tmp_path, smoke=True)
    assert smoke.commands[-1][-1] == "--quick" and "cuda" not in smoke.needs
    assert missing_reason(item.needs, {"cuda", "megatron", "hydra", "transformers"}) == \
        "trl not installed (the test extra's trl>=1.16,<1.17)"
    item.result.write_text(json.dumps({
        "trl_steps": 5, "trl_vllm_rows": True, "trl_grpo_shared_speedup": 2.6,
        "trl_grpo_shared_trl_speedup": 1.0, "trl_grpo_shared_engine_speedup": 2.6,
        "trl_grpo_shared_engine_prefix_off_speedup": 1.2,
        "trl_grpo_shared_prefix_off_speedup": 1.2, "trl_sft_trl_speedup": 1.0,
        "trl_sft_engine_speedup": None, "errors": {"sft/engine": "RuntimeError: x"}}))
    metrics = read_metrics(item)
    assert metrics["trl"] == {"grpo_shared": {"trl": 1.0, "engine": 2.6,
                                              "engine_prefix_off": 1.2},
                              "sft": {"trl": 1.0, "engine": None}}
    assert metrics["problems"] == ["trl sft: no engine-defaults speedup",
                                   "trl sft/engine: RuntimeError: x"]
    assert key_numbers({"metrics": metrics}) == \
        "grpo_shared x2.60 (engine_prefix_off x1.20); sft n/a"


def test_rounds_pool_their_steps_and_show_each_rounds_speedup():
    """--rounds: a row's steps 2..N of every round pooled into one median; each round's
    speedup (TRL's median in that round / the row's) in its own column and summary key; a
    slow spell in one round moves that round's speedup, not the pooled one's ranking."""
    s = lambda *steps: [{"step_s": x} for x in steps]
    trl_runs = trl.RunResult(records=s(9.0, 4.0, 4.0), load=(1.0, 1.5))
    trl_runs.add_round(trl.RunResult(records=s(9.0, 8.0, 8.0), load=(1.5, 3.0)))  # slow spell
    engine = trl.RunResult(records=s(9.0, 2.0, 2.0), load=(1.0, 1.2))
    engine.add_round(trl.RunResult(records=s(9.0, 4.0, 4.0), load=(1.2, 2.5)))
    assert trl_runs.runs() == [s(9.0, 4.0, 4.0), s(9.0, 8.0, 8.0)]
    assert trl_runs.load == (1.0, 3.0)
    assert trl.pooled(trl_runs, "step_s") == (6.0, 4.0, 8.0)
    assert trl.round_speedups(trl_runs, engine) == [2.0, 2.0]
    table, summary = trl.workload_table(
        "sft", trl.plan_rows(["sft"], True, False), {"trl": trl_runs, "engine": engine}, 2)
    assert summary["trl_sft_engine_step_s"] == 3.0
    assert summary["trl_sft_speedup"] == 2.0
    assert summary["trl_sft_engine_round_speedups"] == [2.0, 2.0]
    assert table.headers == ["row", "step s", "step min-max", "speedup", "speedup per round",
                             "load"]
    assert table.rows[1][:5] == ["engine, defaults", "3.00", "2.00-4.00", "x2.00",
                                 "x2.00-2.00"]
    assert "2 runs per row, interleaved" in table.notes[0]
    # one round only: no per-round column (the table as before)
    single, _ = trl.workload_table("sft", trl.plan_rows(["sft"], True, False),
                                   {"trl": trl.RunResult(records=s(9.0, 4.0)),
                                    "engine": trl.RunResult(records=s(9.0, 2.0))}, 2)
    assert single.headers == ["row", "step s", "step min-max", "speedup", "load"]
    with pytest.raises(ValueError, match="--rounds 0"):
        trl.run_trl(quick=True, rounds=0)


def test_each_round_writes_its_own_log(monkeypatch, tmp_path):
    """A row's rounds must not share a log folder: the engine appends to metrics.jsonl, so a
    second round there would read the first round's steps too (caught by the step count)."""
    seen = []
    monkeypatch.setattr(trl, "run_launch", lambda cmd, *a, **kw: seen.append(cmd) or ("", ""))
    monkeypatch.setattr(trl, "read_metrics", lambda out: [{"time/step_s": 1.0}] * 2)
    monkeypatch.setattr(trl, "engine_records", lambda w, m: [{"step_s": 1.0}] * len(m))
    row = trl.Row("sft", "engine", "engine, defaults", "engine")
    files = {"model": "M", "sft": "D"}
    for k in (0, 1):
        trl.run_row(row, files, 2, 2, str(tmp_path), 60, k)
    dirs = [next(a for a in cmd if a.startswith("logging.dir=")) for cmd in seen]
    assert len(set(dirs)) == 2, dirs
