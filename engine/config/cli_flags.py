"""`--name V` / `--name=V` flags of the `--validate` command lines (SFT and RL)."""
from __future__ import annotations

from engine.errors import ConfigError


def pop_flag(argv: list[str], name: str) -> str | None:
    """Remove `--name V` / `--name=V` from argv and return V (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def int_flag(argv: list[str], name: str) -> int | None:
    """pop_flag as an integer (ConfigError naming the flag otherwise)."""
    value = pop_flag(argv, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None


def pop_switch(argv: list[str], name: str) -> bool:
    """Remove every `name` from argv; True when it was there."""
    found = name in argv
    argv[:] = [a for a in argv if a != name]
    return found
