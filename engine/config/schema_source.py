"""An entry point's config schema read from its source, without running its modules.

The schema dataclasses (SFTConfig, RLConfig, DPOConfig, RMConfig, KTOConfig and the groups
under them) live beside the checks of their keys, whose modules import torch, megatron-core
and transformers: importing them takes 5 to 14 s on a CPU host. `--help` and the refusal of
an unknown key or a wrong type need only the dataclasses, so `source_schema("module:Class")`
builds them from the source: it parses the module (ast, nothing executed; a package's
`__init__.py` is imported to locate a module, and those import nothing), follows `from X import
Name` to the module defining each class or constant a class body uses, and rebuilds every class
with `dataclasses.dataclass` from its fields in order: annotation, default (a literal, a
module-level literal constant, `field(default_factory=...)` of a class, `list`, `dict` or a
lambda), base classes first. The result has the real schema's keys, types and defaults, so
hydra composes and refuses exactly as it does with the real classes (tests/test_cli_help.py
compares both for every entry point); methods are left out. Each class carries its source as
`__schema_source__` (engine.config.help reads the field comments from it).

`SchemaSourceError`: a construct this reader does not evaluate (the caller then imports the
real schema).
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import typing
from functools import lru_cache
from typing import Any

# modules whose names a class body may use as they are (imported for real: both are light)
REAL_MODULES = {"typing": typing, "dataclasses": dataclasses}


class SchemaSourceError(Exception):
    """The schema's source holds something source_schema does not evaluate."""


@lru_cache(maxsize=None)
def _module(name: str) -> tuple[ast.Module, str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise SchemaSourceError(f"{name}: no Python source")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    return ast.parse(source), source


def _lookup(module: str, name: str) -> Any:
    """The value `name` has at the top of `module`: a rebuilt class, a literal, or what an
    import binds to it there."""
    tree, _ = _module(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _class(module, name)
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                raise SchemaSourceError(f"{module}.{name} is not a literal") from None
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if node.module in REAL_MODULES:
                        return getattr(REAL_MODULES[node.module], alias.name)
                    return _lookup(node.module, alias.name)
    if hasattr(builtins, name):
        return getattr(builtins, name)
    raise SchemaSourceError(f"{module}: {name} is not defined at the top of the module")


def _evaluate(module: str, expr: ast.expr) -> Any:
    """`expr` (an annotation or a default) evaluated with its names as `module` binds them."""
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    scope = {n: _lookup(module, n) for n in names}
    return eval(compile(ast.Expression(expr), f"<{module}>", "eval"),  # noqa: S307 (schema source)
                {"__builtins__": builtins, **scope})


@lru_cache(maxsize=None)
def _class(module: str, name: str) -> type:
    tree, source = _module(module)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    if [ast.unparse(d) for d in node.decorator_list] != ["dataclass"]:
        raise SchemaSourceError(f"{module}.{name}: only a plain @dataclass is read")
    bases = tuple(_evaluate(module, b) for b in node.bases)
    namespace: dict[str, Any] = {"__module__": module, "__qualname__": name,
                                 "__annotations__": {},
                                 "__schema_source__": "".join(  # whole lines: the last
                                     source.splitlines(True)[node.lineno - 1:node.end_lineno])}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            namespace["__annotations__"][stmt.target.id] = _evaluate(module, stmt.annotation)
            if stmt.value is not None:
                namespace[stmt.target.id] = _evaluate(module, stmt.value)
        elif not isinstance(stmt, (ast.Expr, ast.FunctionDef, ast.Pass)):
            raise SchemaSourceError(f"{module}.{name}: line {stmt.lineno} is not a field")
    return dataclasses.dataclass(type(name, bases, namespace))


def source_schema(ref: str) -> type:
    """The schema dataclass `ref` ("package.module:Class") rebuilt from source (module
    docstring). Raises SchemaSourceError for what it does not read."""
    module, _, name = ref.partition(":")
    try:
        return _class(module, name)
    except StopIteration:
        raise SchemaSourceError(f"{module} defines no class {name}") from None


def real_schema(ref: str) -> type:
    """The schema dataclass `ref` ("package.module:Class") imported (its module runs)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)
