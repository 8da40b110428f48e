"""Name -> function tables for the RL extension points (algorithm presets, advantage
estimators, policy losses): `register = registrar(TABLE)`, then `@register("name")`."""
from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def registrar(table: dict[str, F]) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory that stores the decorated function in `table` under a name."""
    def register(name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in table:
                raise ValueError(f"{name!r} is already registered")
            table[name] = fn
            return fn
        return add
    return register
