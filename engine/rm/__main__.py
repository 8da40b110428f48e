"""Reward-model training entry point (docs/preference.md, "Reward models").

    torchrun --nproc_per_node N -m engine.rm model.hf_path=DIR data.train_files=[pairs.jsonl] \
        train.global_batch_size=64 train.max_steps=100
    python -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml --validate --nodes 1

The configuration is parsed and validated here, before any process group exists (exit code 2
on an error); the run itself is engine.rm.training.run.
"""
from __future__ import annotations

import argparse
import sys

from engine.cli import entry_main, exit_process, hook


SCORE_DTYPES = ("float32", "bfloat16", "float16")


def score_parser(prog: str) -> argparse.ArgumentParser:
    """The flags of `rm score` (engine.rm.score, which reads them)."""
    p = argparse.ArgumentParser(prog=prog, description=(
        "Score chats (or both sides of preference pairs) with a reward model's HF folder, "
        "rendered as `rm` training renders them and scored on the reply's end-of-turn token."))
    p.add_argument("--model", required=True, help="the reward model's HF folder "
                   "(*ForSequenceClassification, num_labels 1; convert mcore-to-hf writes it)")
    p.add_argument("--data", required=True, nargs="+", help="rows: chats "
                   '({"messages": [...]}) or preference rows (prompt/chosen/rejected)')
    p.add_argument("--out", help="write the JSON lines here instead of stdout")
    p.add_argument("--dtype", default="float32", choices=SCORE_DTYPES)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--limit", type=int, default=None, help="score the first N rows only")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the folder's own tokenizer code run")
    return p


USAGE = "python -m engine.rm [--config FILE.yaml] [key=value ...]  (or torchrun ... -m engine.rm)"
EXAMPLES = [
    "python -m engine.rm model.hf_path=DIR data.train_files=[pairs.jsonl] train.max_steps=100",
    "torchrun --nproc_per_node 8 -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml "
    "model.hf_path=DIR",
    "python -m engine.rm --config recipes/rm/qwen3_8b_rm_h100.yaml --validate --nodes 1",
    "python -m engine.rm score --model runs/rm/hf --data chats.jsonl  (an exported reward "
    "model's scores of chats; `score --help`)",
]


def main(argv: list[str] | None = None, prog: str = "engine.rm", usage: str = USAGE,
         examples: list[str] = EXAMPLES) -> int:
    """`python -m engine.rm [--config FILE] [key=value ...] [--validate ...]`, or
    `python -m engine.rm score ...` (engine.rm.score: a reward model's scores of chats). `prog`,
    `usage` and `examples` are what --help prints (the console command passes its own)."""
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["score"]:   # flags parsed (--help answered) before transformers loads
        args = score_parser(f"{prog} score").parse_args(argv[1:])
        return hook("engine.rm.score:main")(args, prog=f"{prog} score")
    return entry_main(argv, prog, "engine.config.rm_settings:RMConfig", usage, examples,
                      hook("engine.rm.recipe_check:main"), "engine.rm.training:run",
                      validate=hook("engine.rm.export:validate_rm_run"))


if __name__ == "__main__":
    exit_process(main())
