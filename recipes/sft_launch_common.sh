# Shared by sft_single_node.sh and sft_multi_node.sh (sourced, not run).
#
# Inputs (environment): MODEL_DIR (HF model folder: config.json, safetensors, tokenizer),
# TRAIN_FILES (comma-separated .jsonl/.parquet), optional EVAL_FILES, RUN_DIR (default
# runs/<recipe name>: metrics.jsonl, TensorBoard, checkpoints/), NPROC_PER_NODE (default 8).
# ENGINE_MODULE: the entry point (default engine.sft; recipes/dpo_single_node.sh sets
# engine.dpo: the same keys plus dpo.*). Defines SFT_ARGS (its arguments) and sft_validate NODES.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
ENGINE_MODULE="${ENGINE_MODULE:-engine.sft}"
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

sft_parse_args() {
  RECIPE="${1:?usage: $0 RECIPE.yaml [key=value ...]}"
  shift
  : "${MODEL_DIR:?set MODEL_DIR to the HF model directory}"
  : "${TRAIN_FILES:?set TRAIN_FILES to a comma-separated list of .jsonl/.parquet files}"
  NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
  RUN_DIR="${RUN_DIR:-runs/$(basename "$RECIPE" .yaml)}"
  SFT_ARGS=(--config "$RECIPE" "model.hf_path=$MODEL_DIR" "data.train_files=[$TRAIN_FILES]"
            "checkpoint.dir=$RUN_DIR/checkpoints" "logging.dir=$RUN_DIR")
  if [[ -n "${EVAL_FILES:-}" ]]; then
    SFT_ARGS+=("data.eval_files=[$EVAL_FILES]")
  fi
  SFT_ARGS+=("$@")
}

# Check layout arithmetic, model shape, files and memory for NODES x NPROC_PER_NODE GPUs
# before any process group starts (exit 2 with the list of problems).
sft_validate() {
  python -m "$ENGINE_MODULE" "${SFT_ARGS[@]}" --validate --nodes "$1" \
    --gpus-per-node "$NPROC_PER_NODE" --world-size "$(( $1 * NPROC_PER_NODE ))"
}
