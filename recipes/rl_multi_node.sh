#!/usr/bin/env bash
# GRPO / DAPO on several nodes: run once on every node (same arguments, its own NODE_RANK).
#
#   NNODES=2 NODE_RANK=0|1 MASTER_ADDR=<host of node 0> MASTER_PORT=29500 \
#   MODEL_DIR=/models/Qwen3-8B TRAIN_FILES=/data/prompts.jsonl [RUN_DIR=/shared/runs/grpo] \
#       recipes/rl_multi_node.sh recipes/rl/qwen3_8b_grpo_h100.yaml [key=value ...]
#
# The recipes place one rollout engine per node (SGLang, `pip install -e .[gpu]`; see
# rollout.num_engines / rollout.gpus_per_engine), owned by the node's local rank 0 and
# colocated with training; each is fed its weights by its own node's model replica. Check the
# placement first: python -m engine.rl --config RECIPE --validate --nodes $NNODES. Checkpoints go to
# $RUN_DIR/checkpoints (on a file system every node sees); rerunning the same command
# resumes from the newest complete one (checkpoint.resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${1:?usage: rl_multi_node.sh RECIPE.yaml [key=value ...]}; shift
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
: "${MODEL_DIR:?set MODEL_DIR}" "${TRAIN_FILES:?set TRAIN_FILES}"
RUN_DIR=${RUN_DIR:-runs/$(basename "$RECIPE" .yaml)}
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "${NPROC_PER_NODE:-8}" \
  --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" -m engine.rl --config "$RECIPE" \
  model.hf_path="$MODEL_DIR" data.train_files="[$TRAIN_FILES]" logging.dir="$RUN_DIR" \
  checkpoint.dir="$RUN_DIR/checkpoints" "$@"
