"""Which token a reward model scores, in one place (docs/preference.md#reward-models).

A side or a chat is rendered with the model's chat template (engine.data.render: the trained
tokens are the assistant turns' own tokens, their end-of-turn token included). A reward model
reads the rendering up to and including its LAST trained id, the end-of-turn token of the last
assistant turn (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3.1), and its score is the score
head's value on that id. What the template renders after it (ChatML's trailing newline) is never
read: RL's responses end on that token, training scores it (engine.rm.training.scored_ids), and
the export's chat template stops there (tools/convert_reward_template.py), so transformers'
`apply_chat_template` on the exported folder gives exactly these ids.

- `scored_length(trained)`: how many ids of a rendering the model reads;
- `chat_scored_ids(messages, tokenizer, where, tools)`: the ids of a chat whose last message is
  the assistant reply to score (DataError naming `where` otherwise);
- `pair_scored_ids(row, tokenizer, where)`: (chosen ids, rejected ids) of a preference row in
  any of the formats engine.rm trains on, rendered as training renders it (no length cut).
"""
from __future__ import annotations

from typing import Sequence

from engine.data.files import DataError
from engine.data.preference_render import render_preference_row
from engine.data.render import render_messages
from engine.data.rows import check_messages


def scored_length(trained: Sequence[int]) -> int:
    """The number of leading ids of a rendering the reward model reads: through its last
    trained id (`trained[i]` set: id i is trained); all of them when none is trained."""
    last = next((i for i in range(len(trained) - 1, -1, -1) if trained[i]), None)
    return len(trained) if last is None else last + 1


def chat_scored_ids(messages, tokenizer, where: str, tools: list[dict] | None = None
                    ) -> list[int]:
    """The ids a reward model reads of the chat `messages` (its last message the assistant
    reply to score): the rendering cut after the reply's end-of-turn token."""
    messages = check_messages(messages, "messages", where)
    if not messages or messages[-1]["role"] != "assistant":
        last = messages[-1]["role"] if messages else "none"
        raise DataError(f"{where}: the last message must be the assistant reply to score "
                        f"(found role {last!r})")
    ids, trained = render_messages(messages, tokenizer, where, tools)
    if not any(trained):
        raise DataError(f"{where}: the chat template marks no token of the assistant reply as "
                        "trained, so there is no end-of-turn token to score")
    return ids[:scored_length(trained)]


def pair_scored_ids(row: dict, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(chosen ids, rejected ids) a reward model reads of the preference row `row`, rendered
    and checked as engine.rm's data loader renders it (engine.data.preference_render)."""
    pair = render_preference_row(row, tokenizer, where)
    return tuple(side.ids[:scored_length(side.trained)]
                 for side in (pair.chosen, pair.rejected))
