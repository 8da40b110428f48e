"""`--help` of the entry points, generated from the config schema so it cannot drift.

`schema_keys(schema)` walks the dataclass tree (SFTConfig, RLConfig) and yields every key as
(dotted key, type, default, meaning). The meaning is the field's own comment in the schema's
source: its inline comment, else the comment block right above it (joined into one line). A
key without a comment has an empty meaning; the key, type and default are always there.
`help_text(prog, schema, usage, examples)` is the text `python -m engine.sft --help` prints.
A choice key's line lists its choices (engine.config.choices) when its comment does not.
The entry points pass the schema as engine.config.schema_source rebuilds it (no torch,
megatron or transformers import: `--help` answers in well under 2 s); the text is the same.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import io
import json
import tokenize
import typing
from functools import lru_cache
from typing import Any, Iterator

from engine.config.choices import choices_text, lists_choices
PACKAGE = "megatron-sft-engine"
# flags of a launcher's usage line (the console command's: tools/cli.py), listed when the
# usage names them
LAUNCHER_FLAGS = {"--nproc-per-node": "  --nproc-per-node N start N local ranks through torchrun "
                                      "(--standalone: this host)"}


def version() -> str:
    """The installed distribution's version (setup.py), or "unknown" outside an install."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} from the source of dataclass `cls` (see module docstring);
    a field `cls` inherits keeps its base class's comment unless `cls` declares it again."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            comments.update(_own_comments(base))
    return comments


def _own_comments(cls: type) -> dict[str, str]:
    """The comments of the fields the class body of `cls` itself declares (its source: the
    module's, or `__schema_source__` for a class engine.config.schema_source rebuilt). A
    field's inline comment is its meaning, continued by the comment-only lines right below it
    that are indented past the `#` (`#      ... rest of the sentence`); only a field without
    an inline comment takes the comment block right above it (a block that is a section
    heading above a commented field names nothing)."""
    source = cls.__dict__.get("__schema_source__")
    if source is None:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            return {}
    names = {f.name for f in dataclasses.fields(cls)}
    inline: dict[str, str] = {}
    blocks: dict[str, str] = {}
    above: list[str] = []      # the comment lines right above the current line
    line_name = None           # the field this logical line declares
    continued = None           # the field whose inline comment the next comment line continues
    depth = 0                  # bracket depth: a default spanning lines is one logical line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if line_name is not None:
                inline.setdefault(line_name, text)
            elif continued is not None and tok.string[1:].startswith("  "):
                inline[continued] += " " + text
            else:
                continued = None
                above.append(text)
        elif tok.type == tokenize.NAME and line_name is None and depth == 0 \
                and tok.string in names and tok.start[1] == len(tok.line) - len(tok.line.lstrip()):
            line_name, continued = tok.string, None
            if above:
                blocks[line_name] = " ".join(above)
        elif tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.NEWLINE:
            continued = line_name if line_name in inline else None
            line_name, above = None, []
        elif tok.type == tokenize.NL and line_name is None and depth == 0:
            if not tok.line.strip():
                above, continued = [], None   # a blank line ends a comment block
    return {**blocks, **inline}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return "|".join(_type_name(a) for a in args) + "|null"
    if origin in (list, dict):
        return getattr(tp, "__name__", str(tp).replace("typing.", ""))
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, str) and "\n" in value:   # one line: quoted, newlines as \n
        return json.dumps(value)
    return str(value)


def _meaning(key: str, comment: str) -> str:
    """The field's comment, followed by its choices (engine.config.choices) when it does not
    name them all itself (a comment that points at a table in the code)."""
    text = choices_text(key)
    if text is None or lists_choices(key, comment):
        return comment
    return f"{comment}; {text}" if comment else text


def schema_keys(schema: type, prefix: str = "",
                defaults: Any = None) -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default as on the command line, meaning) of every leaf key. A group's
    defaults are those of the instance its parent's field builds (RL's
    `LoggingConfig(dir="runs/rl")`), not its class's; `defaults`: that instance."""
    hints = typing.get_type_hints(schema)
    comments = field_comments(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        value = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, f"{prefix}{f.name}.",
                                   value if dataclasses.is_dataclass(value) else None)
            continue
        key = f"{prefix}{f.name}"
        yield key, _type_name(tp), _yaml(value), _meaning(key, comments.get(f.name, ""))


def help_text(prog: str, schema: type, usage: str, examples: list[str]) -> str:
    """Usage, every config key by group (type, default, meaning) and examples."""
    out = [f"usage: {usage}", "", f"{prog} {version()}", "",
           "Configuration: key=value overrides (hydra syntax; lists as [a,b]), after an "
           "optional --config FILE.yaml. Every key, its type, default and meaning:"]
    rows = list(schema_keys(schema))
    width = max(len(k) for k, *_ in rows)
    group = None
    for key, tp, default, meaning in rows:
        top = key.split(".")[0]
        if top != group:
            group = top
            out += ["", f"{group}:"]
        line = f"  {key:<{width}}  {tp} = {default}"
        out.append(line + (f"  # {meaning}" if meaning else ""))
    launcher = [line for flag, line in LAUNCHER_FLAGS.items() if flag in usage]
    out += ["", "Other flags:", *launcher,
            "  --config FILE      a YAML file of keys (overrides win)",
            "  --validate ...     check a recipe's layout and memory; no training",
            "  -h, --help         this text", "  --version          the version", "",
            "Examples:", *(f"  {e}" for e in examples)]
    return "\n".join(out) + "\n"
