#!/usr/bin/env bash
# SFT on several nodes: run this once on every node (same arguments, its own NODE_RANK).
#
#   NNODES=2 NODE_RANK=0|1 MASTER_ADDR=<host of node 0> MASTER_PORT=29500 \
#   MODEL_DIR=/models/Qwen3-8B TRAIN_FILES=/data/train.jsonl [EVAL_FILES=...] \
#   [RUN_DIR=/shared/runs/qwen3_8b] [NPROC_PER_NODE=8] \
#       recipes/sft_multi_node.sh recipes/sft/qwen3_8b_h100.yaml [key=value ...]
#
# torchrun --nnodes $NNODES --node_rank $NODE_RANK --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT
# (static rendezvous). Under SLURM (one task per node, e.g. `srun --ntasks-per-node 1 ...`)
# NNODES, NODE_RANK and MASTER_ADDR default to SLURM_NNODES, SLURM_NODEID and the first host
# of SLURM_JOB_NODELIST. MODEL_DIR, the data and RUN_DIR must be on a file system every node
# sees at the same path (checkpoints are written by all ranks into one directory).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sft_launch_common.sh"
NNODES="${NNODES:-${SLURM_NNODES:-}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
MASTER_PORT="${MASTER_PORT:-29500}"
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1, this node)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host of node 0, the rendezvous endpoint)}"
sft_parse_args "$@"
sft_validate "$NNODES"
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" -m "$ENGINE_MODULE" "${SFT_ARGS[@]}"
