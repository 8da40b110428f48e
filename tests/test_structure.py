"""The tree says the architecture (docs/development.md): engine/ is one package per concern
with one-way package imports, no module import cycles, and small files and functions in engine/,
models/ and parallel/. Pure static analysis (ast); no imports of the code under test."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("engine", "models", "parallel")
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 80
ENTRY_POINTS = {"engine.sft.__main__", "engine.rl.__main__", "engine.dpo.__main__",
                "engine.rm.__main__", "engine.kto.__main__", "engine.serve.__main__"}
# package -> packages it must never import (engine/__init__.py; docs/development.md); api is
# the OpenAI protocol both servers speak (RL's agent endpoint, serve): it reads data only, and
# only rl and serve import it; serve (`megatron-sft-engine serve`) is built on api and RL's
# generation engines and trains nothing: nothing imports it, and it imports no training,
# checkpoint, rl or other entry point; generation holds the engines RL, serve, the agent
# endpoint and the judges share
# preference is the core DPO, KTO and reward models share (issue 76): only they import it, and
# none of them imports another
FORBIDDEN = {
    "data": {"run", "sft", "rl", "dpo", "rm", "kto", "checkpoint", "training", "config",
             "serve", "api", "preference"},
    "training": {"run", "sft", "rl", "dpo", "rm", "kto", "checkpoint", "data", "config",
                 "serve", "api", "preference"},
    "checkpoint": {"run", "sft", "rl", "dpo", "rm", "kto", "serve", "api", "preference"},
    "run": {"sft", "rl", "dpo", "rm", "kto", "serve", "api", "preference"},
    "preference": {"sft", "rl", "dpo", "rm", "kto", "serve", "api"},
    "dpo": {"sft", "rl", "rm", "kto", "serve", "api"},
    "sft": {"dpo", "rm", "kto", "serve", "api", "preference"},
    "rl": {"dpo", "rm", "kto", "serve", "preference"},
    "rm": {"sft", "rl", "dpo", "kto", "serve", "api"},
    "kto": {"sft", "rl", "dpo", "rm", "serve", "api"},
    "config": {"serve", "api", "kto", "preference"},
    "serve": {"sft", "rl", "dpo", "rm", "kto", "run", "checkpoint", "training", "preference"},
    "api": {"run", "sft", "rl", "dpo", "rm", "kto", "checkpoint", "training", "config",
            "serve", "preference", "generation"},
    # the generation engines (issue 82): one floor below rl and serve, which both run on them
    "generation": {"run", "sft", "rl", "dpo", "rm", "kto", "checkpoint", "training", "data",
                   "serve", "preference"},
}
OBJECTIVES = ("dpo", "kto", "rm")   # the preference objectives (engine/preference: their core)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for root in SOURCE_ROOTS for p in sorted((ROOT / root).rglob("*.py"))}


def _ancestors(name: str) -> list[str]:
    """The packages whose __init__.py runs before module `name` ('a.b.c' -> ['a', 'a.b'])."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _imported(tree: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """Modules of `known` whose code an import in `tree` runs or reads (function-level imports
    included): the longest known prefix of each imported name (`from pkg import mod` resolved
    to pkg.mod); the packages whose __init__.py that import runs first (ancestors of the
    imported module that are not `module`'s own); and for `from pkg import name` the package
    `pkg` itself, whose namespace the statement reads even when `pkg` is `module`'s own
    ancestor (the fallback to loading a submodule is what hid the families cycle, issue 42)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return None

    own = set(_ancestors(module))
    out: set[str] = set()

    def add(target: str | None) -> None:
        if target:
            out.add(target)
            out.update(a for a in _ancestors(target) if a in known and a not in own)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            if base in known:
                out.add(base)
            for a in node.names:
                add(resolve(f"{base}.{a.name}") or resolve(base))
    out.discard(module)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imported(ast.parse(p.read_text()), m, p.name == "__init__.py", known)
            for m, p in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a node list, or None (iterative DFS, colours)."""
    colour: dict[str, int] = {}
    for start in graph:
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not colour.get(child):
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def _package(module: str) -> str | None:
    """engine.<package> of an engine module ('cli', 'errors' for the shared top-level modules)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def _unit_graph(graph: dict[str, set[str]], unit) -> dict[str, set[str]]:
    """The module graph collapsed to units (`unit(module)`: its unit, or None to leave it out)."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if (src := unit(m)) is None:
            continue
        out.setdefault(src, set())
        out[src] |= {d for dep in deps if (d := unit(dep)) and d != src}
    return out


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return _unit_graph(graph, _package)


def test_engine_top_level_is_packages_plus_shared_modules():
    files = {p.name for p in (ROOT / "engine").iterdir() if p.is_file() and p.suffix == ".py"}
    assert files <= {"__init__.py", "cli.py", "errors.py"}, files
    for pkg in (p for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = pkg / "__init__.py"
        assert init.exists(), f"{pkg} is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init}: docstring must state what the package may import"


def test_no_module_import_cycle():
    assert _cycle(_graph()) is None, f"import cycle: {' -> '.join(_cycle(_graph()))}"


def test_package_imports_are_one_way():
    graph = _graph()
    packages = _package_graph(graph)
    assert _cycle(packages) is None, f"package cycle: {' -> '.join(_cycle(packages))}"
    for pkg, banned in FORBIDDEN.items():
        assert not packages.get(pkg, set()) & banned, f"engine.{pkg} imports {packages[pkg] & banned}"
    importers = {m for m, deps in graph.items() if deps & ENTRY_POINTS}
    assert not importers, f"entry points imported by {importers}"


def test_cycle_finder_and_rules_catch_violations():
    """Negative control: a two-module cycle and a training -> run import are found."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert _cycle({"a": {"b"}, "b": set()}) is None
    known = {"engine.run.run_loop": Path(), "engine.training.loss": Path()}
    tree = ast.parse("def f():\n    from engine.run import run_loop\n")
    deps = _imported(tree, "engine.training.loss", False, known)
    assert deps == {"engine.run.run_loop"}
    assert _package_graph({"engine.training.loss": deps}) == {"training": {"run"}}


GENERATION_BACKENDS = ("hf", "vllm", "sglang")   # engine/generation's backend sub-packages


def _generation_unit(module: str) -> str | None:
    """engine.generation's unit of a module: a sub-package name, or 'shared' for its top level."""
    parts = module.split(".")
    if parts[:2] != ["engine", "generation"]:
        return None
    return parts[2] if len(parts) > 3 else "shared"


def _generation_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) units of engine.generation against its rule: a backend imports the
    shared level and sync/ only, sync/ imports no backend, the shared level imports no
    sub-package (the backend registry names classes by string)."""
    units = _unit_graph(graph, _generation_unit)
    allowed = {"shared": set(), "sync": {"shared"}}
    allowed.update({b: {"shared", "sync"} for b in GENERATION_BACKENDS})
    return {(a, b) for a, deps in units.items() for b in deps - allowed.get(a, set())}


def test_generation_is_one_package_per_backend_with_one_way_imports():
    """engine/generation (issue 82): the engines RL and serve share, one sub-package per backend
    (hf, vllm, sglang) and one for the sync transport; the backends never import each other.
    Negative control: a vllm -> hf edge and a shared -> vllm edge are found."""
    root = ROOT / "engine" / "generation"
    subs = {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert subs == set(GENERATION_BACKENDS) | {"sync"}, subs
    assert not any(p.name.startswith(tuple(f"{s}_" for s in subs)) for p in root.glob("*.py"))
    assert _generation_violations(_graph()) == set()
    assert _generation_violations({
        "engine.generation.vllm.backend": {"engine.generation.hf.backend"},
        "engine.generation.pool": {"engine.generation.vllm.process"},
        "engine.generation.hf.backend": {"engine.generation.sync.handles",
                                         "engine.generation.base"}}) == {
        ("vllm", "hf"), ("shared", "vllm")}


def _objective_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) of every import between two preference objectives in `graph`."""
    packages = _package_graph(graph)
    return {(a, b) for a in OBJECTIVES for b in packages.get(a, set()) if b in OBJECTIVES}


