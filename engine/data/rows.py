"""Chat rows checked and normalized (the input side of engine.data.render).

Row formats (normalize_chat; prompt/response rows are read by engine.data.render):
- OpenAI ``{"messages": [...], "tools": [...]}``: roles system/user/assistant/tool; assistant
  messages may carry ``tool_calls`` ([{"type": "function", "function": {"name", "arguments"}}],
  arguments a dict or a JSON string, parsed to a dict as HF chat templates expect) with null or
  missing content, and ``reasoning_content`` (rendered where the template renders it). Keys
  whose value is null are dropped (Parquet fills absent struct fields with nulls). A tool is
  ``{"type": "function", "function": {"name": str, "description": str, "parameters": {...}}}``
  or its function's fields flat (``{"name", ...}``, as some datasets ship them).
  Every part that templates read is checked for its type (a DataError naming it, e.g.
  ``tools[0].function.name must be a non-empty string``): the servers answer 400, never 500.
- ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system"|"tool"|..., "value": str}]}``,
  optional row fields ``system`` (str) and ``tools`` (list, or a JSON string).
- ``{"prompt": str | messages, "response": str}``.
- TRL's ``{"text"}`` and ``{"prompt", "completion"}`` rows: engine.data.trl_rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.data.files import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_response": "tool",
                  "function_call": "assistant"}


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _check_tool_calls(calls: Any, field: str, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise DataError(f"{where}: {field} must be a list of tool calls, got "
                        f"{type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        f = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise DataError(f"{where}: {f} must be an object, got {type(call).__name__}")
        for key in ("type", "id"):
            if key in call and not isinstance(call[key], str):
                raise DataError(f"{where}: {f}.{key} must be a string, got "
                                f"{type(call[key]).__name__}")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise DataError(f"{where}: {f}.function must be an object {{'name', "
                            f"'arguments'}}, got {type(fn).__name__}")
        if not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: {f}.function.name must be a string")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: {f}.function.arguments is not valid JSON ({e.msg})"
                                ) from None
        if not isinstance(args, dict):
            raise DataError(f"{where}: {f}.function.arguments must be an object or a JSON "
                            f"string of one, got {type(args).__name__}")
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**fn, "arguments": args}})
    return out


def check_messages(value: Any, field: str, where: str) -> list[dict]:
    """`value` as a chat: a non-empty list of {"role": str, "content": str, ...} dicts.

    Null-valued keys are dropped; an assistant message with ``tool_calls`` may have null or no
    content (it becomes ""); tool-call arguments given as JSON strings become dicts."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages, got "
                        f"{type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{i}] must be an object with 'role' and "
                            f"'content', got {type(m).__name__}")
        m = _drop_nulls(m)
        if "tool_calls" in m:
            m["tool_calls"] = _check_tool_calls(m["tool_calls"], f"{field}[{i}].tool_calls",
                                                where)
            m.setdefault("content", "")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {field}[{i}] is missing field {key!r}")
            if key == "content" and isinstance(m[key], list):
                m["content"] = _content_parts(m, f"{field}[{i}].content", where)
            elif not isinstance(m[key], str):
                raise DataError(f"{where}: {field}[{i}].{key} must be a string, got "
                                f"{type(m[key]).__name__}")
        for key in ("reasoning_content", "name", "tool_call_id"):
            if key in m and not isinstance(m[key], str):
                raise DataError(f"{where}: {field}[{i}].{key} must be a string, got "
                                f"{type(m[key]).__name__}")
        out.append(m)
    return out


def _content_parts(message: dict, field: str, where: str) -> list[dict] | str:
    """A content list of HF parts ({"type": "text", "text"} / {"type": "image"}: images are
    read by engine.data.images); an assistant's text parts joined into one string (images
    there are refused: the model does not generate them)."""
    parts = message["content"]
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or p.get("type") not in ("text", "image"):
            raise DataError(f"{where}: {field}[{j}] must be a part {{'type': 'text', 'text'}} "
                            f"or {{'type': 'image'}}")
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise DataError(f"{where}: {field}[{j}].text must be a string")
        if p["type"] == "image" and message.get("role") == "assistant":
            raise DataError(f"{where}: {field}[{j}] is an image in an assistant message; images "
                            "are inputs (user, system or tool messages) only")
    if message.get("role") == "assistant":
        return "".join(p["text"] for p in parts)
    return parts


