"""The RL prompt rows of a set of files (data.train_files, data.val_files), rendered through
the data cache and fitted to the length limit, the same way for training and validation."""
from __future__ import annotations

import torch.distributed as dist

from engine.data.datasets import load_prompt_rows, render_prompt
from engine.data.files import DataError
from engine.data.images import image_context
from models.hf.io import read_config
from models.vision.inputs import ImagePrompt
from models.vision.spec import vision_spec
from engine.rl.env.tools_env import tool_schemas
from engine.rl.rewards.code_tests import tests_problem


def prompt_rows(cfg, tokenizer, files: list[str], key: str = "data.train_files"
                ) -> tuple[list[dict], list[list[int]]]:
    """The prompt rows of `files` (the config key `key`) and their rendered ids, rendered once
    per node into the data cache (data.cache_dir, data.num_workers; env.fn=tools: with the tool
    schemas; a model with a vision tower: images processed, ImagePrompts) and fitted to the
    length limit (`fit_prompt_rows`). Multi-turn environments refuse prompts with images;
    reward.fn=code refuses a row whose tests cannot be read (DataError naming file:line)."""
    locations: list[str] = []
    rendered: list[list[int]] = []
    images = image_context(cfg.model.hf_path, vision_spec(read_config(cfg.model.hf_path)))
    rows = load_prompt_rows(files, locations, tokenizer=tokenizer, prompt_ids=rendered,
                            cache_dir=cfg.data.cache_dir, num_workers=cfg.data.num_workers,
                            tools=tool_schemas(cfg), images=images)
    if getattr(getattr(cfg, "env", None), "fn", None):
        with_images = [loc for loc, ids in zip(locations, rendered)
                       if isinstance(ids, ImagePrompt)]
        if with_images:
            raise DataError(f"{with_images[0]}: the prompt has images, and env.fn="
                            f"{cfg.env.fn} runs multi-turn episodes, which take text prompts "
                            "and observations only (docs/vlm.md)")
    if cfg.reward.fn == "code":   # checked before any compute: a row without tests
        for row, loc in zip(rows, locations):
            problem = tests_problem(row)
            if problem is not None:
                raise DataError(f"{loc}: reward.fn=code: {problem}")
    return fit_prompt_rows(rows, locations, tokenizer, cfg, rendered, key=key)


def fit_prompt_rows(rows: list[dict], locations: list[str], tokenizer, cfg,
                    rendered: list[list[int]] | None = None, key: str = "data.train_files"
                    ) -> tuple[list[dict], list[list[int]]]:
    """The prompt rows whose rendered prompt leaves room for rollout.max_new_tokens within
    train.seq_length (at most seq_length + 1 - max_new_tokens tokens), and their rendered ids
    (for RolloutCollector's `prompt_ids`, so no prompt is rendered twice). Over-long rows follow
    data.truncation: "right" drops them (a prompt cut short would lose its question; the count
    is printed on rank 0), "error" raises DataError naming file:line. Every rank calls it with
    the same rows (the prompt count is part of the checkpointed data position). `rendered`:
    the rows' prompt ids from the data cache (engine.data.datasets.load_prompt_rows `prompt_ids`);
    without it every prompt is rendered here. `key` names the rows' files in messages."""
    limit = cfg.train.seq_length + 1 - cfg.rollout.max_new_tokens
    kept, kept_ids, dropped, lengths = [], [], [], []
    for i, (row, loc) in enumerate(zip(rows, locations)):
        ids = (rendered[i] if rendered is not None
               else render_prompt(row["prompt"], tokenizer, where=loc))
        n = len(ids)
        lengths.append((n, loc))
        if n <= limit:
            kept.append(row)
            kept_ids.append(ids)
            continue
        if cfg.data.truncation == "error":
            raise DataError(
                f"{loc}: the prompt renders to {n} tokens; with rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens} and train.seq_length={cfg.train.seq_length} "
                f"prompts may have at most {limit} tokens (data.truncation=error). Raise "
                "train.seq_length, lower rollout.max_new_tokens, or set data.truncation=right "
                "to drop such prompts")
        dropped.append(loc)
    if dropped and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"[rl] dropped {len(dropped)} of {len(rows)} prompts longer than {limit} tokens "
              f"(data.truncation=right), first at {dropped[0]}", flush=True)
    if not kept:
        raise DataError(f"every prompt of {key} is longer than {limit} tokens "
                        f"(train.seq_length={cfg.train.seq_length} + 1 - rollout.max_new_tokens"
                        f"={cfg.rollout.max_new_tokens}){_lengths_seen(lengths, cfg)}")
    return kept, kept_ids


def _lengths_seen(lengths: list[tuple[int, str]], cfg) -> str:
    """What fit_prompt_rows' refusal says of the rendered prompts: their count, the shortest
    and the longest with file:line, and the train.seq_length the shortest needs."""
    if not lengths:
        return "; there is no prompt row"
    (short, first), (long, last) = (min(lengths, key=lambda x: x[0]),
                                     max(lengths, key=lambda x: x[0]))
    return (f": its {len(lengths)} prompts render to {short} ({first}) to {long} ({last}) "
            f"tokens; raise train.seq_length to at least "
            f"{short + cfg.rollout.max_new_tokens - 1} or lower rollout.max_new_tokens")
