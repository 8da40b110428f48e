"""A tool worker process (env.fn=tools): `python -m engine.rl.env.tool_worker MAX_CHARS SPEC...`.

Loads the tools named by the SPECs ("package.module:function"), then answers one JSON line on
stdout per JSON line `{"name": str, "arguments": {...}}` read from stdin: `{"ok": true,
"output": str}` (a string result as is, anything else as JSON, else str(); cut to MAX_CHARS
characters with a note) or `{"ok": false, "error": "Type: message"}`. The tools' own prints go
to stderr (stdout carries only the protocol). Runs without torch; the trainer never executes a
tool itself (engine.rl.env.tool_pool starts, times out and kills these processes).
"""
from __future__ import annotations

import json
import os
import sys

from engine.rl.env.tool_schema import load_tool


def _text(result) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def cap(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, with a note saying how much was cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"


def serve(max_chars: int, specs: list[str], stdin, out) -> None:
    tools = dict(load_tool(spec) for spec in specs)
    for line in stdin:
        try:
            request = json.loads(line)
            name, arguments = request["name"], request["arguments"]
            if name not in tools:
                raise LookupError(f"no tool named {name!r}; tools: {', '.join(sorted(tools))}")
            reply = {"ok": True, "output": cap(_text(tools[name](**arguments)), max_chars)}
        except BaseException as e:  # noqa: BLE001 - a raising tool becomes an error message
            reply = {"ok": False, "error": cap(f"{type(e).__name__}: {e}", max_chars)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: list[str]) -> None:
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)                   # the tools' prints (and C-level writes) go to stderr
    sys.stdout = sys.stderr
    serve(int(argv[0]), argv[1:], sys.stdin, protocol)


if __name__ == "__main__":
    main(sys.argv[1:])