def check_tools(value: Any, where: str) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not valid JSON ({e.msg})") from None
        if value is None:
            return None
    if not isinstance(value, list):
        raise DataError(f"{where}: field 'tools' must be a list of tool objects (or a JSON "
                        f"string of one), got {type(value).__name__}")
    for i, tool in enumerate(value):
        _check_tool(tool, f"tools[{i}]", where)
    return value or None


def _check_tool(tool: Any, field: str, where: str) -> None:
    """One tool (module docstring): OpenAI's shape or the function's fields flat."""
    if not isinstance(tool, dict):
        raise DataError(f"{where}: {field} must be a tool object {{'type': 'function', "
                        f"'function': {{'name', ...}}}}, got {type(tool).__name__}")
    if "type" in tool and not isinstance(tool["type"], str):
        raise DataError(f"{where}: {field}.type must be a string, got "
                        f"{type(tool['type']).__name__}")
    if "function" not in tool and "name" not in tool:
        raise DataError(f"{where}: {field} has no 'function' ({{'type': 'function', "
                        "'function': {'name', 'description', 'parameters'}})")
    fn, f = (tool["function"], f"{field}.function") if "function" in tool else (tool, field)
    if not isinstance(fn, dict):
        raise DataError(f"{where}: {f} must be an object {{'name', 'description', "
                        f"'parameters'}}, got {type(fn).__name__}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{where}: {f}.name must be a non-empty string, got "
                        f"{fn.get('name')!r:.50}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise DataError(f"{where}: {f}.description must be a string, got "
                        f"{type(fn['description']).__name__}")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], (dict, str)):
        raise DataError(f"{where}: {f}.parameters must be a JSON schema object, got "
                        f"{type(fn['parameters']).__name__}")


def _sharegpt_messages(row: dict, where: str) -> list[dict]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list of "
                        f"{{'from', 'value'}} objects, got {type(turns).__name__}")
    messages = []
    if isinstance(row.get("system"), str) and row["system"]:
        messages.append({"role": "system", "content": row["system"]})
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise DataError(f"{where}: conversations[{i}] must be an object with 'from' and "
                            f"'value', got {type(t).__name__}")
        for key in ("from", "value"):
            if key not in t or t[key] is None:
                raise DataError(f"{where}: conversations[{i}] is missing field {key!r}")
        role, value = t["from"], t["value"]
        if role not in SHAREGPT_ROLES:
            raise DataError(f"{where}: conversations[{i}].from={role!r} is not one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
        if not isinstance(value, (str, list)):   # a list: content parts with images
            raise DataError(f"{where}: conversations[{i}].value must be a string, got "
                            f"{type(value).__name__}")
        if role == "function_call":
            try:
                call = json.loads(value)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: conversations[{i}].value of a function_call must "
                                f"be JSON {{'name', 'arguments'}} ({e.msg})") from None
            calls = call if isinstance(call, list) else [call]
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": c} if isinstance(c, dict) else c
                for c in calls]})
        else:
            messages.append({"role": SHAREGPT_ROLES[role], "content": value})
    return messages


@dataclass
class Chat:
    """A normalized chat row: messages (checked) and tools (None when absent)."""

    messages: list[dict]
    tools: list[dict] | None = None


def chat_field(row: dict) -> str | None:
    """"messages" or "conversations" when `row` is a chat row, else None. A null field does
    not count when the row has prompt/response fields (a Parquet file mixing row kinds gives
    every row every column)."""
    for key in ("messages", "conversations"):
        if row.get(key) is not None:
            return key
    if "prompt" in row or "response" in row:
        return None
    return next((k for k in ("messages", "conversations") if k in row), None)


def normalize_chat(row: dict, where: str) -> Chat:
    """The chat of a ``messages`` or ``conversations`` row (see the module docstring)."""
    tools = check_tools(row.get("tools"), where)
    if chat_field(row) == "messages":
        return Chat(check_messages(row["messages"], "messages", where), tools)
    messages = _sharegpt_messages(row, where)
    return Chat(check_messages(messages, "conversations", where), tools)
