"""TRL's SFT dataset formats, rendered as TRL 1.16's SFTTrainer prepares them.

- Language modelling ``{"text": str}``: the text, with the eos token's text appended unless it
  already ends with it, tokenized as plain text (`tokenizer(text=...)`: the tokenizer's own
  special tokens, e.g. a BOS, included; no chat template). Every token is trained.
- Prompt-completion, standard ``{"prompt": str, "completion": str}``: `tokenizer(text=prompt)`
  and `tokenizer(text=prompt + completion + eos text)` (eos appended as above, to the
  completion); no chat template.
- Prompt-completion, conversational ``{"prompt": [messages], "completion": [messages]}`` (and
  optional ``tools``): the chat template renders the prompt with the generation prompt, and
  prompt + completion without it; no eos appended (the template closes the turn).

In both prompt-completion forms the completion is what follows the longest common prefix of the
two tokenizations (TRL's `common_prefix_length`: a template may render the prompt alone
differently), and only the completion is trained: TRL's default `completion_only_loss`. The
engine's own ``{"prompt", "response"}`` rows (a chat-rendered prompt, engine.data.render) stay
as they are; a row with both "response" and "completion" is refused.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from engine.data.files import DataError
from engine.data.rows import check_messages, check_tools

TEXT_FIELD = "text"   # TRL's SFTConfig.dataset_text_field default


def trl_format(row: dict) -> str | None:
    """"language-modeling" for a ``{"text"}`` row, "prompt-completion" for a row with a
    "completion", else None (the engine's own formats). A null field counts as absent (a
    Parquet file mixing row kinds gives every row every column)."""
    if row.get("completion") is not None:
        return "prompt-completion"
    if row.get(TEXT_FIELD) is not None and row.get("prompt") is None \
            and row.get("response") is None:
        return "language-modeling"
    return None


def _eos_text(tokenizer) -> str:
    if not tokenizer.eos_token:
        raise DataError("the tokenizer (model.hf_path) has no eos token; text and "
                        "prompt-completion rows end with it")
    return tokenizer.eos_token


def _text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text=text)["input_ids"])


def _chat_ids(tokenizer, messages: list[dict], where: str, tools, generation: bool
              ) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                            return_dict=True, add_generation_prompt=generation)
    except Exception as e:  # jinja raise_exception / undefined access: a problem of this row
        raise DataError(f"{where}: chat template failed: {e}") from e
    return list(out["input_ids"])


def _string(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _prompt_completion(row: dict, tokenizer, where: str) -> tuple[list[int], np.ndarray]:
    if row.get("response") is not None:
        raise DataError(f"{where}: row has both 'response' (the engine's prompt/response "
                        "format) and 'completion' (TRL's prompt-completion format); keep one")
    if row.get("prompt") is None:
        raise DataError(f"{where}: missing field 'prompt' (a prompt-completion row needs "
                        "'prompt' and 'completion')")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) or isinstance(completion, list):
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DataError(f"{where}: fields 'prompt' and 'completion' must both be strings "
                            "(standard) or both lists of messages (conversational), got "
                            f"{type(prompt).__name__} and {type(completion).__name__}")
        messages = check_messages(prompt, "prompt", where)
        tools = check_tools(row.get("tools"), where)
        prompt_ids = _chat_ids(tokenizer, messages, where, tools, True)
        ids = _chat_ids(tokenizer, messages + check_messages(completion, "completion", where),
                        where, tools, False)
    else:
        prompt, completion = _string(row, "prompt", where), _string(row, "completion", where)
        eos = _eos_text(tokenizer)
        prompt_ids = _text_ids(tokenizer, prompt)
        ids = _text_ids(tokenizer, prompt + completion
                        + ("" if completion.endswith(eos) else eos))
    trained = np.zeros(len(ids), dtype=np.uint8)
    trained[len(os.path.commonprefix([prompt_ids, ids])):] = 1
    return ids, trained


def render_trl_row(row: dict, tokenizer, where: str) -> tuple[list[int], np.ndarray]:
    """(ids, trained uint8 array) of a row of one of TRL's formats (module docstring;
    `trl_format(row)` is not None). DataError names `where` and the bad field."""
    if trl_format(row) == "prompt-completion":
        return _prompt_completion(row, tokenizer, where)
    text: Any = _string(row, TEXT_FIELD, where)
    eos = _eos_text(tokenizer)
    ids = _text_ids(tokenizer, text if text.endswith(eos) else text + eos)
    return ids, np.ones(len(ids), dtype=np.uint8)
