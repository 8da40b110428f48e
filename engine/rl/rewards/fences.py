"""The program of a reply (`reward.fn=code`): its fenced code blocks, read line by line as
Markdown does, and the one that is the solution.

A block opens with a line of three or more backticks (or tildes), indented by any whitespace,
followed by an optional info string whose first word is the language; it closes at the first
later line holding only a fence of the same character at least as long (and whitespace). The
content loses up to the opening fence's indentation on each line. A block that never closes
(a reply cut short) is not a block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PYTHON_TAGS = ("python", "python3", "py")
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language (the info string's first word, lower case; "" when
    bare) and its content (ending with a newline unless empty)."""
    language: str
    content: str


def fenced_blocks(text: str) -> list[Block]:
    """Every closed fenced block of ``text``, in order (module docstring)."""
    lines = text.replace("\r\n", "\n").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            break
        body = [_dedent(line, indent) for line in lines[i + 1:end]]
        words = opening["info"].split()
        blocks.append(Block(words[0].lower() if words else "",
                            "".join(line + "\n" for line in body)))
        i = end + 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    n = 0
    while n < indent and n < len(line) and line[n] in " \t":
        n += 1
    return line[n:]


def last_code_block(response: str) -> str | None:
    """The solution of a reply: the content of its last ```python / ```py / ```python3 block;
    when it has none, of its last bare block; never a block of another language. None when
    there is no such block."""
    blocks = fenced_blocks(response)
    for wanted in (lambda b: b.language in PYTHON_TAGS, lambda b: b.language == ""):
        chosen = [b for b in blocks if wanted(b)]
        if chosen:
            return chosen[-1].content
    return None
