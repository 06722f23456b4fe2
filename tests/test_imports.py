"""The front ends reach the library through one door: every module of ``mpsim/cli`` and
``mpsim/web`` imports only ``mpsim.api`` (the facade), ``mpsim.views`` (how results are
shown), ``mpsim.errors``, its own package, the standard library and, in the CLI, click and
rich. The CLI's ``serve`` starts the web page, so the CLI may import ``mpsim.web`` too.
Imports inside functions and under ``TYPE_CHECKING`` count: the modules are read with
``ast``, not imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpsim"
SHARED = ("mpsim.api", "mpsim.views", "mpsim.errors")
ALLOWED = {
    "cli": (*SHARED, "mpsim.cli", "mpsim.web", "click", "rich"),
    "web": (*SHARED, "mpsim.web"),
}


def _imported(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module an import names (``from a import b`` names ``a.b`` as well as ``a``,
    since ``b`` may be a module), with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"line {node.lineno}: a relative import"
            if node.module == "mpsim":  # from mpsim import api: the module is mpsim.api
                found += [(node.lineno, f"mpsim.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _allowed(name: str, allowed: tuple[str, ...]) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return True
    if name == "mpsim.api":  # the facade itself, not its inner modules
        return True
    return any(name == a or name.startswith(a + ".") for a in allowed if a != "mpsim.api")


def _modules(front: str) -> list[Path]:
    return sorted((PACKAGE / front).rglob("*.py"))


@pytest.mark.parametrize("front", sorted(ALLOWED))
def test_front_ends_import_only_the_facade_the_views_and_the_errors(front):
    modules = _modules(front)
    assert modules, f"no modules under mpsim/{front}"
    wrong = []
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imported(tree):
            if not _allowed(name, ALLOWED[front]):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not wrong, "forbidden imports (go through mpsim.api or mpsim.views):\n" + "\n".join(wrong)


def test_the_check_names_a_forbidden_import():
    tree = ast.parse("import json\nfrom mpsim import api\ndef f():\n    from mpsim.data.catalog import load_trace\n")
    names = [name for _, name in _imported(tree) if not _allowed(name, ALLOWED["cli"])]
    assert names == ["mpsim.data.catalog"]
    assert not _allowed("mpsim.api.jobs", ALLOWED["web"]) and not _allowed("matplotlib.pyplot", ALLOWED["web"])
    assert _allowed("mpsim.views.text", ALLOWED["web"]) and _allowed("rich.progress", ALLOWED["cli"])


def test_the_facade_hands_out_what_it_declares():
    """``mpsim.api`` imports its names on first use: the table ``__getattr__`` reads and
    the imports under ``TYPE_CHECKING`` (what type checkers see) name the same things."""
    import mpsim.api as api

    tree = ast.parse((PACKAGE / "api" / "__init__.py").read_text(encoding="utf-8"))
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    declared = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert declared == api._HOME
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_the_command_line_starts_without_the_simulator():
    """``mpsim --help`` loads no simulator, planner, plotting or torch (the facade imports
    on first use, the commands import their views when they run)."""
    heavy = ("torch", "matplotlib", "simpy", "mpsim.sim", "mpsim.planners", "mpsim.data.catalog", "mpsim.views")
    code = f"import sys, mpsim.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_views_print_without_torch():
    """Every command prints through the views: they load no torch (a refusal of a bad input
    in one line should not wait for it)."""
    code = ("import sys, mpsim.views.text, mpsim.views.html, mpsim.views.measured, mpsim.models.hf_fields; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the package's structure: folders by concern, imports one way ---------------------------------

LAYERS = ("errors", "units", "limits", "caches", "datafile", "signals", "native", "native_build", "hardware", "models",
          "data", "timing", "plans", "sim", "planners", "studies", "launch", "views", "api", "web", "cli")
"""The package's parts from the bottom up (a top-level module or a folder): each imports
only from its own part and the parts below it; ``mpsim/__init__.py`` stands on top."""
TOP_LEVEL_MODULES = {"__init__", "errors", "units", "limits", "caches", "datafile", "signals", "native",
                     "native_build"}


def _module_graph() -> dict[str, set[str]]:
    """Every mpsim module and the mpsim modules it imports anywhere (inside functions and
    under TYPE_CHECKING too): ``from a import b`` counts ``a.b`` where that is a module,
    else ``a``."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules or (
                    isinstance(node, ast.ImportFrom) and node.module == "mpsim"):
                assert isinstance(node, ast.ImportFrom) and node.module is not None
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                found |= subs
                if len(subs) < len(node.names):
                    found.add(node.module)
        graph[name] = found - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    return len(LAYERS) if len(parts) == 1 else LAYERS.index(parts[1])


def test_no_module_imports_another_that_imports_it_back():
    """No cycle, not even through an import inside a function."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down_the_layers():
    graph = _module_graph()
    up = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a)]
    assert up == []


def test_the_top_level_is_folders_and_a_handful_of_modules():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert modules == TOP_LEVEL_MODULES
    assert folders == set(LAYERS) - TOP_LEVEL_MODULES
