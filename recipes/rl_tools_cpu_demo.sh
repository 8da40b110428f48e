#!/usr/bin/env bash
# CPU demo of multi-turn RL with tools: a tiny model learns to use a calculator tool.
#
#   bash recipes/rl_tools_cpu_demo.sh          # WORK=/tmp/rl_tools_cpu_demo by default
#
# 1. builds a tiny random Qwen3-shaped model with a character-level tokenizer whose chat template
#    renders tools and <tool_call> blocks the Qwen way (no download), and multiplication data
#    "What is 37*48?" (two-digit operands: the model cannot compute them, the tool can);
# 2. briefly SFTs it (python -m engine.sft) on tool-use conversations: user question ->
#    assistant <tool_call>{"name": "calculate", "arguments": {"expression": "37*48"}}</tool_call>
#    -> tool result -> assistant answer "1776"; converts the checkpoint to HF;
# 3. trains GRPO with the built-in tool environment (env.fn=tools, the calculator of
#    engine/rl/env/example_tools.py executed in tool worker processes, reward.fn=math on the
#    final answer), every episode written to $WORK/rl_logs/rollouts/step_<k>.jsonl.
# Prints the reward curve, env metrics and the first/last averages. Measured on 2 CPU cores:
# reward/mean 0.265 (mean of the first 12 steps) -> 0.487 (last 12), 2 turns per episode,
# 2 min 47 s in all. Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/rl_tools_cpu_demo}
SFT_STEPS=${SFT_STEPS:-300}
RL_STEPS=${RL_STEPS:-60}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
rm -rf "$WORK" && mkdir -p "$WORK"

python - "$WORK" <<'EOF'
import json, random, sys
from tests import test_data_templates as tt
from tests.tiny_models import build_tiny_model

work = sys.argv[1]
# A compact Qwen-style template: tools in a short system turn, tool calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn (the tool-call format detected: "hermes").
NL = "{{ '\\n' }}"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system" + NL + "tools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}<|im_end|>" + NL + "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant" + NL +
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \""
    "{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>" + NL +
    "{%- elif m.role == 'tool' %}<|im_start|>user" + NL +
    "<tool_response>{{ m.content }}</tool_response><|im_end|>" + NL +
    "{%- else %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" + NL +
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{%- endif %}")
tt.FAMILIES["demo"] = (TEMPLATE, tt.QWEN_SPECIAL, tt.QWEN_ADDED, "<|im_end|>", None)
tok = tt.build_char_tokenizer(f"{work}/init", "demo")
build_tiny_model(f"{work}/init", "qwen3", vocab_size=len(tok), hidden=128, layers=2, heads=4,
                 kv_heads=2, intermediate=256, seed=0, tokenizer=False,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

from engine.rl.env.example_tools import calculate
from engine.rl.env.tool_schema import tool_schema
tools = [tool_schema(calculate)]
pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
random.Random(0).shuffle(pairs)
with open(f"{work}/sft.jsonl", "w") as f:
    for a, b in pairs[:2000]:
        call = {"type": "function", "function": {"name": "calculate",
                                                 "arguments": {"expression": f"{a}*{b}"}}}
        f.write(json.dumps({"tools": tools, "messages": [
            {"role": "user", "content": f"What is {a}*{b}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]}) + "\n")
with open(f"{work}/rl.jsonl", "w") as f:
    for a, b in pairs[2000:4000]:
        f.write(json.dumps({"prompt": f"What is {a}*{b}?", "answer": a * b}) + "\n")
EOF

echo "== SFT on tool-use conversations ($SFT_STEPS steps)"
python -m engine.sft model.hf_path="$WORK/init" data.train_files="[$WORK/sft.jsonl]" \
  train.global_batch_size=32 train.micro_batch_size=32 train.seq_length=160 \
  train.max_steps="$SFT_STEPS" optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 \
  logging.dir="$WORK/sft_logs" logging.progress_bar=false checkpoint.dir="$WORK/sft_ckpt"
python tools/convert.py mcore-to-hf --ckpt "$WORK/sft_ckpt" --out "$WORK/sft_hf"

echo "== GRPO with the calculator tool ($RL_STEPS steps)"
python -m engine.rl algorithm=grpo model.hf_path="$WORK/sft_hf" \
  data.train_files="[$WORK/rl.jsonl]" reward.fn=math \
  env.fn=tools "env.tools=[engine.rl.env.example_tools:calculate]" env.max_turns=3 \
  env.num_workers=4 env.step_timeout_s=30 \
  rollout.n=8 rollout.max_new_tokens=80 rollout.temperature=1.0 \
  train.prompts_per_step=16 train.mini_batches_per_step=2 train.micro_batch_size=64 \
  train.seq_length=224 train.max_steps="$RL_STEPS" \
  optim.lr=5e-4 optim.schedule=constant optim.clip_grad=1.0 kl.beta=0.0 \
  logging.dir="$WORK/rl_logs" logging.rollout_dir="$WORK/rl_logs/rollouts" \
  logging.progress_bar=false

python - "$WORK/rl_logs" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
curve = " ".join(f"{r['reward/mean']:.2f}" for r in rows)
k = max(1, len(rows) // 5)
first = sum(r["reward/mean"] for r in rows[:k]) / k
last = sum(r["reward/mean"] for r in rows[-k:]) / k
print(f"reward/mean per step: {curve}")
for key in ("env/turns_mean", "env/tool_calls", "env/tool_errors", "env/errors"):
    print(f"{key}: first {rows[0][key]:.2f}, last {rows[-1][key]:.2f}")
print(f"first reward {rows[0]['reward/mean']:.3f}, last reward {rows[-1]['reward/mean']:.3f}; "
      f"mean of first {k} steps {first:.3f}, of last {k} steps {last:.3f}")
episode = json.loads(open(f"{sys.argv[1]}/rollouts/step_{len(rows)}.jsonl").readline())
print("an episode of the last step:", repr(episode["text"]))
EOF
