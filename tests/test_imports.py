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
    tree = ast.parse("import json\nfrom mpsim import api\ndef f():\n    from mpsim.catalog import load_trace\n")
    names = [name for _, name in _imported(tree) if not _allowed(name, ALLOWED["cli"])]
    assert names == ["mpsim.catalog"]
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
    heavy = ("torch", "matplotlib", "simpy", "mpsim.sim", "mpsim.planners", "mpsim.catalog", "mpsim.views")
    code = f"import sys, mpsim.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_views_print_without_torch():
    """Every command prints through the views: they load no torch (a refusal of a bad input
    in one line should not wait for it)."""
    code = ("import sys, mpsim.views.text, mpsim.views.html, mpsim.views.measured, mpsim.hf_fields; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
