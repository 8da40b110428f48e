# Shared by the RL CPU demos (sourced, not run): recipes/rl_cpu_demo.sh and
# recipes/rl_distill_cpu_demo.sh. Goes to the repository root, sets the environment and an empty
# $WORK (the caller sets WORK first), and defines:
#
#   demo_tiny_model DIR HIDDEN LAYERS INTERMEDIATE SEED   a tiny random Qwen3 (4 heads, 2 KV heads,
#       200-token word-level tokenizer of tests/tiny_models.py: every demo model shares it)
#   demo_addition_data   $WORK/sft.jsonl ("what is a plus b ?" -> "a+b") and $WORK/rl.jsonl
#       (the same prompts with "answer"), single-digit a, b: 100 rows each, no download
#   demo_sft INIT STEPS NAME   engine.sft of INIT on $WORK/sft.jsonl for STEPS steps (one process),
#       then the checkpoint converted to HF in $WORK/NAME (logs in $WORK/NAME_logs)
#   demo_first_last METRICS KEY K   prints KEY per step of a metrics.jsonl and the means of its
#       first and last K steps (K=auto: a fifth of the steps)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
rm -rf "$WORK" && mkdir -p "$WORK"

demo_tiny_model() {
  python -c 'import sys; from tests.tiny_models import build_tiny_model as b
d, h, l, i, s = sys.argv[1:]
b(d, "qwen3", vocab_size=200, hidden=int(h), layers=int(l), heads=4, kv_heads=2,
  intermediate=int(i), seed=int(s))' "$@"
}

demo_addition_data() {
  python - "$WORK" <<'EOF'
import json, random, sys
pairs = [(a, b) for a in range(10) for b in range(10)]
random.Random(0).shuffle(pairs)
with open(f"{sys.argv[1]}/sft.jsonl", "w") as sft, open(f"{sys.argv[1]}/rl.jsonl", "w") as rl:
    for a, b in pairs:
        sft.write(json.dumps({"prompt": f"what is {a} plus {b} ?", "response": str(a + b)}) + "\n")
        rl.write(json.dumps({"prompt": f"what is {a} plus {b} ?", "answer": a + b}) + "\n")
EOF
}

demo_sft() {
  python -m engine.sft model.hf_path="$1" data.train_files="[$WORK/sft.jsonl]" \
    train.global_batch_size=16 train.micro_batch_size=16 train.seq_length=32 \
    train.max_steps="$2" optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 \
    logging.dir="$WORK/$3_logs" logging.progress_bar=false checkpoint.dir="$WORK/$3_ckpt"
  python tools/convert.py mcore-to-hf --ckpt "$WORK/$3_ckpt" --out "$WORK/$3"
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
