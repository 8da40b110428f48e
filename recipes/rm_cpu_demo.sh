#!/usr/bin/env bash
# CPU demo of RLHF's three stages (docs/preference.md "CPU demo of the loop"): SFT, a reward
# model trained on preference pairs, then GRPO against that reward model (no reward function).
#
#   bash recipes/rm_cpu_demo.sh            # WORK=runs/rm_cpu_demo by default
#
# 1. a tiny random Qwen3-shaped model and single-digit addition rows (megatron-sft-engine demo;
#    nothing is downloaded): every prompt answered both "c" and "the answer is c";
# 2. SFT, 80 steps, converted to HF ($WORK/sft_hf): the policy answers in both formats;
# 3. a reward model from the SFT'd model (a new score row), on 80 pairs preferring "the answer
#    is c" to "c"; eval/accuracy is its preference accuracy on 20 pairs of prompts it never
#    trains on; exported as a Qwen3ForSequenceClassification ($WORK/rm_hf);
# 4. GRPO of the SFT'd policy with reward.model.path=$WORK/rm_hf and no reward.fn: every
#    response's reward is the reward model's score of its token ids (reward/model_mean);
# 5. greedy answers before and after GRPO: the share in the preferred format, and their accuracy
#    under the math reward the run never used (the RM scores the format, not the sum).
# Measured on 2 CPU cores (2026-11-28, the model's heads of 32 dims; wall time: docs/benchmarks.md):
# the RM's held-out accuracy 1.00 from its first evaluation (step 10), held-out margin 2.64 ->
# 6.90 (steps 10 -> 60); GRPO's reward/model_mean 0.87 -> 3.40 (means of the first and last 20
# steps 2.70 -> 3.37); greedy answers in the preferred format 1.00 -> 1.00, greedy sums right
# 0.09 -> 0.02. More in docs/preference.md ("CPU demo of the loop").
WORK=${WORK:-runs/rm_cpu_demo}
SFT_STEPS=${SFT_STEPS:-80}
RM_STEPS=${RM_STEPS:-60}
RL_STEPS=${RL_STEPS:-100}
source "$(dirname "$0")/rl_demo_common.sh"   # cd to the repo root, environment, empty $WORK

demo_tiny_model "$WORK/init" 64 2 128 0
megatron-sft-engine demo rm-data "$WORK"
cp "$WORK/rm_sft.jsonl" "$WORK/sft.jsonl"     # demo_sft trains on $WORK/sft.jsonl

echo "== SFT warm-up ($SFT_STEPS steps)"
demo_sft "$WORK/init" "$SFT_STEPS" sft_hf

echo "== reward model ($RM_STEPS steps, 2 ranks)"
megatron-sft-engine rm --nproc-per-node 2 model.hf_path="$WORK/sft_hf" \
  data.train_files="[$WORK/rm_train.jsonl]" data.eval_files="[$WORK/rm_eval.jsonl]" \
  train.global_batch_size=16 train.micro_batch_size=8 train.seq_length=32 \
  train.max_steps="$RM_STEPS" train.eval_interval=10 rm.center_rewards_coefficient=0.01 \
  optim.lr="${RM_LR:-1e-3}" optim.schedule=constant optim.warmup_steps=0 \
  logging.dir="$WORK/rm_logs" logging.progress_bar=false checkpoint.dir="$WORK/rm_ckpt"
demo_export "$WORK/rm_ckpt" rm_hf
python - "$WORK/rm_logs/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("held-out preference accuracy / margin (eval/accuracy, eval/margin) by step: "
      + ", ".join(f"{r['step']}: {r['eval/accuracy']:.2f} / {r['eval/margin']:.2f}"
                  for r in rows if "eval/accuracy" in r))
PY

echo "== GRPO against the reward model ($RL_STEPS steps)"
megatron-sft-engine rl algorithm=grpo model.hf_path="$WORK/sft_hf" \
  data.train_files="[$WORK/rl.jsonl]" reward.model.path="$WORK/rm_hf" \
  rollout.n=8 rollout.temperature=1.0 rollout.max_new_tokens=8 train.seq_length=32 \
  train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
  train.max_steps="$RL_STEPS" optim.lr="${RL_LR:-2e-4}" optim.schedule=constant \
  optim.clip_grad=1.0 kl.beta="${KL:-0.05}" logging.dir="$WORK/rl_logs" \
  logging.progress_bar=false checkpoint.dir="$WORK/rl_ckpt"
demo_first_last "$WORK/rl_logs/metrics.jsonl" reward/model_mean auto
echo "== the policy before and after (greedy), scored by the math reward the run never used"
demo_export "$WORK/rl_ckpt" rl_hf
megatron-sft-engine demo evaluate --data "$WORK/rl.jsonl" --model "before-GRPO=$WORK/sft_hf" \
  --model "after-GRPO=$WORK/rl_hf" --limit 100 --max-new-tokens 8 --show 100 \
  | tee "$WORK/greedy.txt" | tail -2
python - "$WORK/greedy.txt" <<'PY'
import sys
lines = [l for l in open(sys.argv[1]) if "->" in l]
for name in ("before-GRPO", "after-GRPO"):
    mine = [l for l in lines if f"[{name}]" in l]
    share = sum("the answer is" in l for l in mine) / max(len(mine), 1)
    print(f"{name}: greedy answers in the preferred format 'the answer is c': {share:.2f}")
PY
