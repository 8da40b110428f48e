"""Training samples: rendering rows with the chat template, SFT datasets, the global-batch order.

Conventions:
- A row renders to ``ids`` (the full token sequence) and ``trained`` (1 where ids[t] is a token
  the model learns to produce: assistant turns, or response + eos).
- A rendered row of n ids becomes a Sample of length L = n - 1 by the next-token shift:
  ``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask = trained[1:]``. Later stages
  (batching, CP sharding) never shift again.
- The order of samples in optimizer step k depends only on (dataset size, global batch size,
  k, seed, shuffle), never on the parallel layout; see global_batch_indices.
"""
from __future__ import annotations

import array
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine.data_files import DataError, as_file_list, read_rows, where as where_of

__all__ = ["DataError", "Sample", "SFTDataset", "read_rows", "render_sft_row", "render_messages",
           "render_prompt", "load_sft_dataset", "global_batch_indices", "load_prompt_rows",
           "TRUNCATION_CHOICES"]

TRUNCATION_CHOICES = ("right", "error")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Sample:
    """One training sequence after the next-token shift; all three lists have length L."""

    tokens: list[int]     # model input ids
    labels: list[int]     # labels[t] = rendered_ids[t + 1]
    loss_mask: list[int]  # 1 where labels[t] is a trained token

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.labels) == len(self.loss_mask):
            raise ValueError(f"Sample lists differ in length: tokens {len(self.tokens)}, "
                             f"labels {len(self.labels)}, loss_mask {len(self.loss_mask)}")

    @property
    def num_loss_tokens(self) -> int:
        """Number of trained label positions (sum of loss_mask)."""
        return int(sum(self.loss_mask))


# ----------------------------------------------------------------------------- rendering

def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer (model.hf_path) has no eos token; prompt/response rows "
                        "need one to end the response")
    return int(tokenizer.eos_token_id)


def _chat_template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the tokenizer (model.hf_path) has no chat template; rows with "
                        "messages or prompts are rendered with it")
    return template if isinstance(template, str) else "\n".join(map(str, template.values()))


