# Shared by the RL CPU demos (sourced, not run): recipes/rl_cpu_demo.sh and
# recipes/rl_distill_cpu_demo.sh. Goes to the repository root, sets the environment and an empty
# $WORK (the caller sets WORK first), and defines:
#
#   demo_tiny_model DIR HIDDEN LAYERS INTERMEDIATE SEED   a tiny random Qwen3 (4 heads, 2 KV heads,
#       200-token word-level tokenizer of tools/tiny_models.py: every demo model shares it)
#   demo_addition_data   $WORK/sft.jsonl ("what is a plus b ?" -> "a+b") and $WORK/rl.jsonl
#       (the same prompts with "answer"), single-digit a, b: 100 rows each, no download
#   demo_sft INIT STEPS NAME   SFT of INIT on $WORK/sft.jsonl for STEPS steps (one process),
#       then its checkpoint converted to HF in $WORK/NAME (logs in $WORK/NAME_logs)
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
  megatron-sft-engine sft model.hf_path="$1" data.train_files="[$WORK/sft.jsonl]" \
    train.global_batch_size=16 train.micro_batch_size=16 train.seq_length=32 \
    train.max_steps="$2" optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 \
    logging.dir="$WORK/$3_logs" logging.progress_bar=false checkpoint.dir="$WORK/$3_ckpt"
  demo_export "$WORK/$3_ckpt" "$3"
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
