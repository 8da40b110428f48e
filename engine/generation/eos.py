"""The stop tokens of a checkpoint: one rule for every rollout backend (hf, vllm).

A response ends at any id of the union of
- config.json's `eos_token_id` (top level, and `text_config`'s for a wrapper checkpoint),
- generation_config.json's `eos_token_id`,
- the tokenizer's `eos_token_id` (a checkpoint whose end-of-turn token only its tokenizer
  declares stops there too, as transformers' and vLLM's own generation do).
Each field may be an int, a list of ints or absent. An empty union is refused by the backends
(generation could never stop with finish_reason "stop").
"""
from __future__ import annotations

import json
import os

from models.hf.custom_code import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def as_id_list(value) -> list[int]:
    """An eos field (None, an int or a list of ints) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def folder_tokenizer(hf_path: str, trust_remote_code: bool = False):
    """The tokenizer of the local folder `hf_path`, or None when it has no tokenizer files
    (nothing is downloaded)."""
    if not any(os.path.isfile(os.path.join(hf_path, n)) for n in TOKENIZER_FILES):
        return None
    return load_tokenizer(hf_path, trust_remote_code)


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def eos_token_ids(hf_path: str, tokenizer=None) -> list[int]:
    """The sorted union of the folder's eos ids (module docstring); `tokenizer`: the folder's
    tokenizer, or None when it has none."""
    config = _json(os.path.join(hf_path, "config.json"))
    ids = as_id_list(config.get("eos_token_id"))
    ids += as_id_list((config.get("text_config") or {}).get("eos_token_id"))
    ids += as_id_list(_json(os.path.join(hf_path, "generation_config.json")).get("eos_token_id"))
    if tokenizer is not None:
        ids += as_id_list(tokenizer.eos_token_id)
    return sorted(set(ids))


def no_eos_message(hf_path: str) -> str:
    return (f"{hf_path}: no eos_token_id in config.json, generation_config.json or the "
            "tokenizer; generation could never stop with finish_reason 'stop'")
