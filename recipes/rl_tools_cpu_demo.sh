#!/usr/bin/env bash
# CPU demo of multi-turn RL with tools: a tiny model learns to use a calculator tool.
#
#   bash recipes/rl_tools_cpu_demo.sh          # WORK=runs/rl_tools_cpu_demo by default
#
# 1. builds a tiny random Qwen3-shaped model with a character-level tokenizer whose chat template
#    renders tools and <tool_call> blocks the Qwen way (no download), and multiplication data
#    "What is 37*48?" (two-digit operands: the model cannot compute them, the tool can);
# 2. briefly SFTs it (megatron-sft-engine sft) on tool-use conversations: user question ->
#    assistant <tool_call>{"name": "calculate", "arguments": {"expression": "37*48"}}</tool_call>
#    -> tool result -> assistant answer "1776"; converts the checkpoint to HF;
# 3. trains GRPO with the built-in tool environment (env.fn=tools, the calculator of
#    engine/rl/env/example_tools.py executed in tool worker processes, reward.fn=math on the
#    final answer), every episode written to $WORK/rl_logs/rollouts/step_<k>.jsonl; saves the
#    trained policy (checkpoint.dir=$WORK/rl_ckpt);
# 4. converts it to HF and asks the SFT model and the trained policy 100 of the prompts greedily
#    in transformers, running the calculator between turns (megatron-sft-engine demo evaluate).
# Prints the reward curve, env metrics and the means of its first and last 12 steps, an episode
# of the last step, three greedy answers of each model and the greedy accuracy before and after
# GRPO. Measured on 2 CPU cores (2026-11-28, the model's heads of 32 dims): reward/mean 0.499
# (mean of the first 12 steps) -> 0.762 (last 12), 2 turns per episode; greedy accuracy 0.63 (the
# SFT model) -> 0.86 (after GRPO) on 100 prompts; wall time: docs/benchmarks.md. Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/rl_tools_cpu_demo}
SFT_STEPS=${SFT_STEPS:-300}
RL_STEPS=${RL_STEPS:-60}
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
rm -rf "$WORK" && mkdir -p "$WORK"

megatron-sft-engine demo tools-data "$WORK"   # model, tokenizer and data (tools/demo.py)

echo "== SFT on tool-use conversations ($SFT_STEPS steps)"
megatron-sft-engine sft model.hf_path="$WORK/init" data.train_files="[$WORK/sft.jsonl]" \
  train.global_batch_size=32 train.micro_batch_size=32 train.seq_length=160 \
  train.max_steps="$SFT_STEPS" optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 \
  logging.dir="$WORK/sft_logs" logging.progress_bar=false checkpoint.dir="$WORK/sft_ckpt"
megatron-sft-engine convert mcore-to-hf --ckpt "$WORK/sft_ckpt" --out "$WORK/sft_hf"

echo "== GRPO with the calculator tool ($RL_STEPS steps)"
megatron-sft-engine rl algorithm=grpo model.hf_path="$WORK/sft_hf" \
  data.train_files="[$WORK/rl.jsonl]" reward.fn=math \
  env.fn=tools "env.tools=[engine.rl.env.example_tools:calculate]" env.max_turns=3 \
  env.num_workers=4 env.step_timeout_s=30 \
  rollout.n=8 rollout.max_new_tokens=80 rollout.temperature=1.0 \
  train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
  train.seq_length=224 train.max_steps="$RL_STEPS" \
  optim.lr=5e-4 optim.schedule=constant optim.clip_grad=1.0 kl.beta=0.0 \
  logging.dir="$WORK/rl_logs" logging.rollout_dir="$WORK/rl_logs/rollouts" \
  logging.progress_bar=false checkpoint.dir="$WORK/rl_ckpt"

python - "$WORK/rl_logs" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
curve = " ".join(f"{r['reward/mean']:.2f}" for r in rows)
k = max(1, len(rows) // 5)
first = sum(r["reward/mean"] for r in rows[:k]) / k
last = sum(r["reward/mean"] for r in rows[-k:]) / k
print(f"reward/mean per step: {curve}")
for key in ("env/turns_mean", "env/tool_calls", "env/tool_errors", "env/errors"):
    print(f"{key}: first {rows[0][key]:.2f}, last {rows[-1][key]:.2f}")
print(f"first reward {rows[0]['reward/mean']:.3f}, last reward {rows[-1]['reward/mean']:.3f}; "
      f"mean of first {k} steps {first:.3f}, of last {k} steps {last:.3f}")
episode = json.loads(open(f"{sys.argv[1]}/rollouts/step_{len(rows)}.jsonl").readline())
print("an episode of the last step:", repr(episode["text"]))
EOF

echo "== the trained policy, in transformers (greedy, the calculator run between turns)"
megatron-sft-engine convert mcore-to-hf --ckpt "$WORK/rl_ckpt" --out "$WORK/rl_hf"
megatron-sft-engine demo evaluate --data "$WORK/rl.jsonl" --tools --limit 100 \
  --max-new-tokens 80 --model "before-GRPO=$WORK/sft_hf" --model "after-GRPO=$WORK/rl_hf"
