"""Rendering rows with the model's own chat template into ids and a trained mask.

Row formats: engine.data.rows.

Trained tokens of a chat (render_messages): what each assistant turn of the FINAL rendering
emits - content, reasoning where the template renders it, tool calls, and the closing
end-of-turn token - and none of the template's headers. Templates are used as models ship them:
- with ``{% generation %}`` blocks: transformers' assistant-token mask (one render);
- otherwise, linear in turns: one render to text, one tokenization with character offsets.
  The generation prompt G (the text add_generation_prompt appends) opens every assistant turn;
  the k-th occurrence of G is the k-th assistant message, its trained span starts right after
  G and ends after the first end-of-turn marker (the eos token, else the first added token the
  template emits after an assistant message) following the message's content. This holds for
  templates that rewrite earlier turns (Qwen3 drops their reasoning), where renderings of
  prefixes are not prefixes of the full rendering;
- if a template defeats that (G not found once per assistant message, no end-of-turn marker),
  the prefix method: turn i spans from the rendering of messages[:i] with the generation
  prompt to the rendering of messages[:i+1], cut after its last eos (two renders per turn);
  a template whose renderings are not prefixes of each other then raises DataError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.files import DataError
from engine.data.rows import Chat, chat_field, check_messages, check_tools, normalize_chat
from engine.data.trl_rows import render_trl_row, trl_format

# bump when rendering changes what a row becomes (the cache key holds it)
RENDERER_VERSION = 2
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ----------------------------------------------------------------------------- tokenizer facts

def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer (model.hf_path) has no eos token; prompt/response rows "
                        "need one to end the response")
    return int(tokenizer.eos_token_id)


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template source (all named templates joined); DataError if none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the tokenizer (model.hf_path) has no chat template; rows with "
                        "messages or prompts are rendered with it")
    return template if isinstance(template, str) else "\n".join(map(str, template.values()))


@dataclass(frozen=True)
class TemplateInfo:
    """What render_messages needs to know about a tokenizer's chat template (probed once)."""

    generation_tags: bool          # {% generation %} blocks: use transformers' assistant mask
    gen_prompt: str | None         # text add_generation_prompt appends after a user message
    end_of_turn: str | None        # the marker closing an assistant turn
    offsets: bool                  # a fast tokenizer: its encodings map characters to tokens


_INFO: dict[tuple[int, str, str], TemplateInfo] = {}


def template_info(tokenizer) -> TemplateInfo:
    """Probe the chat template with a one-turn chat (cached per tokenizer and template)."""
    text = chat_template_text(tokenizer)
    key = (id(tokenizer), text, str(tokenizer.eos_token))
    if key not in _INFO:
        _INFO[key] = _probe(tokenizer, text)
    return _INFO[key]


def _probe(tokenizer, text: str) -> TemplateInfo:
    tags = bool(_GENERATION_TAG.search(text))
    gen_prompt = end = None
    try:
        user = [{"role": "user", "content": "X"}]
        plain = tokenizer.apply_chat_template(user, tokenize=False)
        with_gen = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        if with_gen.startswith(plain) and len(with_gen) > len(plain):
            gen_prompt = with_gen[len(plain):]
        reply = "Yq7Zr"
        chat = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": reply}],
                                             tokenize=False)
        rest = chat[chat.rfind(reply) + len(reply):] if reply in chat else ""
        eos = tokenizer.eos_token
        if eos and eos in rest:
            end = eos
        else:
            added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
            found = [(rest.find(a), a) for a in added if a and a in rest]
            end = min(found)[1] if found else None
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: prefix method
        gen_prompt = end = None
    fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer")
    return TemplateInfo(tags, gen_prompt, end, bool(fast))


# ----------------------------------------------------------------------------- rendering

def _apply(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool,
           tools: list[dict] | None = None, tokenize: bool = True, assistant_mask: bool = False):
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=tokenize, return_dict=tokenize,
            add_generation_prompt=add_generation_prompt,
            return_assistant_tokens_mask=assistant_mask)
    except Exception as e:  # jinja raise_exception / undefined access: a problem of this row
        raise DataError(f"{where}: chat template failed: {e}") from e


def _linear_spans(text: str, messages: list[dict], info: TemplateInfo
                  ) -> list[tuple[int, int]] | None:
    """Character spans [start, end) of the assistant turns in `text` (see the module
    docstring), or None when the template defeats the G / end-of-turn rule."""
    g, eot = info.gen_prompt, info.end_of_turn
    if not g or not eot:
        return None
    opens, pos = [], text.find(g)
    while pos >= 0:
        opens.append(pos)
        pos = text.find(g, pos + len(g))
    assistants = [m for m in messages if m["role"] == "assistant"]
    if len(opens) != len(assistants):
        return None
    spans = []
    for k, m in enumerate(assistants):
        start = opens[k] + len(g)
        limit = opens[k + 1] if k + 1 < len(opens) else len(text)
        search = start
        content = m.get("content") or ""
        if content:
            at = text.find(content, start, limit)
            if at >= 0:
                search = at + len(content)
        end = text.find(eot, search, limit)
        if end < 0:
            return None
        spans.append((start, end + len(eot)))
    return spans


