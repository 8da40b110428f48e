"""Observations rendered by the model's own chat template, token-in/token-out.

A trajectory is the rendered prompt, each assistant turn's sampled ids exactly as generated, and
after each turn the ids of OBSERVATION_SUFFIX: what the template adds after an assistant turn
for the new messages, plus the next assistant header (the generation prompt). It is computed
from one rendering of the conversation with a placeholder in every assistant turn:

    render(messages + [assistant: P] + new, add_generation_prompt=True)
    = ... P <end-of-turn> | suffix

The suffix is everything after the end-of-turn marker (engine.data.render.template_info) that
follows the last placeholder; the model sampled its own end-of-turn token, so what the template
puts after it (e.g. Qwen's "\\n" after <|im_end|>) belongs to the suffix. Only the suffix is
tokenized (special tokens in it map to their ids); sampled ids are never re-tokenized, and a
template that rewrites earlier turns (Qwen3 drops old reasoning once a user message follows)
changes nothing already in the trajectory: the rewritten part lies before the placeholder's
end-of-turn and is never used.
"""
from __future__ import annotations

from engine.data.render import template_info
from engine.errors import RunError

PLACEHOLDER = "Zq9PlaceholderTurnZq9"


def conversation_start(prompt) -> list[dict]:
    """The conversation of a prompt row (a string is one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def observation_text(tokenizer, messages: list[dict], new: list[dict],
                     tools: list[dict] | None = None) -> str:
    """The template's text after an assistant turn that closes `messages` (see the module
    docstring): the rendering of `new` plus the next assistant header. `messages` may hold
    earlier assistant turns (their content does not matter: only the text after the last
    placeholder is used)."""
    info = template_info(tokenizer)
    eot = info.end_of_turn
    if not eot:
        raise RunError("the chat template of model.hf_path closes assistant turns with no "
                       "marker that can be found (eos or an added token); multi-turn episodes "
                       "cannot place observations after a turn")
    chat = [_placeholder(m) for m in messages] + [
        {"role": "assistant", "content": PLACEHOLDER}] + list(new)
    text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    at = text.rfind(PLACEHOLDER)
    end = text.find(eot, at + len(PLACEHOLDER)) if at >= 0 else -1
    if end < 0:
        raise RunError(f"the chat template of model.hf_path does not render an assistant turn "
                       f"as its content followed by {eot!r}; multi-turn episodes need that to "
                       "place observations after a turn")
    return text[end + len(eot):]


def observation_ids(tokenizer, messages: list[dict], new: list[dict],
                    tools: list[dict] | None = None) -> list[int]:
    """Ids of observation_text (special tokens in it encoded as their ids, no bos added)."""
    return list(tokenizer.encode(observation_text(tokenizer, messages, new, tools),
                                 add_special_tokens=False))


def _placeholder(message: dict) -> dict:
    """Earlier assistant turns render with a placeholder too (their decoded text could contain
    template syntax such as "</think>" that the template would re-interpret)."""
    if message.get("role") == "assistant":
        return {"role": "assistant", "content": PLACEHOLDER}
    return message
