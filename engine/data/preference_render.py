"""A preference row rendered into two token sequences that share their prompt.

A side renders as SFT renders the chat prompt + side (engine.data.render.render_chat: the
model's chat template; the trained tokens of an assistant turn are its content, reasoning where
rendered, tool calls and the end-of-turn token, never the header). Of those trained tokens a
side keeps the ones at or after the prompt boundary: the tokens the rendering shares with the
prompt rendered alone with the generation prompt (as TRL's common_prefix_length finds it). The
prompt's own assistant turns lie before it and are context, not trained. For a prompt without
assistant turns a side's (ids, trained) are exactly render_sft_row({"messages": prompt + side}).

A side's prompt is its tokens before its first kept trained token; the two sides' prompts must
be equal token for token. Refused (DataError, ``file:line``): a side whose template marks no
token of its reply as trained, sides whose prompts differ, sides that render identically, a
prompt longer than seq_length (no completion token could be trained), and with
truncation="error" a side longer than seq_length + 1 ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.data.files import DataError
from engine.data.preference_rows import read_preference_row
from engine.data.render import render_chat, render_prompt
from engine.data.rows import Chat


@dataclass
class RenderedSide:
    """One side's rendering: ids (prompt + completion), trained (uint8, 1 on the side's
    completion tokens only) and truncated (True when cut to the length limit)."""

    ids: list[int]
    trained: np.ndarray
    truncated: bool = False


@dataclass
class RenderedPair:
    """A rendered preference row: both sides, the shared prompt length in tokens, the margin
    (None when the row has none) and the row's format (preference_rows.FORM_NAMES)."""

    chosen: RenderedSide
    rejected: RenderedSide
    prompt_length: int
    margin: float | None
    form: str

    @property
    def differ_at(self) -> int:
        """The first token index where the sides' ids differ (the shorter length if one side
        is a prefix of the other)."""
        return _common_prefix(self.chosen.ids, self.rejected.ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def render_side(prompt: list[dict], tools: list[dict] | None, side: list[dict],
                prompt_ids: list[int], tokenizer, field: str, where: str
                ) -> tuple[RenderedSide, int]:
    """(prompt + `side` rendered, its prompt length: the index of its first kept trained
    token); `prompt_ids`: the prompt rendered alone with the generation prompt. Shared with
    unpaired rows (engine.data.preference_unpaired)."""
    ids, trained = render_chat(Chat(prompt + side, tools), tokenizer, where)
    ids, trained = list(ids), np.array(trained, dtype=np.uint8)
    trained[:_common_prefix(prompt_ids, ids)] = 0    # the prompt's assistant turns
    kept = np.flatnonzero(trained)
    if len(kept) == 0:
        raise DataError(f"{where}: field {field!r}: the chat template marks no token of the "
                        "side's assistant message(s) as trained, so it has no completion")
    if kept[0] == 0:
        raise DataError(f"{where}: field {field!r}: the prompt renders to no token")
    return RenderedSide(ids, trained), int(kept[0])


def _first_difference(tokenizer, a: list[int], b: list[int]) -> str:
    k = _common_prefix(a, b)
    shown = [repr(tokenizer.decode(x[k:k + 8])) for x in (a, b)]
    return f"token {k}: chosen {shown[0]} vs rejected {shown[1]}"


def render_preference_row(row: dict, tokenizer, where: str) -> RenderedPair:
    """Both sides of `row` rendered and checked (module docstring), not yet cut to a length
    limit (fit_pair does that). DataError naming `where` for every refusal."""
    parsed = read_preference_row(row, where)
    prompt_ids = render_prompt(parsed.prompt, tokenizer, where, parsed.tools)
    chosen, pc = render_side(parsed.prompt, parsed.tools, parsed.chosen, prompt_ids,
                             tokenizer, "chosen", where)
    rejected, pr = render_side(parsed.prompt, parsed.tools, parsed.rejected, prompt_ids,
                               tokenizer, "rejected", where)
    if chosen.ids[:pc] != rejected.ids[:pr]:
        raise DataError(f"{where}: the chosen and rejected sides render different prompts "
                        f"({pc} and {pr} tokens before their first completion token; they "
                        f"differ at {_first_difference(tokenizer, chosen.ids, rejected.ids)}); "
                        "both sides must continue the same prompt")
    if chosen.ids == rejected.ids:
        raise DataError(f"{where}: the chosen and rejected sides are identical after "
                        f"rendering ({len(chosen.ids)} tokens); a preference pair needs two "
                        "different replies")
    return RenderedPair(chosen, rejected, pc, parsed.margin, parsed.form)


def fit_pair(pair: RenderedPair, seq_length: int, truncation: str, where: str) -> RenderedPair:
    """`pair` with each side at most seq_length + 1 ids (a Sample of at most seq_length
    tokens). A prompt of more than seq_length tokens is refused (no completion token would
    remain). Longer sides: truncation="right" cuts them on the right (the prompt stays, at least
    one completion token remains; RenderedSide.truncated set), "error" refuses them; sides
    that are identical once cut are refused (as identical renderings are by
    render_preference_row). Messages name train.seq_length and data.truncation."""
    if pair.prompt_length > seq_length:
        raise DataError(f"{where}: the prompt renders to {pair.prompt_length} tokens, more "
                        f"than train.seq_length={seq_length}, so no completion token would fit; "
                        "raise train.seq_length or shorten the prompt")
    max_ids = seq_length + 1
    differ_at = pair.differ_at
    for field in ("chosen", "rejected"):
        side: RenderedSide = getattr(pair, field)
        if len(side.ids) <= max_ids:
            continue
        if truncation == "error":
            raise DataError(f"{where}: the {field} side renders to {len(side.ids)} tokens, "
                            f"more than train.seq_length + 1 = {max_ids} "
                            "(data.truncation=error); raise train.seq_length, shorten the "
                            "row, or set data.truncation=right to cut long sides")
        setattr(pair, field, RenderedSide(side.ids[:max_ids], side.trained[:max_ids], True))
    if pair.chosen.ids == pair.rejected.ids:   # the sides differed only beyond the cut
        raise DataError(f"{where}: the chosen and rejected sides are identical after "
                        f"truncation to train.seq_length + 1 = {max_ids} tokens (they first "
                        f"differ at token {differ_at}); a preference pair needs two "
                        "different replies: raise train.seq_length or shorten the row")
    return pair
