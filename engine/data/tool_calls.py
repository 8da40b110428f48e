"""Tool calls parsed from an assistant turn in the model family's own format.

- "hermes" (Qwen2.5, Qwen3): every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  in the text after the last `</think>` (reasoning is not acted on); an unclosed
  `<tool_call>` is a malformed call;
- "llama3_json" (Llama 3.1 custom tools): the whole turn (after an optional `<|python_tag|>`)
  is one JSON object `{"name": ..., "parameters": {...}}` ("arguments" accepted too); a turn
  that starts with "{" but is not such an object is a malformed call; anything else is an
  answer.
`detect_format(chat_template)` picks the format from the template text (None: unknown, refused
by env.fn=tools at start). A turn with neither calls nor malformed calls is the final answer.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # one per malformed call

    @property
    def is_answer(self) -> bool:
        return not self.calls and not self.errors


def detect_format(chat_template: str) -> str | None:
    """The tool-call format of a chat template's text, or None."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return "llama3_json"
    return None


def _call_of(obj, args_key: tuple[str, ...]) -> ToolCall:
    """A ToolCall of a decoded JSON object, or ValueError saying what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call must be a JSON object with a string 'name'")
    args = next((obj[k] for k in args_key if k in obj), {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of tool call {obj['name']!r} must be a JSON object")
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> ParsedTurn:
    text = text.rsplit("</think>", 1)[-1]
    out = ParsedTurn()
    for body in _HERMES.findall(text):
        try:
            out.calls.append(_call_of(json.loads(body.strip()), ("arguments", "parameters")))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            out.errors.append(f"malformed tool call {body.strip()[:200]!r}: {e}")
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        out.errors.append("malformed tool call: <tool_call> without </tool_call>")
    return out


def parse_llama3_json(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    out = ParsedTurn()
    if not body.startswith("{"):
        return out
    try:
        out.calls.append(_call_of(json.loads(body), ("parameters", "arguments")))
    except ValueError as e:
        out.errors.append(f"malformed tool call {body[:200]!r}: {e}")
    return out


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    """The tool calls of one assistant turn's decoded text in format `fmt` (FORMATS)."""
    return PARSERS[fmt](text)
