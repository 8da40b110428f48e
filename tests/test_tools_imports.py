"""No import circle inside tools/ (issue 76: tools/convert.py and tools/convert_verify.py
imported each other; what both need lives in tools/convert_common.py). Static, as
tests/test_structure.py: the graph of tools' modules built from their imports, those inside
functions included (a circle through a lazy import still runs the other module's top level
twice when one of them is the `python tools/convert.py` script)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_structure import ROOT, _cycle, _imported, _module_name


def _tools_graph(root: Path) -> dict[str, set[str]]:
    known = {_module_name(p): p for p in sorted((root / "tools").rglob("*.py"))}
    return {m: _imported(ast.parse(p.read_text()), m, p.name == "__init__.py", known)
            for m, p in known.items()}


def test_no_import_circle_inside_tools():
    graph = _tools_graph(ROOT)
    assert _cycle(graph) is None, f"import circle in tools/: {' -> '.join(_cycle(graph))}"
    assert "tools.convert_common" in graph["tools.convert_verify"]
    assert "tools.convert" not in graph["tools.convert_verify"]


def test_a_circle_through_a_function_level_import_is_found():
    """Negative control: the shape convert.py and convert_verify.py had (a lazy import one way,
    a top-level one back)."""
    known = {"tools.a": Path(), "tools.b": Path()}
    a = _imported(ast.parse("def main():\n    from tools.b import verify\n"), "tools.a", False,
                  known)
    b = _imported(ast.parse("from tools.a import setup\n"), "tools.b", False, known)
    assert _cycle({"tools.a": a, "tools.b": b}) in (["tools.a", "tools.b", "tools.a"],
                                                    ["tools.b", "tools.a", "tools.b"])
