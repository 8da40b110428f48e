"""Tools of `env.fn=tools` (`env.tools=["package.module:function", ...]`) and their JSON
schemas, read from each function's signature and docstring, in the OpenAI/transformers form the
chat templates render (`{"type": "function", "function": {"name", "description",
"parameters": {"type": "object", "properties", "required"}}}`):
- description: the docstring up to its first "Args:" / "Returns:" section (or blank line);
- a parameter's type from its annotation (int -> integer, float -> number, str -> string,
  bool -> boolean, list -> array, dict -> object; others: no type); its description from a
  Google-style "Args:" entry `name: text` or `name (type): text`;
- required: the parameters without a default. *args / **kwargs are refused.
Imports only the standard library (tool worker processes use it too).
"""
from __future__ import annotations

import importlib
import inspect
import re
import typing

_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
          dict: "object", "int": "integer", "float": "number", "str": "string",
          "bool": "boolean", "list": "array", "dict": "object"}
_ARG = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def load_tool(spec: str):
    """(name, function) of "package.module:function"; ValueError naming env.tools otherwise."""
    module_name, colon, attr = str(spec).partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"env.tools entry {spec!r} is not 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # noqa: BLE001 - any import failure of user code
        raise ValueError(f"env.tools entry {spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"env.tools entry {spec!r} is not callable")
    return attr, fn


def load_tools(specs: list[str]) -> dict:
    """{name: function} of env.tools; ValueError for a bad entry, a duplicate name, or a
    signature that cannot be described (*args / **kwargs)."""
    tools = {}
    for spec in specs:
        name, fn = load_tool(spec)
        if name in tools:
            raise ValueError(f"env.tools has two tools named {name!r}")
        tool_schema(fn, name)
        tools[name] = fn
    return tools


def _annotation_type(annotation) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    origin = typing.get_origin(annotation)
    return _TYPES.get(origin if origin is not None else annotation)


def _arg_docs(doc: str) -> dict[str, str]:
    out, in_args, current = {}, False, None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args and stripped.endswith(":") and not line.startswith((" ", "\t")):
            break
        if not in_args or not stripped:
            continue
        match = _ARG.match(line)
        if match:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current is not None:
            out[current] += " " + stripped
    return out


def tool_schema(fn, name: str | None = None) -> dict:
    """The JSON schema of one tool function (module docstring)."""
    name = name or fn.__name__
    doc = inspect.getdoc(fn) or ""
    head = re.split(r"\n\s*\n|\n\s*(?:Args|Arguments|Parameters|Returns|Raises):", doc)[0]
    params = _arg_docs(doc)
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"env.tools: tool {name!r} takes *{p.name}; tools need named "
                             "parameters only")
        prop: dict = {}
        kind = _annotation_type(p.annotation)
        if kind is not None:
            prop["type"] = kind
        if p.name in params:
            prop["description"] = params[p.name]
        props[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"type": "function", "function": {
        "name": name, "description": " ".join(head.split()),
        "parameters": {"type": "object", "properties": props, "required": required}}}
