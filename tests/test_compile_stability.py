"""train.compile at the shapes real runs produce (issue 83): packed micro-batches whose
sequence counts and lengths differ at every step compile during the first steps and never
again, at one process and at CP2 (Ulysses), and every objective's metrics.jsonl carries the
compile counts (compile/graphs, compile/recompiles, compile/graph_breaks).

The SFT runs are `engine.sft` as a user runs it (on the session's rank pool) on chats whose
answer lengths follow a log-normal distribution, packed under a token budget
(train.max_tokens_per_micro_batch), 12 steps. The counts come from the run's metrics.jsonl:
after WARMUP steps none of the three may change. Negative control: the same run with packed
rows traced into the compiled core attention (tests/multirank/compile_retrace.py, the
behaviour before issue 83: the host boundaries baked into the graph) keeps compiling after the
warm-up, step after step (CONTROL_STEPS: each later step re-traces, so it runs the warm-up and
three more, not all 12). DPO (2 steps) and GRPO (5 steps), both packed, on the same model: the
counts in every row, GRPO's constant from its first step on. Every run here trains that one
model on packed rows, so the later runs' graphs are those the first run's Inductor compiled:
they come from Inductor's FX graph cache (its C++ kernels compile once per file, not once per
objective: on a cold cache a DPO on another model's padded micro-batches compiled 7 kernels,
88 s of its first step at load 17, against none and 16 s here). Dynamo still traces each run's
graphs, so the counts and the step-1 line are the same with a warm or a cold cache.

The counts are each rank process's since it started (the pool's ranks run other cases too), so
the runs compare their own rows with each other, never with fixed totals; that a run compiled
graphs of its own shows in its run log ("[compile] after step 1: ...", printed when a count
changed during step 1).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.metrics_docs import undocumented

pytestmark = pytest.mark.timeout(900)

KEYS = ("compile/graphs", "compile/recompiles", "compile/graph_breaks")
# rank 0's run-log line when the counts changed during step 1 (engine.training.compile_report)
COMPILED_IN_STEP_1 = "[compile] after step 1: "
STEPS, WARMUP = 12, 3
# the control's steps: its re-traces cost seconds each, and three after the warm-up show them
CONTROL_STEPS = WARMUP + 3
RL_STEPS = 5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> tuple[str, str]:
    """(model dir, train file): a 2-layer Qwen3 (q/k norms, GQA 8:2) and 400 chats whose answer
    lengths are log-normal (2 to 90 words: 1 to ~10 sequences per packed micro-batch). Beside
    the train file: the CPU demo's preference pairs (dpo_train.jsonl) and addition prompts
    (rl_prompts.jsonl), tools.demo's rows."""
    from tools.demo import preference_rows, write_jsonl
    from tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("compile_stability")
    model = build_tiny_model(str(root / "model"), "qwen3", layers=2, vocab_size=200)
    rng = random.Random(0)
    rows = []
    for _ in range(400):
        n = int(min(90, max(2, rng.lognormvariate(2.3, 0.9))))
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        answer = " ".join(rng.choice(WORDS) for _ in range(n))
        rows.append(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}))
    data = root / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    write_jsonl(root / "dpo_train.jsonl", preference_rows(pairs))
    write_jsonl(root / "rl_prompts.jsonl",
                [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a, b in pairs])
    return model, str(data)


def _rows(log_dir) -> list[dict]:
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


def _packed_sft(pools, workload, log_dir, world: int, *extra, script=("-m", "engine.sft"),
                steps: int = STEPS):
    model, data = workload
    proc = pools.script(
        world, *script, f"model.hf_path={model}", f"data.train_files=[{data}]",
        "train.global_batch_size=8", "train.max_tokens_per_micro_batch=192",
        "train.packing=true", "train.seq_length=128", f"train.max_steps={steps}",
        "train.compile=true", "optim.lr=1e-3", "logging.progress_bar=false",
        f"logging.dir={log_dir}", *extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(log_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows, proc.stdout


def _counts(rows) -> list[tuple]:
    return [tuple(r[k] for k in KEYS) for r in rows]


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_steps_stop_compiling_after_warmup(pools, workload, tmp_path, cp):
    rows, stdout = _packed_sft(pools, workload, tmp_path, cp, f"parallel.cp={cp}")
    for r in rows:
        assert all(k in r for k in KEYS), r
    assert undocumented({k for r in rows for k in r}) == []
    # the packings really differ: the steps after the warm-up hold different token counts
    assert len({r["num_tokens"] for r in rows[WARMUP:]}) >= 6, [r["num_tokens"] for r in rows]
    assert COMPILED_IN_STEP_1 in stdout, stdout[-2000:]   # this run compiled its graphs
    counts = _counts(rows)
    assert counts[WARMUP - 1:] == [counts[-1]] * (STEPS - WARMUP + 1), counts


def test_negative_control_traced_packed_rows_recompile_every_step(pools, workload, tmp_path):
    """Packed rows inside the compiled attention: new graphs and recompiles after the warm-up,
    at two or more of the three later steps (the check above would fail)."""
    rows, _ = _packed_sft(pools, workload, tmp_path, 1,
                          script=("tests/multirank/compile_retrace.py",), steps=CONTROL_STEPS)
    counts = _counts(rows)
    grew = [s + 1 for s in range(WARMUP, CONTROL_STEPS) if counts[s][0] > counts[s - 1][0]]
    assert len(grew) >= 2, counts   # new graphs at most of the later steps
    assert counts[-1][1] > counts[WARMUP - 1][1], counts   # and they are recompiles


def test_dpo_and_grpo_log_the_compile_counts(pools, workload, tmp_path):
    """DPO (2 steps, packed pairs, the reference log-probs without grad) and GRPO (RL_STEPS
    steps, packed, two policy updates per step, the log-prob forward without grad) on the
    workload's model: compile/* in every row; GRPO's counts constant after its first step
    (where both grad modes compiled)."""
    model, data = workload
    root = Path(data).parent
    common = ("train.compile=true", "optim.lr=1e-3", "logging.progress_bar=false",
              "train.seq_length=64", "train.packing=true", f"model.hf_path={model}")
    dpo = pools.script(1, "-m", "engine.dpo", f"data.train_files=[{root / 'dpo_train.jsonl'}]",
                       "train.max_steps=2", "train.global_batch_size=4",
                       "train.micro_batch_size=2", *common,
                       f"logging.dir={tmp_path / 'dpo'}", timeout=600)
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    rl = pools.script(1, "-m", "engine.rl", f"data.train_files=[{root / 'rl_prompts.jsonl'}]",
                      "rollout.n=2", "rollout.max_new_tokens=8", "rollout.temperature=2.0",
                      "train.prompts_per_step=3", "train.mini_batches_per_step=2",
                      f"train.max_steps={RL_STEPS}", "kl.beta=0",
                      "reward.fn=tests.rl_rewards:digit_reward", *common,
                      f"logging.dir={tmp_path / 'rl'}", timeout=600)
    assert rl.returncode == 0, rl.stderr[-3000:]
    for name, proc, steps in (("dpo", dpo, 2), ("rl", rl, RL_STEPS)):
        assert COMPILED_IN_STEP_1 in proc.stdout, (name, proc.stdout[-2000:])
        rows = _rows(tmp_path / name)
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
        for r in rows:
            assert all(k in r for k in KEYS), (name, r)
        assert rows[0]["compile/graphs"] >= 1, (name, rows)
    counts = _counts(_rows(tmp_path / "rl"))
    assert counts == [counts[0]] * RL_STEPS, counts
