#!/usr/bin/env bash
# CPU demo: SFT of a tiny Qwen3-style model on 4 gloo ranks (TP2 x DP2), 1-3 minutes on 2 cores.
# Prints the first and last loss; TensorBoard logs and metrics.jsonl land in runs/cpu_demo/.
# Saves the trained model at its end (runs/cpu_demo/ckpt, a Megatron checkpoint), converts it
# to a Hugging Face folder (runs/cpu_demo/hf) and asks that folder the 20 held-out questions
# greedily in transformers; docs/getting-started.md shows serving it. Every run starts afresh
# (runs/cpu_demo is emptied first). STEPS=N sets the steps (default 120), OUT=DIR the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
source recipes/demo_args.sh
rm -rf "$OUT/cpu_demo"
megatron-sft-engine demo assets --out "$OUT/demo_assets"   # tools/demo.py; nothing downloaded
megatron-sft-engine sft --nproc-per-node 4 \
  model.hf_path="$OUT/demo_assets/model" \
  data.train_files="[$OUT/demo_assets/sft_train.jsonl]" \
  data.eval_files="[$OUT/demo_assets/sft_eval.jsonl]" \
  parallel.tp=2 \
  train.global_batch_size=16 train.micro_batch_size=4 train.seq_length=64 \
  train.max_steps="${STEPS:-120}" train.eval_interval=40 \
  optim.lr=3e-3 optim.min_lr=3e-4 optim.warmup_steps=10 optim.schedule=cosine \
  loss.agg_mode=token-mean \
  logging.dir="$OUT/cpu_demo" checkpoint.dir="$OUT/cpu_demo/ckpt" "$@"
LOGS=$(demo_arg logging.dir "$OUT/cpu_demo" "$@")   # the folder the run logged to
megatron-sft-engine convert mcore-to-hf --ckpt "$OUT/cpu_demo/ckpt" --out "$OUT/cpu_demo/hf"
# the first 20 prompts of rl_prompts.jsonl are the held-out sums of sft_eval.jsonl
megatron-sft-engine demo evaluate --data "$OUT/demo_assets/rl_prompts.jsonl" \
  --model sft="$OUT/cpu_demo/hf" --limit 20
echo "metrics: $LOGS/metrics.jsonl  (tensorboard --logdir $LOGS)"
echo "model: $OUT/cpu_demo/hf  (megatron-sft-engine serve --model $OUT/cpu_demo/hf)"
