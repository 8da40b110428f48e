# Shared by the RL CPU demos (sourced, not run): recipes/rl_cpu_demo.sh,
# recipes/rl_distill_cpu_demo.sh, recipes/vlm_cpu_demo.sh, recipes/rm_cpu_demo.sh and
# recipes/agent_cpu_demo.sh. Goes to the repository root, sets the environment and an empty
# $WORK (the caller sets WORK first), and defines:
#
#   demo_tiny_model DIR HIDDEN LAYERS INTERMEDIATE SEED   a tiny random Qwen3 (HIDDEN / 32 heads
#       of 32 dims, vLLM's CPU minimum; 2 KV heads; the
#       200-token word-level tokenizer of tools/tiny_models.py: every demo model shares it)
#   demo_addition_data   $WORK/sft.jsonl ("what is a plus b ?" -> "a+b") and $WORK/rl.jsonl
#       (the same prompts with "answer"), single-digit a, b: 100 rows each, no download
#   demo_sft INIT STEPS NAME [KEY=VALUE ...]   SFT of INIT on $WORK/sft.jsonl for STEPS steps
#       (one process), then its checkpoint converted to HF in $WORK/NAME (logs in
#       $WORK/NAME_logs); the KEY=VALUE overrides come last (the last value of a key wins)
#   demo_grpo MODEL STEPS [KEY=VALUE ...]   GRPO of MODEL on $WORK/rl.jsonl for STEPS steps
#       (the built-in math reward, 16 prompts x 8 responses a step, no KL), logs in
#       $WORK/rl_logs, checkpoints in $WORK/rl_ckpt
#   demo_export RUN_CKPT NAME   the newest checkpoint of a run's checkpoint.dir converted to HF
#       in $WORK/NAME
#   demo_first_last METRICS KEY K   prints KEY per step of a metrics.jsonl and the means of its
#       first and last K steps (K=auto: a fifth of the steps)
#   demo_evaluate NAME=DIR ...   greedy answers of each HF model to the 100 prompts of
#       $WORK/rl.jsonl (transformers' generate, scored by the math reward), and the accuracy of
#       each
# The commands are the console command that `pip install -e .` installs (megatron-sft-engine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "$WORK" in /*) ;; *) WORK="$PWD/$WORK" ;; esac   # runs/NAME: under the repository root
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
rm -rf "$WORK" && mkdir -p "$WORK"

demo_tiny_model() {
  megatron-sft-engine demo model "$1" --hidden "$2" --layers "$3" --intermediate "$4" --seed "$5"
}

demo_addition_data() {
  megatron-sft-engine demo addition-data "$WORK"
}

demo_sft() {
  local init=$1 steps=$2 name=$3
  shift 3
  megatron-sft-engine sft model.hf_path="$init" data.train_files="[$WORK/sft.jsonl]" \
    train.global_batch_size=16 train.micro_batch_size=16 train.seq_length=32 \
    train.max_steps="$steps" optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 \
    logging.dir="$WORK/${name}_logs" logging.progress_bar=false \
    checkpoint.dir="$WORK/${name}_ckpt" "$@"
  demo_export "$WORK/${name}_ckpt" "$name"
}

demo_grpo() {
  local model=$1 steps=$2
  shift 2
  megatron-sft-engine rl algorithm=grpo model.hf_path="$model" \
    data.train_files="[$WORK/rl.jsonl]" reward.fn=math reward.timeout_s=null \
    rollout.n=8 rollout.temperature=1.0 \
    train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
    train.max_steps="$steps" optim.lr=5e-4 optim.schedule=constant optim.clip_grad=1.0 \
    kl.beta=0.0 logging.dir="$WORK/rl_logs" logging.progress_bar=false \
    checkpoint.dir="$WORK/rl_ckpt" "$@"
}

demo_export() {
  megatron-sft-engine convert mcore-to-hf --ckpt "$1" --out "$WORK/$2"
}

demo_evaluate() {
  local models=()
  for m in "$@"; do models+=(--model "$m"); done
  megatron-sft-engine demo evaluate --data "$WORK/rl.jsonl" "${models[@]}" --limit 100 \
    --max-new-tokens 4
}

demo_first_last() {
  python - "$@" <<'EOF'
import json, sys
path, key, k = sys.argv[1:]
rows = [json.loads(line) for line in open(path)]
k = max(1, len(rows) // 5) if k == "auto" else int(k)
first = sum(r[key] for r in rows[:k]) / k
last = sum(r[key] for r in rows[-k:]) / k
print(f"{key} per step: " + " ".join(f"{r[key]:.2f}" for r in rows))
print(f"{key}: first {rows[0][key]:.3f}, last {rows[-1][key]:.3f}; mean of the first {k} "
      f"steps {first:.3f}, of the last {k} steps {last:.3f}")
EOF
}
