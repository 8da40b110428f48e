#!/usr/bin/env bash
# DPO on one node (docs/preference.md): recipes/sft_single_node.sh with engine.dpo; TRAIN_FILES
# hold preference pairs (engine.data.preference).
#
#   MODEL_DIR=/models/Qwen3-8B-SFT TRAIN_FILES=/data/pairs.jsonl [EVAL_FILES=/data/eval_pairs.jsonl] \
#       recipes/dpo_single_node.sh recipes/dpo/qwen3_8b_dpo_h100.yaml [key=value ...]
# Multi-node: ENGINE_MODULE=engine.dpo recipes/sft_multi_node.sh RECIPE.yaml (its own variables).
set -euo pipefail
export ENGINE_MODULE=engine.dpo
exec "$(dirname "${BASH_SOURCE[0]}")/sft_single_node.sh" "$@"