def _render_linear(chat: Chat, tokenizer, info: TemplateInfo, where: str
                   ) -> tuple[list[int], np.ndarray] | None:
    text = _apply(tokenizer, chat.messages, where, False, chat.tools, tokenize=False)
    spans = _linear_spans(text, chat.messages, info)
    if spans is None:
        return None
    # the tokenization apply_chat_template(tokenize=True) does, without building offset lists
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ids = enc.ids
    trained = np.zeros(len(ids), dtype=np.uint8)

    def first_token_from(c: int) -> int:
        """Index of the first token that starts at character c or later."""
        while c < len(text):
            t = enc.char_to_token(c)
            if t is not None:
                return t if enc.token_to_chars(t)[0] >= c else t + 1
            c += 1  # a character no token covers (e.g. whitespace a pre-tokenizer drops)
        return len(ids)

    for a, b in spans:
        trained[first_token_from(a):first_token_from(b)] = 1
    return ids, trained


def _render_prefixes(chat: Chat, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """The prefix method (two renders per assistant turn); see the module docstring."""
    messages, tools = chat.messages, chat.tools
    ids = list(_apply(tokenizer, messages, where, False, tools)["input_ids"])
    trained = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = list(_apply(tokenizer, messages[:i], where, True, tools)["input_ids"]) if i else []
        upto = list(_apply(tokenizer, messages[: i + 1], where, False, tools)["input_ids"])
        if upto[: len(head)] != head or ids[: len(upto)] != upto:
            raise DataError(f"{where}: the chat template does not render conversations as "
                            "prefixes of each other, and its assistant turns cannot be found "
                            "in the full rendering (each must start with the generation prompt "
                            "and end with the eos token); add {% generation %} tags to mark "
                            "assistant turns")
        end = len(upto)
        span = upto[len(head):]
        if eos is not None and eos in span:
            end = len(head) + len(span) - span[::-1].index(eos)
        trained[len(head):end] = [1] * (end - len(head))
    return ids, trained


def render_chat(chat: Chat, tokenizer, where: str) -> tuple[list[int], np.ndarray]:
    """(ids, trained as uint8 array) of a normalized chat; see the module docstring."""
    info = template_info(tokenizer)
    if info.generation_tags:
        out = _apply(tokenizer, chat.messages, where, False, chat.tools, assistant_mask=True)
        return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
    if info.offsets:
        linear = _render_linear(chat, tokenizer, info, where)
        if linear is not None:
            return linear
    ids, trained = _render_prefixes(chat, tokenizer, where)
    return ids, np.asarray(trained, dtype=np.uint8)


def render_messages(messages: list[dict], tokenizer, where: str,
                    tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Render a chat; trained = 1 on assistant turns (see the module docstring)."""
    ids, trained = render_chat(Chat(check_messages(messages, "messages", where),
                                    check_tools(tools, where)), tokenizer, where)
    return list(ids), trained.tolist()


def render_prompt(prompt: Any, tokenizer, where: str = "prompt",
                  tools: list[dict] | None = None) -> list[int]:
    """Ids of a prompt ready for generation: a string is one user message, a list is a chat;
    rendered with the chat template and add_generation_prompt=True."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = check_messages(prompt, "prompt", where)
    else:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of messages, got "
                        f"{type(prompt).__name__}")
    return list(_apply(tokenizer, messages, where, True, check_tools(tools, where))["input_ids"])


def render_row_arrays(row: dict, tokenizer, where: str) -> tuple[list[int], np.ndarray]:
    """(ids, trained uint8 array) of one SFT row; see render_sft_row."""
    if chat_field(row) is not None:
        return render_chat(normalize_chat(row, where), tokenizer, where)
    if trl_format(row) is not None:   # TRL's {"text"} and {"prompt", "completion"} rows
        return render_trl_row(row, tokenizer, where)
    if "prompt" not in row and "response" not in row:
        raise DataError(f"{where}: row needs field 'messages' (or 'conversations'), 'text', "
                        f"fields 'prompt' and 'completion', or fields 'prompt' and 'response'; "
                        f"found fields {sorted(row)}")
    for key in ("prompt", "response"):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}" + (
                " (or 'completion': TRL's prompt-completion format)" if key == "response"
                else ""))
    response = row["response"]
    if not isinstance(response, str):
        raise DataError(f"{where}: field 'response' must be a string, got "
                        f"{type(response).__name__}")
    prompt_ids = render_prompt(row["prompt"], tokenizer, where, row.get("tools"))
    response_ids = list(tokenizer.encode(response, add_special_tokens=False))
    eos = _eos_id(tokenizer)
    if not response_ids or response_ids[-1] != eos:
        response_ids.append(eos)
    trained = np.zeros(len(prompt_ids) + len(response_ids), dtype=np.uint8)
    trained[len(prompt_ids):] = 1
    return prompt_ids + response_ids, trained


def render_sft_row(row: dict, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(ids, trained) of one SFT row.

    ``{"messages": [...]}`` or ``{"conversations": [...]}``: the chat template renders it;
    assistant turns are trained. TRL's ``{"text"}`` and ``{"prompt", "completion"}`` rows:
    as TRL renders them (engine.data.trl_rows). ``{"prompt": str | messages, "response": str}``: prompt ids
    (generation prompt added, not trained) + response ids + eos (trained; eos not repeated if
    the response already ends in it). Raises DataError naming `where` and the missing or
    invalid field.
    """
    ids, trained = render_row_arrays(row, tokenizer, where)
    return list(ids), trained.tolist()
