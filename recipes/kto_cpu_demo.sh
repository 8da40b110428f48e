#!/usr/bin/env bash
# CPU demo of KTO (docs/preference.md "KTO"): the tiny random Qwen3-style model of
# recipes/cpu_demo.sh learns from unpaired feedback that "the answer is c" is desirable and
# "c is the answer" undesirable for "what is a + b ?", on 2 gloo ranks (DP2) with a frozen
# reference. eval/rewards/margins (desirable minus undesirable implied reward) on held-out rows
# (prompts not in the training rows) grows from 0.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
source recipes/demo_args.sh
megatron-sft-engine demo assets --out "$OUT/demo_assets"   # tools/demo.py; nothing downloaded
megatron-sft-engine kto --nproc-per-node 2 \
  model.hf_path="$OUT/demo_assets/model" \
  data.train_files="[$OUT/demo_assets/kto_train.jsonl]" \
  data.eval_files="[$OUT/demo_assets/kto_eval.jsonl]" \
  train.global_batch_size=16 train.micro_batch_size=4 train.seq_length=64 \
  train.max_steps="${STEPS:-40}" train.eval_interval=4 \
  optim.lr=2e-4 optim.min_lr=2e-5 optim.warmup_steps=5 optim.schedule=cosine \
  kto.beta=0.1 \
  logging.dir="$OUT/kto_cpu_demo" "$@"
LOGS=$(demo_arg logging.dir "$OUT/kto_cpu_demo" "$@")   # the folder the run logged to
echo "metrics: $LOGS/metrics.jsonl  (tensorboard --logdir $LOGS)"
