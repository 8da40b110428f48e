"""Import every module of engine/, models/ and parallel/ as the first project import of a
fresh interpreter state, one forked child per module; print one JSON object
{"modules": n, "failures": {module: last traceback line}}.

Third-party libraries (torch, megatron-core, transformers, ...) are loaded once in the parent
by importing every project module, after which every project module is dropped from
sys.modules: each child then imports only its one module, and with it whatever project code
that module pulls in, from scratch and in that module's order. An import cycle between
project modules that breaks for some first import (a name imported from a partially
initialised module) fails in that child exactly as in a new `python -c "import X"`; the
libraries themselves never take part in such cycles. The code the parent compiled from each
project file is reused by the children, as a bytecode cache would be
(`remember_compiled_sources`). Run by tests/test_imports.py.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("engine", "models", "parallel")


def project_modules() -> list[str]:
    out = []
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


def _is_project(name: str) -> bool:
    return name.split(".")[0] in SOURCE_ROOTS


def _child(module: str, write_fd: int) -> None:
    try:
        importlib.import_module(module)
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent, whatever it is
        os.write(write_fd, traceback.format_exc().strip().splitlines()[-1].encode()[:2000])
        code = 1
    os._exit(code)


def _start(module: str) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(module, write_fd)
    os.close(write_fd)
    return pid, read_fd


def import_each(modules: list[str], parallel: int = 2) -> dict[str, str]:
    """{module: why its import failed} over `modules`, each imported in its own fork
    (`parallel` children at a time)."""
    failures, running, queue = {}, [], list(modules)
    while queue or running:
        while queue and len(running) < parallel:
            module = queue.pop(0)
            running.append((module, *_start(module)))
        module, pid, read_fd = running.pop(0)
        with os.fdopen(read_fd, "rb") as r:
            message = r.read().decode()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failures[module] = message or f"exit status {status}"
    return failures


def remember_compiled_sources() -> None:
    """From now on, the code compiled from a project source file is kept (with the source it
    came from) and given again for the same source, as a bytecode cache would: the children
    then execute their modules without compiling them again. Where bytecode is written
    (PYTHONDONTWRITEBYTECODE unset) the loader reads the .pyc files instead and this changes
    nothing; where it is not (this host), each child compiled every project module it
    imported (about a third of the children's time). Only compilation is shared: each child
    still executes every module from scratch, in its own import order."""
    from importlib.machinery import SourceFileLoader

    compiled: dict[str, tuple[bytes, object]] = {}
    original = SourceFileLoader.source_to_code
    roots = tuple(str(ROOT / root) + os.sep for root in SOURCE_ROOTS)

    def source_to_code(self, data, path, *, _optimize=-1):
        kept = compiled.get(str(path))
        if kept is not None and kept[0] == bytes(data):
            return kept[1]
        code = original(self, data, path, _optimize=_optimize)
        if str(path).startswith(roots):
            compiled[str(path)] = (bytes(data), code)
        return code

    SourceFileLoader.source_to_code = source_to_code


def main() -> int:
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT))
    remember_compiled_sources()
    modules = project_modules()
    for module in modules:  # load the libraries once; failures are found in the children
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001
            pass
    for name in [n for n in sys.modules if _is_project(n)]:
        del sys.modules[name]
    importlib.invalidate_caches()
    print(json.dumps({"modules": len(modules), "failures": import_each(modules)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
