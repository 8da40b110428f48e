#!/usr/bin/env bash
# CPU demo with images: a tiny Qwen3-VL learns to count the squares in pictures it is shown.
#
#   bash recipes/vlm_cpu_demo.sh            # WORK=runs/vlm_cpu_demo by default
#
# 1. draws 1,000 pictures of 1 to 4 coloured squares and builds a tiny random Qwen3-VL with
#    its image processor (megatron-sft-engine demo counting-data; nothing is downloaded);
# 2. briefly SFTs it, vision tower included (model.vision.freeze=false), on "how many
#    squares ?" chats with the picture ($SFT_STEPS steps): it learns the answer format and
#    some counting; converts the checkpoint to HF ($WORK/sft_hf);
# 3. trains GRPO ($RL_STEPS steps, the built-in math reward on the count, rollouts with the
#    pictures on the HF backend) on 200 other pictures, tower trained too;
# 4. converts the policy to HF and counts 100 pictures greedily with both models in transformers
#    (megatron-sft-engine demo counting-evaluate).
# Prints the reward curve with the means of its first and last fifth and the greedy accuracy
# before and after GRPO. Measured on 2 CPU cores: see docs/vlm.md. Not run in CI.
WORK=${WORK:-runs/vlm_cpu_demo}
SFT_STEPS=${SFT_STEPS:-30}
RL_STEPS=${RL_STEPS:-100}
source "$(dirname "$0")/rl_demo_common.sh"   # cd to the repo root, environment, empty $WORK

megatron-sft-engine demo counting-data "$WORK"

echo "== SFT warm-up ($SFT_STEPS steps, vision tower trained)"
demo_sft "$WORK/init" "$SFT_STEPS" sft_hf model.vision.freeze=false train.seq_length=48

echo "== GRPO ($RL_STEPS steps, rollouts with the pictures)"
demo_grpo "$WORK/sft_hf" "$RL_STEPS" rollout.max_new_tokens=2 train.seq_length=48 \
  model.vision.freeze=false

demo_first_last "$WORK/rl_logs/metrics.jsonl" reward/mean auto
echo "== the trained policy, in transformers"
demo_export "$WORK/rl_ckpt" rl_hf
megatron-sft-engine demo counting-evaluate --data "$WORK/rl.jsonl" \
  --model "before-GRPO=$WORK/sft_hf" --model "after-GRPO=$WORK/rl_hf" --limit 100
