"""The package's shape, read from its source with ``ast``: no import cycle between library modules
(imports inside functions and imports of a package's ``__init__`` counted), no import reaching up
a layer, no framework named outside ``layouts/`` and ``naming/``, no file over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckpt_tools"

# A module may import its own folder and the folders of lower rank; folders of equal rank are
# independent of each other (the engine knows no format, a format knows no engine).
LAYERS = {
    "errors": 0, "_version": 0,
    "core": 1, "runtime": 1,
    "security": 2,
    "storage": 3,
    "codecs": 4,
    "engine": 5, "formats": 5, "hf": 5,
    "naming": 6,
    "layouts": 7,
    "commands": 8,
    "__init__": 9, "cli": 10, "__main__": 11,
}
FRAMEWORKS = {"verl", "torchtitan", "accelerate", "trainer", "deepspeed", "megatron"}
MAX_LINES = 600


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``), the CLI under its installed name."""
    found = {}
    for base, prefix in ((PACKAGE, "ckpt_tools"), (ROOT / "cli", "ckpt_tools.cli")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = (path, is_pkg)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The library modules ``name`` imports, anywhere in its body: ``from X import m`` of a module
    ``X.m`` is that module; of any other name, ``X`` itself (a package's ``__init__``)."""
    path, is_pkg = MODULES[name]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_package():
    """The checks below would pass on an empty graph: the walk must find what is there."""
    assert {"ckpt_tools.commands.convert", "ckpt_tools.engine.execute", "ckpt_tools.formats.dcp"} <= set(MODULES)
    assert "ckpt_tools.core.plan" in GRAPH["ckpt_tools.engine.stream"]
    assert "ckpt_tools.layouts" in GRAPH["ckpt_tools.commands.convert"]  # a package __init__ counts
    assert "ckpt_tools.security.safeload" in GRAPH["ckpt_tools.engine.reader"]  # so do imports in functions


def test_no_import_cycle():
    assert _cycles() == []


def test_a_cycle_would_be_found():
    """The cycle finder itself, on a graph with one."""
    saved = dict(GRAPH)
    try:
        GRAPH["ckpt_tools.core.plan"] = GRAPH["ckpt_tools.core.plan"] | {"ckpt_tools.engine.stream"}
        assert any("ckpt_tools.core.plan" in c and "ckpt_tools.engine.stream" in c for c in _cycles())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_every_folder_has_a_layer():
    assert {_layer(m) for m in MODULES} <= set(LAYERS), sorted({_layer(m) for m in MODULES} - set(LAYERS))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name):
    """A module imports its own folder or lower layers, never up or sideways."""
    mine = _layer(name)
    wrong = sorted(m for m in GRAPH[name]
                   if _layer(m) != mine and LAYERS[_layer(m)] >= LAYERS[mine])
    assert not wrong, f"{name} ({mine}, layer {LAYERS[mine]}) imports " + ", ".join(
        f"{m} ({_layer(m)}, layer {LAYERS[_layer(m)]})" for m in wrong)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _layer(m) not in ("layouts", "naming")))
def test_frameworks_named_only_at_the_edge(name):
    """The core decides nothing by a framework's name: such a string is a layout's or a naming
    scheme's to hold (docstrings and messages may mention them; a constant may not)."""
    path, _ = MODULES[name]
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    # a format module may name its own format, a word of CONTRACT.md (`deepspeed`)
    own = {path.stem} if _layer(name) == "formats" else set()
    named = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings
                    and isinstance(n.value, str) and n.value.lower() in FRAMEWORKS - own})
    assert not named, f"{path.relative_to(ROOT)} names {named}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_stay_small(name):
    path, _ = MODULES[name]
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: split it by responsibility"


def test_few_modules_at_the_top():
    """The top of ``ckpt_tools/`` holds the public API and what every layer shares; the rest
    lives in folders named for what they hold."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_version.py", "errors.py"], top
