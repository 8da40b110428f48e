"""The workload of `python -m tools.bench trl` (tools/bench/trl.py): the model folder and the
rows both sides train on, built locally (nothing downloaded).

Model: Qwen3-shaped, fp32, random weights (tools.tiny_models.build_tiny_model), hidden 384,
4 layers, 6 query heads of 64 and 2 KV heads, FFN 1,152, vocabulary 128; the tokenizer is the
character-level chatml one of tools.char_tokenizer (every printable character one token, 101
ids; <|im_end|> = 100 is the end of a turn and the model's eos). `--quick`: hidden 64, 2
layers, 2 heads of 32, FFN 128.

Rows (JSON lines, TRL's conversational formats, which the engine reads too):
- grpo_shared: {"prompt": [system, user], "answer"}: every prompt carries the same
  SYSTEM_CHARS-character system prompt and a short question of its own ("what is 17 plus 4 ?");
- grpo_distinct: {"prompt": [user], "answer"}: a different QUESTION_CHARS-character question
  each, no system prompt;
- sft: {"prompt": [user], "completion": [assistant]}: a QUESTION_CHARS-character question and
  an ANSWER_CHARS-character answer (TRL's prompt-completion rows: the completion is trained);
- dpo: {"prompt": [user], "chosen": [assistant], "rejected": [assistant]}: the same questions,
  two answers of PAIR_CHARS characters.
`reward` is both sides' GRPO reward: the share of digits in the reply (spread over a group, so
advantages are non-zero; a few microseconds per reply).
"""
from __future__ import annotations

import json
import os
import random

WORKLOADS = ("grpo_shared", "grpo_distinct", "sft", "dpo")   # the bench's, both sides
MODEL = dict(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1152, head_dim=64)
QUICK_MODEL = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, head_dim=32)
VOCAB = 128          # >= the tokenizer's 101 ids
SYSTEM_CHARS, QUESTION_CHARS, ANSWER_CHARS, PAIR_CHARS = 300, 110, 100, 60
ROWS = 64            # rows per file (more than any run draws)
WORDS = ("the", "of", "and", "a", "number", "sum", "value", "is", "what", "when", "each",
         "step", "count", "add", "plus", "then", "list", "item", "order", "first", "last")


def _text(rng: random.Random, chars: int) -> str:
    """Words and numbers drawn from `rng`, exactly `chars` characters."""
    out = ""
    while len(out) < chars:
        out += (rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randrange(100))) + " "
    return out[:chars - 1].rstrip() + "?" if chars > 1 else "?"


def system_prompt() -> str:
    """The shared SYSTEM_CHARS-character system prompt."""
    return _text(random.Random(7), SYSTEM_CHARS)


def grpo_rows(kind: str, rows: int = ROWS) -> list[dict]:
    """The GRPO prompt rows of `kind` (grpo_shared | grpo_distinct; module docstring)."""
    rng = random.Random(1)
    out = []
    for i in range(rows):
        a, b = rng.randrange(100), rng.randrange(100)
        if kind == "grpo_shared":
            prompt = [{"role": "system", "content": system_prompt()},
                      {"role": "user", "content": f"what is {a} plus {b} ?"}]
        elif kind == "grpo_distinct":
            prompt = [{"role": "user", "content": _text(rng, QUESTION_CHARS)}]
        else:
            raise ValueError(f"grpo rows: kind {kind!r} unknown; valid: grpo_shared, "
                             "grpo_distinct")
        out.append({"prompt": prompt, "answer": str(a + b)})
    return out


def sft_rows(rows: int = ROWS) -> list[dict]:
    """SFT rows in TRL's conversational prompt-completion form (module docstring)."""
    rng = random.Random(2)
    return [{"prompt": [{"role": "user", "content": _text(rng, QUESTION_CHARS)}],
             "completion": [{"role": "assistant", "content": _text(rng, ANSWER_CHARS)}]}
            for _ in range(rows)]


def dpo_rows(rows: int = ROWS) -> list[dict]:
    """Preference rows in TRL's conversational form (module docstring)."""
    rng = random.Random(3)
    return [{"prompt": [{"role": "user", "content": _text(rng, QUESTION_CHARS)}],
             "chosen": [{"role": "assistant", "content": _text(rng, PAIR_CHARS)}],
             "rejected": [{"role": "assistant", "content": _text(rng, PAIR_CHARS)}]}
            for _ in range(rows)]


ROW_MAKERS = {"grpo_shared": lambda: grpo_rows("grpo_shared"),
              "grpo_distinct": lambda: grpo_rows("grpo_distinct"),
              "sft": sft_rows, "dpo": dpo_rows}


def write_rows(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def build_model(out_dir: str, quick: bool) -> str:
    """The module docstring's model and tokenizer in `out_dir`; returns it."""
    from tools.char_tokenizer import build_char_tokenizer
    from tools.tiny_models import build_tiny_model

    spec = QUICK_MODEL if quick else MODEL
    tok = build_char_tokenizer(None, "chatml")
    build_tiny_model(out_dir, "qwen3", vocab_size=VOCAB, tokenizer=False, seed=0,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     max_position_embeddings=1024, **spec)
    tok.save_pretrained(out_dir)
    return out_dir


def reward(prompt: str = "", response: str = "", answer: str = "", **fields) -> float:
    """The engine's reward.fn: the share of digits in the reply."""
    return sum(ch.isdigit() for ch in response) / max(1, len(response))


def trl_reward(completions, **kwargs) -> list[float]:
    """TRL's reward function: `reward` of each completion (conversational: its content)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [reward(response=t) for t in texts]


def workdir_files(work: str, quick: bool) -> dict[str, str]:
    """Build the model and every workload's rows under `work`: {"model": dir, NAME: file}."""
    files = {"model": build_model(os.path.join(work, "model"), quick)}
    for name, make in ROW_MAKERS.items():
        files[name] = write_rows(os.path.join(work, f"{name}.jsonl"), make())
    return files
