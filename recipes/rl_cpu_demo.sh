#!/usr/bin/env bash
# CPU demo of the RL loop: a tiny Qwen3-shaped model learns single-digit addition.
#
#   bash recipes/rl_cpu_demo.sh            # WORK=/tmp/rl_cpu_demo by default
#
# 1. builds a tiny random model (tests/tiny_models.py) and addition data locally (no download);
# 2. briefly SFTs it (python -m engine.sft, 80 steps) on "what is a plus b ?" -> "a+b" chats: it
#    learns the answer format but is right only ~25% of the time; converts the checkpoint to HF;
# 3. trains GRPO (python -m engine.rl, 300 steps, the built-in math reward) on the same prompts:
#    reward/mean rises from ~0.25 to ~0.7 (averages of the first and last 60 steps, a fifth
#    of the run each).
# Prints the reward curve and the first/last rewards. About 2-3 minutes on 2 CPU cores; not run
# in CI. Adam's first steps move every weight by ~lr, so RL needs a far smaller lr than SFT here.
WORK=${WORK:-/tmp/rl_cpu_demo}
SFT_STEPS=${SFT_STEPS:-80}
RL_STEPS=${RL_STEPS:-300}
source "$(dirname "$0")/rl_demo_common.sh"   # cd to the repo root, environment, empty $WORK

demo_tiny_model "$WORK/init" 64 2 128 0
demo_addition_data

echo "== SFT warm-up ($SFT_STEPS steps)"
demo_sft "$WORK/init" "$SFT_STEPS" sft_hf

echo "== GRPO ($RL_STEPS steps)"
python -m engine.rl algorithm=grpo model.hf_path="$WORK/sft_hf" \
  data.train_files="[$WORK/rl.jsonl]" reward.fn=math reward.timeout_s=null \
  rollout.n=8 rollout.max_new_tokens=4 rollout.temperature=1.0 \
  train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
  train.seq_length=32 train.max_steps="$RL_STEPS" \
  optim.lr=5e-4 optim.schedule=constant optim.clip_grad=1.0 kl.beta=0.0 \
  logging.dir="$WORK/rl_logs" logging.progress_bar=false

demo_first_last "$WORK/rl_logs/metrics.jsonl" reward/mean auto
