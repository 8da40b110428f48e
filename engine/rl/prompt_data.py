"""The RL prompt rows of a set of files (data.train_files, data.val_files), rendered through
the data cache and fitted to the length limit, the same way for training and validation."""
from __future__ import annotations

from engine.data.datasets import load_prompt_rows
from engine.rl.env.tools_env import tool_schemas
from engine.rl.rollout_batch import fit_prompt_rows


def prompt_rows(cfg, tokenizer, files: list[str], key: str = "data.train_files"
                ) -> tuple[list[dict], list[list[int]]]:
    """The prompt rows of `files` (the config key `key`) and their rendered ids, rendered once
    per node into the data cache (data.cache_dir, data.num_workers; env.fn=tools: with the tool
    schemas) and fitted to the length limit (engine.rl.rollout_batch.fit_prompt_rows)."""
    locations: list[str] = []
    rendered: list[list[int]] = []
    rows = load_prompt_rows(files, locations, tokenizer=tokenizer, prompt_ids=rendered,
                            cache_dir=cfg.data.cache_dir, num_workers=cfg.data.num_workers,
                            tools=tool_schemas(cfg))
    return fit_prompt_rows(rows, locations, tokenizer, cfg, rendered, key=key)