def test_preference_objectives_share_one_core_and_import_no_other_objective():
    """engine.dpo, engine.kto and engine.rm each import the preference core (engine.preference)
    and none imports another objective (issue 76: kto read dpo's reference and sums, rm its
    sums and loaders). Negative control: a kto -> dpo edge is found."""
    graph = _graph()
    assert _objective_imports(graph) == set()
    packages = _package_graph(graph)
    assert all("preference" in packages[o] for o in OBJECTIVES), packages
    assert _objective_imports({"engine.kto.training": {"engine.dpo.training"},
                               "engine.rm.loss_fn": {"engine.preference.table"}}) == {
        ("kto", "dpo")}


@pytest.mark.parametrize("root", SOURCE_ROOTS)
def test_files_and_functions_are_small(root):
    long_files, long_functions = [], []
    for path in sorted((ROOT / root).rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions


RL_ROOT = ROOT / "engine" / "rl"
MAX_RL_TOP_LEVEL_MODULES = 6  # beside __init__.py and the packages


def _rl_unit(module: str) -> str | None:
    """engine.rl.<package or top-level module> of an engine.rl module, else None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["engine", "rl"] and len(parts) > 2 else None


def _declared_rl_imports(init: Path) -> set[str]:
    """The engine.rl units an rl package's docstring allows after 'May import:'."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    allowed = doc.split("May import:", 1)[1] if "May import:" in doc else ""
    return {name.split(".")[2] for name in
            (w.strip(" ,.;()") for w in allowed.split()) if name.startswith("engine.rl.")}


def _rl_unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return _unit_graph(graph, _rl_unit)


def test_rl_is_a_few_packages_with_one_way_imports():
    """engine/rl: at most 6 top-level modules beside its packages; each package's __init__.py
    opens with a docstring saying what it owns and 'May import:' naming the engine.rl units it
    may use; the imports between units are acyclic and within what each package declares."""
    modules = sorted(p.stem for p in RL_ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_RL_TOP_LEVEL_MODULES, modules
    units = _rl_unit_graph(_graph())
    assert _cycle(units) is None, f"engine.rl unit cycle: {' -> '.join(_cycle(units))}"
    packages = [p for p in RL_ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert len(packages) >= 6, packages
    for pkg in packages:
        init = pkg / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        assert doc and "May import:" in doc, f"{init}: docstring must say what it may import"
        extra = units.get(pkg.name, set()) - _declared_rl_imports(init)
        assert not extra, f"engine.rl.{pkg.name} imports {sorted(extra)} beyond its docstring"


def test_rl_unit_rules_catch_violations():
    """Negative control: a back edge between rl packages is a cycle, and an undeclared import
    is found."""
    graph = {"engine.rl.algo.advantages": {"engine.rl.policy.update"},
             "engine.rl.policy.update": {"engine.rl.algo.advantages"}}
    assert _cycle(_rl_unit_graph(graph)) is not None
    assert _rl_unit_graph({"engine.rl.algo.x": {"engine.rl.collect.batch"}}) == {
        "algo": {"collect"}}
    assert "collect" not in _declared_rl_imports(RL_ROOT / "algo" / "__init__.py")


def test_no_private_names_imported_across_modules():
    """`from engine.x import _name` (or models/parallel) hides a contract: make it public."""
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in \
                        SOURCE_ROOTS:
                    found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")
                              and not a.name.startswith("__")]
    assert not found, found


MAX_FUNCTION_LEVEL_IMPORTS = 40


def test_function_level_imports_are_few_and_give_their_reason():
    """Imports belong at the top of a module; the exceptions (an optional dependency, a heavy
    library only one path needs, megatron after the CPU host's import hook) are at most 40 in
    engine/, models/ and parallel/, each with its reason in a comment on its line (or, for a
    group of imports, on the line above)."""
    found: set[str] = set()
    silent = []
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            lines = path.read_text().splitlines()
            for fn in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and where not in found:
                        found.add(where)
                        here, above = lines[node.lineno - 1], lines[node.lineno - 2]
                        if "#" not in here and not above.strip().startswith("#"):
                            silent.append(f"{where}: {here.strip()}")
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, sorted(found)
    assert not silent, silent


# ---- models/: packages with declared one-way imports, a family in one place (issue 42) ----
MODELS_ROOT = ROOT / "models"
FAMILIES_ROOT = MODELS_ROOT / "families"
VOCABULARY = "models.families.base"   # the declaration vocabulary every package may read


def _models_unit(module: str) -> str | None:
    """models.<package> of a models module (models.families.base on its own), else None."""
    parts = module.split(".")
    if parts[0] != "models" or len(parts) < 2:
        return None
    return VOCABULARY if module == VOCABULARY else ".".join(parts[:2])


def _without_empty_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` without the edges into packages whose __init__.py imports nothing: running such
    an __init__ first carries no dependency."""
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    return {m: {d for d in deps if d not in packages or graph.get(d)}
            for m, deps in graph.items()}


def _models_unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return _unit_graph(_without_empty_inits(graph), _models_unit)


def _declared_models_imports(init: Path) -> set[str]:
    """The models units a models package's docstring allows after 'May import:'."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    allowed = doc.split("May import:", 1)[1] if "May import:" in doc else ""
    allowed = allowed.split("Not:", 1)[0]
    return {w for w in (w.strip(" ,.;()`\n") for w in allowed.split()) if w.startswith("models.")}


def test_models_is_packages_with_declared_one_way_imports():
    """models/ holds packages only (beside __init__.py); every package's __init__.py imports
    nothing and its docstring says 'May import:' with the models packages it may use; the
    imports between packages are acyclic and within what each declares."""
    top = sorted(p.name for p in MODELS_ROOT.glob("*.py"))
    assert top == ["__init__.py"], top
    for init in sorted(MODELS_ROOT.rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        if init.parent != MODELS_ROOT:
            assert not imports, f"{init.relative_to(ROOT)} imports: a package's __init__ runs " \
                                "before each of its modules, so it must not import them"
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring"
    units = _models_unit_graph(_graph())
    assert _cycle(units) is None, f"models package cycle: {' -> '.join(_cycle(units))}"
    for pkg in sorted(p for p in MODELS_ROOT.iterdir() if (p / "__init__.py").exists()):
        declared = _declared_models_imports(pkg / "__init__.py")
        assert "May import:" in (ast.get_docstring(ast.parse(
            (pkg / "__init__.py").read_text())) or ""), f"models/{pkg.name}: no 'May import:'"
        extra = units.get(f"models.{pkg.name}", set()) - declared - {f"models.{pkg.name}"}
        assert not extra, f"models.{pkg.name} imports {sorted(extra)} beyond its docstring"


def test_layer_kinds_import_one_way():
    """The layer kinds (models/layers/<kind>/) and the shared layer modules beside them
    (models/layers/*.py) form no cycle."""
    def kind(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:3]) if parts[:2] == ["models", "layers"] and len(parts) > 2 \
            else None
    kinds = _unit_graph(_without_empty_inits(_graph()), kind)
    assert len(kinds) >= 8, kinds
    assert _cycle(kinds) is None, f"layer kind cycle: {' -> '.join(_cycle(kinds))}"


def _init_edge_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """The import graph of `sources` ({module path: text}), as _graph builds it."""
    known = {".".join(Path(p).with_suffix("").parts[:-1] if p.endswith("__init__.py")
                      else Path(p).with_suffix("").parts): Path(p) for p in sources}
    return {m: _imported(ast.parse(sources[str(p)]), m, p.name == "__init__.py", known)
            for m, p in known.items()}


def test_cycles_through_package_inits_are_found():
    """Negative controls: issue 42's broken cycle in miniature (quantized -> fam/__init__ ->
    reg -> quantized) and its hidden one (`from pkg import mod` inside pkg while pkg's
    __init__ imports that module's importer) are both cycles of the graph."""
    broken = {"root/__init__.py": "", "root/fam/base.py": "ERRORS = ()\n",
              "root/quantized.py": "from root.fam.base import ERRORS\n",
              "root/fam/__init__.py": "from root.fam import reg\n",
              "root/fam/reg.py": "from root.quantized import VALUE\n"}
    assert _cycle(_init_edge_graph(broken)) is not None
    broken["root/fam/__init__.py"] = '"""Declarations."""\n'
    assert _cycle(_init_edge_graph(broken)) is None
    hidden = {"pkg/__init__.py": "from pkg.tensors import X\n",
              "pkg/tensors.py": "from pkg.registry import R\n",
              "pkg/registry.py": "from pkg.qwen import Q\n",
              "pkg/qwen.py": "from pkg import costs\n", "pkg/costs.py": ""}
    assert _cycle(_init_edge_graph(hidden)) is not None


def _family_places() -> dict[str, tuple[Path, set[str]]]:
    """{place name: (its file or package folder, the model_types declared there)} for every
    family module or package under models/families/ that sets `model_type = "..."`."""
    out: dict[str, tuple[Path, set[str]]] = {}
    for path in sorted(FAMILIES_ROOT.rglob("*.py")):
        rel = path.relative_to(FAMILIES_ROOT)
        place = FAMILIES_ROOT / rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    any(isinstance(t, ast.Name) and t.id in ("model_type", "text_model_type")
                        for t in node.targets) and node.value.value:
                out.setdefault(place.stem, (place, set()))[1].add(node.value.value)
    return out


def _code_strings(tree: ast.AST) -> set[str]:
    """String constants of `tree` other than docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs}


def _family_mentions(texts: dict[Path, str], places) -> dict[str, list[str]]:
    """{place name: files outside the place that name one of its model_types in code or import
    one of its modules}; the registry (one line per family) is the allowed exception."""
    known = _modules()
    parsed = {}
    for path, text in texts.items():
        tree = ast.parse(text)
        parsed[path] = (_code_strings(tree),
                        _imported(tree, _module_name(path), path.name == "__init__.py", known))
    out: dict[str, list[str]] = {}
    for name, (place, types) in places.items():
        module = _module_name(place)
        out[name] = [str(path.relative_to(ROOT)) for path, (strings, deps) in parsed.items()
                     if not (path == place or place in path.parents
                             or path.name == "registry.py")
                     and (strings & types or any(d == module or d.startswith(module + ".")
                                                 for d in deps))]
    return out


def test_each_family_lives_in_one_place():
    """No code outside a family's own module or package names its model_type or imports it,
    except models/families/registry.py; everything else reads the family's declared facts."""
    places = _family_places()
    assert len(places) >= 9, sorted(places)   # the eight families (Qwen2 beside Llama's file)
    texts = {p: p.read_text() for root in SOURCE_ROOTS for p in sorted((ROOT / root).rglob("*.py"))}
    mentions = _family_mentions(texts, places)
    assert all(not hits for hits in mentions.values()), mentions
    # negative control: a layer module that branches on a model_type is found
    texts[MODELS_ROOT / "layers" / "mla" / "module.py"] += '\nKIND = "deepseek_v3"\n'
    assert _family_mentions(texts, places)["deepseek_v3"] == ["models/layers/mla/module.py"]
