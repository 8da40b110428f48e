#!/usr/bin/env bash
# CPU demo of on-policy distillation: a tiny student learns from a bigger tiny teacher.
#
#   bash recipes/rl_distill_cpu_demo.sh      # WORK=runs/rl_distill_cpu_demo by default
#
# 1. builds two tiny random Qwen3-shaped models with the same tokenizer (megatron-sft-engine demo model):
#    the student (hidden 64, 2 layers) and the teacher (hidden 128, 4 layers), and the addition
#    data of recipes/rl_cpu_demo.sh (no download);
# 2. SFTs the teacher briefly (megatron-sft-engine sft) on "what is a plus b ?" -> "a+b" chats, so
#    it knows the answer format (better than random); converts its checkpoint to HF;
# 3. trains the untouched student with pure on-policy distillation (megatron-sft-engine rl
#    --nproc-per-node 2: DP2 on 2 gloo ranks; distill.teacher_path=the teacher, reward.fn=none, no
#    KL): every sampled token's advantage is -(log pi_student - log pi_teacher); saves the student;
# 4. converts the student to HF and asks the teacher, the untrained and the trained student the
#    100 prompts greedily in transformers (megatron-sft-engine demo evaluate).
# Prints distill/reverse_kl per step (the token mean of log pi_student - log pi_teacher over the
# sampled tokens) with the means of the first and last 3 steps (it must drop clearly), three
# greedy answers of each model and the greedy accuracy of the teacher and of the student before
# and after. Measured on 2 CPU cores (2026-11-28, the models' heads of 32 dims): reverse KL 6.729
# (first 3 steps) -> 0.110 (last 3 of 150); greedy accuracy on the 100 prompts: teacher 0.09,
# student 0.00 -> 0.09 (the student now answers with numbers like its teacher, mostly wrong ones);
# wall time: docs/benchmarks.md. Not run in CI.
WORK=${WORK:-runs/rl_distill_cpu_demo}
SFT_STEPS=${SFT_STEPS:-80}
RL_STEPS=${RL_STEPS:-150}
source "$(dirname "$0")/rl_demo_common.sh"   # cd to the repo root, environment, empty $WORK
export OMP_NUM_THREADS=1   # two ranks on the demo's 2 cores

demo_tiny_model "$WORK/student" 64 2 128 1
demo_tiny_model "$WORK/teacher_init" 128 4 256 0
demo_addition_data

echo "== teacher SFT ($SFT_STEPS steps)"
demo_sft "$WORK/teacher_init" "$SFT_STEPS" teacher

echo "== on-policy distillation into the student ($RL_STEPS steps, 2 ranks)"
megatron-sft-engine rl --nproc-per-node 2 model.hf_path="$WORK/student" \
  distill.teacher_path="$WORK/teacher" distill.coef=1.0 reward.fn=none kl.beta=0.0 \
  data.train_files="[$WORK/rl.jsonl]" \
  rollout.n=4 rollout.max_new_tokens=4 rollout.temperature=1.0 \
  train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
  train.seq_length=32 train.max_steps="$RL_STEPS" \
  optim.lr=1e-3 optim.schedule=constant optim.clip_grad=1.0 \
  logging.dir="$WORK/rl_logs" logging.progress_bar=false checkpoint.dir="$WORK/rl_ckpt"

demo_first_last "$WORK/rl_logs/metrics.jsonl" distill/reverse_kl 3
echo "== the distilled student, in transformers"
demo_export "$WORK/rl_ckpt" student_hf
demo_evaluate "teacher=$WORK/teacher" "student-before=$WORK/student" \
  "student-after=$WORK/student_hf"
