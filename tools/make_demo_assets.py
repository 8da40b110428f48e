"""Create the CPU demo's assets: a tiny random Qwen3-style HF model (tied embeddings, q/k norm,
GQA) with a local word-level chat tokenizer, and small arithmetic datasets. Nothing is
downloaded.

    python tools/make_demo_assets.py --out runs/demo_assets
writes OUT/model/ (HF folder), OUT/sft_train.jsonl, OUT/sft_eval.jsonl (chat rows:
"what is a + b ?" -> "the answer is c") and OUT/rl_prompts.jsonl ({"prompt", "answer"}).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chat_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"what is {a} + {b} ?"},
                         {"role": "assistant", "content": f"the answer is {a + b}"}]}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    from tests.tiny_models import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo_assets")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_model(str(out / "model"), "qwen3", vocab_size=256, hidden=128, layers=4,
                     heads=8, kv_heads=2, intermediate=256, seed=args.seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng = random.Random(args.seed)
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:20], pairs[20:]
    write_jsonl(out / "sft_train.jsonl", [chat_row(a, b) for a, b in train_pairs * 4])
    write_jsonl(out / "sft_eval.jsonl", [chat_row(a, b) for a, b in eval_pairs])
    write_jsonl(out / "rl_prompts.jsonl",
                [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a, b in pairs])
    print(f"demo assets in {out}: model/, sft_train.jsonl ({len(train_pairs) * 4} rows), "
          f"sft_eval.jsonl ({len(eval_pairs)} rows), rl_prompts.jsonl ({len(pairs)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
