#!/usr/bin/env bash
# SFT on one node: torchrun --standalone --nproc_per_node 8 (one H100 node).
#
#   MODEL_DIR=/models/Qwen3-8B TRAIN_FILES=/data/train.jsonl[,/data/more.jsonl] \
#   [EVAL_FILES=/data/eval.jsonl] [RUN_DIR=runs/qwen3_8b_h100] [NPROC_PER_NODE=8] \
#       recipes/sft_single_node.sh recipes/sft/qwen3_8b_h100.yaml [key=value ...]
#
# The recipe is validated for this node first. Rerunning the same command resumes from the
# newest complete checkpoint in $RUN_DIR/checkpoints (checkpoint.resume=auto), also after the
# layout changed (e.g. parallel.tp=4 added on the command line).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sft_launch_common.sh"
sft_parse_args "$@"
sft_validate 1
exec torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" -m "$ENGINE_MODULE" "${SFT_ARGS[@]}"
