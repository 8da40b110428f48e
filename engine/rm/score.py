"""`megatron-sft-engine rm score` (`python -m engine.rm score`): a reward model's scores of
chats, on the CPU or one GPU, from an exported folder
(docs/preference.md#scoring-chats-megatron-sft-engine-rm-score).

    megatron-sft-engine rm score --model runs/rm/hf --data chats.jsonl [--out scores.jsonl]

`--model`: a reward model's HF folder (`*ForSequenceClassification`, num_labels 1: what
`convert mcore-to-hf` writes). `--data`: .jsonl/.parquet files; a row is a chat
(`{"messages": [...], "tools": [...]}`, its last message the assistant reply) or a preference
row in any format `rm` trains on (`prompt`/`chosen`/`rejected`, implicit prompt, text). Each
row is rendered with the folder's chat template exactly as training renders a side and cut
after its end-of-turn token (engine.rm.scoring), one sequence per forward pass of transformers'
AutoModelForSequenceClassification. One JSON line per row on stdout (or --out): `{"row": N,
"score": s}` for a chat, `{"row": N, "chosen": c, "rejected": r, "margin": c - r}` for a pair;
a summary on stderr (the pairs' preference accuracy and mean margin). Exit codes: 0 done, 2 a
bad folder or row (named by file:line).
"""
from __future__ import annotations

import json
import os
import sys

import torch
from transformers import AutoModelForSequenceClassification

from engine.data.files import DataError, read_rows, where
from engine.data.rows import chat_field, normalize_chat
from engine.rm.scoring import chat_scored_ids, pair_scored_ids
from models.bridge.reward_model import is_reward_model_config
from models.hf.custom_code import load_tokenizer
from models.hf.io import read_config

def row_ids(row: dict, tokenizer, at: str) -> dict[str, list[int]]:
    """{"score": ids} of a chat row, {"chosen": ids, "rejected": ids} of a preference row."""
    if chat_field(row) is not None and "chosen" not in row:
        chat = normalize_chat(row, at)
        return {"score": chat_scored_ids(chat.messages, tokenizer, at, chat.tools)}
    if "chosen" in row or "rejected" in row:
        chosen, rejected = pair_scored_ids(row, tokenizer, at)
        return {"chosen": chosen, "rejected": rejected}
    raise DataError(f"{at}: a row to score needs field 'messages' (a chat ending with the "
                    f"assistant reply) or 'chosen' and 'rejected' (a preference row); found "
                    f"fields {sorted(row)}")


def load(folder: str, dtype: str, device: str | None, trust_remote_code: bool):
    """(tokenizer, model in eval mode, device) of a reward model's folder; DataError when the
    folder is not one."""
    try:
        config = read_config(folder)
    except (OSError, ValueError) as e:
        raise DataError(f"--model {folder}: {e}") from None
    if not is_reward_model_config(config):
        raise DataError(f"--model {folder} is not a reward model: its config.json names "
                        f"{config.get('architectures')} with num_labels "
                        f"{config.get('num_labels')}; a *ForSequenceClassification with "
                        "num_labels 1 is (convert mcore-to-hf writes one from an rm run)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    return load_tokenizer(folder, trust_remote_code), model.to(device).eval(), device


def score_rows(args) -> list[dict]:
    """One result per row (module docstring), in file order."""
    tokenizer, model, device = load(args.model, args.dtype, args.device, args.trust_remote_code)
    out = []
    for n, (path, line, row) in enumerate(read_rows(args.data)):
        if args.limit is not None and n >= args.limit:
            break
        result = {"row": n + 1}
        for name, ids in row_ids(row, tokenizer, where(path, line)).items():
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=device)).logits
            result[name] = float(logits[0, 0].float())
        if "chosen" in result:
            result["margin"] = result["chosen"] - result["rejected"]
        out.append(result)
    return out


def summary(results: list[dict]) -> str:
    pairs = [r for r in results if "margin" in r]
    text = f"scored {len(results)} row{'s' * (len(results) != 1)}"
    if pairs:
        accuracy = sum(r["margin"] > 0 for r in pairs) / len(pairs)
        margin = sum(r["margin"] for r in pairs) / len(pairs)
        text += (f"; {len(pairs)} pair{'s' * (len(pairs) != 1)}: accuracy {accuracy:.4f} (chosen scored above "
                 f"rejected), mean margin {margin:.4f}")
    return text


def main(args, prog: str = "python -m engine.rm score") -> int:
    """Score `args` (engine.rm.__main__.score_parser's flags, parsed there before this module
    and transformers load); the exit code."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(f"error: {prog} runs in one process (WORLD_SIZE="
              f"{os.environ['WORLD_SIZE']}); drop --nproc-per-node", file=sys.stderr)
        return 2
    try:
        results = score_rows(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    text = "".join(json.dumps(r) + "\n" for r in results)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(summary(results), file=sys.stderr, flush=True)
    return 0