def _check_messages(value: Any, field: str, where: str) -> list[dict]:
    """`value` as a chat: a non-empty list of {"role": str, "content": str, ...} dicts."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages, got "
                        f"{type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and "
                            f"'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {field}[{i}] is missing field {key!r}")
            if not isinstance(m[key], str):
                raise DataError(f"{where}: {field}[{i}].{key} must be a string, got "
                                f"{type(m[key]).__name__}")
    return value


def _template(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool,
              assistant_mask: bool = False) -> dict:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=assistant_mask)
    except Exception as e:  # jinja raise_exception / undefined access: a problem of this row
        raise DataError(f"{where}: chat template failed: {e}") from e


def render_messages(messages: list[dict], tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Render a chat; trained = 1 on assistant turns (content and closing eos), 0 elsewhere.

    With ``{% generation %}`` blocks in the template, the mask is transformers' assistant mask.
    Without them, assistant turn i spans from the end of the rendering of messages[:i] with the
    generation prompt to the end of messages[:i+1], cut after its last eos token; a template
    whose renderings are not prefixes of each other raises DataError (it needs generation tags).
    """
    messages = _check_messages(messages, "messages", where)
    if _GENERATION_TAG.search(_chat_template_text(tokenizer)):
        out = _template(tokenizer, messages, where, False, assistant_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    ids = list(_template(tokenizer, messages, where, False)["input_ids"])
    trained = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = list(_template(tokenizer, messages[:i], where, True)["input_ids"]) if i else []
        upto = list(_template(tokenizer, messages[: i + 1], where, False)["input_ids"])
        if upto[: len(head)] != head or ids[: len(upto)] != upto:
            raise DataError(f"{where}: the chat template does not render conversations as "
                            "prefixes of each other; add {% generation %} tags to mark "
                            "assistant turns")
        end = len(upto)
        span = upto[len(head):]
        if eos is not None and eos in span:
            end = len(head) + len(span) - span[::-1].index(eos)
        trained[len(head):end] = [1] * (end - len(head))
    return ids, trained


def render_prompt(prompt: Any, tokenizer, where: str = "prompt") -> list[int]:
    """Ids of a prompt ready for generation: a string is one user message, a list is a chat;
    rendered with the chat template and add_generation_prompt=True."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = _check_messages(prompt, "prompt", where)
    else:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of messages, got "
                        f"{type(prompt).__name__}")
    return list(_template(tokenizer, messages, where, True)["input_ids"])


def render_sft_row(row: dict, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(ids, trained) of one SFT row.

    ``{"messages": [...]}``: the chat template renders it; assistant turns are trained.
    ``{"prompt": str | messages, "response": str}``: prompt ids (generation prompt added, not
    trained) + response ids + eos (trained; eos not repeated if the response already ends in it).
    Raises DataError naming `where` and the missing or invalid field.
    """
    if "messages" in row:
        return render_messages(row["messages"], tokenizer, where)
    if "prompt" not in row and "response" not in row:
        raise DataError(f"{where}: row needs field 'messages', or fields 'prompt' and "
                        f"'response'; found fields {sorted(row)}")
    for key in ("prompt", "response"):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
    response = row["response"]
    if not isinstance(response, str):
        raise DataError(f"{where}: field 'response' must be a string, got "
                        f"{type(response).__name__}")
    prompt_ids = render_prompt(row["prompt"], tokenizer, where)
    response_ids = list(tokenizer.encode(response, add_special_tokens=False))
    eos = _eos_id(tokenizer)
    if not response_ids or response_ids[-1] != eos:
        response_ids.append(eos)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


# ----------------------------------------------------------------------------- SFT dataset

class SFTDataset:
    """Rendered, shifted SFT samples held in flat arrays (built by load_sft_dataset).

    ``lengths[i]`` (sample length L) and ``loss_tokens[i]`` (trained positions) are numpy int64
    arrays, so any rank can get the shape and counts of a whole global batch without building
    Samples. ``stats``: rows read, truncated, dropped_empty (rendered to fewer than 2 ids, no
    sample possible) and empty_loss (kept, but no trained token). ``seq_length`` and
    ``truncation``: the limits it was loaded with (None when not given), named by describe().
    """

    def __init__(self, ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray,
                 stats: dict[str, int], seq_length: int | None = None,
                 truncation: str | None = None):
        self._ids = ids
        self._trained = trained
        self._offsets = offsets
        self.stats = stats
        self.seq_length, self.truncation = seq_length, truncation
        self.lengths = (np.diff(offsets) - 1).astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
        starts = offsets[:-1] + 1  # the first rendered id never is a label
        self.loss_tokens = cum[offsets[1:]] - cum[starts]

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def describe(self) -> str:
        """One line for the run log with every count of `stats`: samples kept, rows truncated
        (with the limit and data.truncation), dropped, and kept without a trained token."""
        s = self.stats
        limit = (f"longer than train.seq_length={self.seq_length} tokens, cut on the "
                 f"{self.truncation}" if self.seq_length else "cut to the length limit")
        return (f"{len(self)} samples from {s['rows']} rows; truncated: {s['truncated']} "
                f"({limit}); dropped: {s['dropped_empty']} (under 2 tokens); "
                f"no trained token: {s['empty_loss']} (kept)")

    def __getitem__(self, i: int) -> Sample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        i = i % len(self)
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = self._ids[a:b].tolist()
        return Sample(tokens=ids[:-1], labels=ids[1:],
                      loss_mask=self._trained[a + 1:b].astype(np.int64).tolist())


def load_sft_dataset(files: str | Sequence[str], tokenizer, seq_length: int,
                     truncation: str = "right") -> SFTDataset:
    """Read and render every row of `files` once into an SFTDataset.

    A rendered row may have at most seq_length + 1 ids (a Sample of at most seq_length tokens).
    Longer rows: truncation="right" keeps the first seq_length + 1 ids (stats["truncated"]);
    truncation="error" raises DataError with file:line and both lengths. Rows that end up with
    no trained token are kept and counted in stats["empty_loss"]. Raises DataError (naming the
    files and what to change) when no sample is left, or no sample has a trained token.
    Messages name the config keys train.seq_length and data.truncation.
    """
    if truncation not in TRUNCATION_CHOICES:
        raise ValueError(f"truncation={truncation!r} is not one of {', '.join(TRUNCATION_CHOICES)}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    paths = as_file_list(files)
    max_ids = int(seq_length) + 1
    ids_buf, trained_buf, offsets = array.array("q"), array.array("b"), [0]
    stats = {"rows": 0, "truncated": 0, "dropped_empty": 0, "empty_loss": 0}
    longest = 0
    for path, line, row in read_rows(paths):
        loc = where_of(path, line)
        stats["rows"] += 1
        ids, trained = render_sft_row(row, tokenizer, loc)
        longest = max(longest, len(ids))
        if len(ids) > max_ids:
            if truncation == "error":
                raise DataError(f"{loc}: rendered row has {len(ids)} tokens, more than "
                                f"train.seq_length + 1 = {max_ids} (data.truncation=error); "
                                f"raise train.seq_length, shorten the row, or set "
                                f"data.truncation=right to cut long rows")
            ids, trained = ids[:max_ids], trained[:max_ids]
            stats["truncated"] += 1
        if len(ids) < 2:
            stats["dropped_empty"] += 1
            continue
        if not any(trained[1:]):
            stats["empty_loss"] += 1
        ids_buf.extend(ids)
        trained_buf.extend(trained)
        offsets.append(len(ids_buf))
    _check_not_empty(paths, stats, int(seq_length), longest)
    return SFTDataset(np.frombuffer(ids_buf, dtype=np.int64).copy(),
                      np.frombuffer(trained_buf, dtype=np.int8).copy(),
                      np.asarray(offsets, dtype=np.int64), stats,
                      seq_length=int(seq_length), truncation=truncation)


def _check_not_empty(paths: list[str], stats: dict[str, int], seq_length: int,
                     longest: int) -> None:
    """Raise DataError when load_sft_dataset kept no sample, or no sample with a trained
    token (a run that would train nothing), saying why and what to change. `longest`: the
    most ids a row rendered to."""
    files = ", ".join(paths)
    kept = stats["rows"] - stats["dropped_empty"]
    if stats["rows"] == 0:
        raise DataError(f"no training samples in {files}: the files hold no rows")
    if kept == 0:
        raise DataError(f"no training samples in {files}: all {stats['rows']} rows were "
                        "dropped (they render to fewer than 2 tokens)")
    if stats["empty_loss"] == kept:
        cause = (f"{stats['truncated']} rows were cut to train.seq_length={seq_length} tokens "
                 f"(the longest needs {longest - 1}); raise train.seq_length"
                 if stats["truncated"] else "rows need an assistant message or a response")
        raise DataError(f"no training samples with a trained token in {files}: none of the "
                        f"{kept} samples has an assistant/response token left; {cause}")


def global_batch_indices(num_samples: int, global_batch_size: int, step: int, seed: int,
                         shuffle: bool) -> list[int]:
    """Dataset indices of optimizer step `step` (0-based), in order.

    The index stream is epoch 0, epoch 1, ... concatenated; epoch e is
    ``np.random.default_rng([seed, e]).permutation(num_samples)`` (``range(num_samples)`` when
    shuffle is False). Step k takes stream[k * gbs : (k + 1) * gbs], so a batch may span an epoch
    boundary, and resuming at step k needs nothing but k.
    """
    if num_samples < 1 or global_batch_size < 1 or step < 0 or seed < 0:
        raise ValueError(f"need num_samples >= 1, global_batch_size >= 1, step >= 0, seed >= 0; "
                         f"got {num_samples}, {global_batch_size}, {step}, {seed}")
    start, stop = step * global_batch_size, (step + 1) * global_batch_size
    out: list[int] = []
    for epoch in range(start // num_samples, (stop - 1) // num_samples + 1):
        order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
                 else np.arange(num_samples))
        lo = max(start - epoch * num_samples, 0)
        hi = min(stop - epoch * num_samples, num_samples)
        out.extend(int(x) for x in order[lo:hi])
    return out


# ----------------------------------------------------------------------------- RL prompts

def load_prompt_rows(files: str | Sequence[str], locations: list | None = None) -> list[dict]:
    """RL prompt rows ``{"prompt": str | messages, "answer": str, ...extra fields kept}``.

    An integer answer is turned into its decimal string. Raises DataError with file:line for a
    missing or invalid prompt/answer, and naming the files when there is no row at all. When
    `locations` is a list, the "file:line" of every row is appended to it.
    """
    paths = as_file_list(files)
    rows: list[dict] = []
    for path, line, row in read_rows(paths):
        loc = where_of(path, line)
        if locations is not None:
            locations.append(loc)
        for key in ("prompt", "answer"):
            if key not in row:
                raise DataError(f"{loc}: missing field {key!r}")
        prompt, answer = row["prompt"], row["answer"]
        if isinstance(prompt, list):
            _check_messages(prompt, "prompt", loc)
        elif not isinstance(prompt, str):
            raise DataError(f"{loc}: field 'prompt' must be a string or a list of messages, "
                            f"got {type(prompt).__name__}")
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(f"{loc}: field 'answer' must be a string, got "
                            f"{type(answer).__name__}")
        rows.append({**row, "answer": answer})
    if not rows:
        raise DataError(f"no prompt rows in {', '.join(paths)}")
    return rows
