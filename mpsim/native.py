"""The compiled engine: the simulator's hottest modules compiled to C with mypyc
(``mpsim engine build``, ``mpsim.native_build``), loaded in place of their Python
sources when, and only when, they were built from the sources installed now.

A build lives in ``<cache>/engine/<ABI>/`` (``MPSIM_CACHE_DIR``, default
``~/.cache/mpsim``; ABI as in an extension's file name, ``cpython-311-x86_64-linux-gnu``):
one extension per compiled module, the library they share (``GROUP``) and
``manifest.json``. The manifest names the compiled modules and the SHA-256 of every
mpsim source file that importing the simulator reads: mypyc builds into the C what it
read of the types of the modules they import, so an edit to any of them makes the build
stale.

``install`` runs first on importing ``mpsim.sim`` (this module imports nothing of the
simulator, so ``mpsim engine build`` runs whatever ``MPSIM_ENGINE`` says). ``MPSIM_ENGINE`` says what it does:
``auto`` (default) loads a build whose every file still hashes as recorded, else runs
the Python sources; ``python`` never loads one; ``compiled`` loads one or raises
``EngineError``. A build is loaded by an import hook placed first on ``sys.meta_path``
that answers for the compiled modules and their shared library only. The compiled
modules compute what the Python ones do, bit for bit
(``benchmarks/engine_equivalence.py --native``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from mpsim.errors import MpsimError

MODULES = ("mpsim.sim.network", "mpsim.sim.memory", "mpsim.sim.stream", "mpsim.sim.swapper", "mpsim.sim.context",
           "mpsim.sim.channels", "mpsim.sim.copy_engine")
"""What ``mpsim engine build`` compiles: the modules that run at every event of a
swap-heavy run (``benchmarks/bench_simulate.py --plan swap-heavy``'s profile). Not
``simpy_fast``: it makes events without calling their ``__init__`` (``Fired.__new__``),
which a compiled class does not allow; compiled with ``Fired`` moved to a module of its
own, it gained nothing measurable on the README's ``fits`` or the swap-heavy plan."""
GROUP = "mpsim_engine"
"""mypyc's group name: the shared library is the top-level module ``mpsim_engine__mypyc``."""
MODES = ("auto", "python", "compiled")
MANIFEST = "manifest.json"


class EngineError(MpsimError):
    """The compiled engine was asked for and cannot be used, or cannot be built."""


@dataclass(frozen=True)
class EngineState:
    """Which engine this process runs and why (``mpsim engine status``)."""

    mode: str
    """``MPSIM_ENGINE``: auto, python or compiled."""
    build_dir: Path
    """Where a build for this Python is looked for."""
    paths: dict[str, Path] = field(default_factory=dict)
    """Module name -> extension file of each compiled module and of their shared library
    (empty: every module runs from its Python source)."""
    reason: str = ""
    """Why none are, when none are: not built, stale (which file), or turned off."""
    manifest: dict[str, object] = field(default_factory=dict)

    @property
    def compiled(self) -> tuple[str, ...]:
        """The modules loaded compiled (the shared library left out)."""
        return tuple(name for name in self.paths if name.startswith("mpsim."))

    @property
    def in_use(self) -> bool:
        return bool(self.paths)

    def describe(self) -> str:
        """One line: the engine and, for the Python one, why."""
        if self.in_use:
            n = len(self.compiled)
            return f"compiled ({n} module{'s' if n != 1 else ''} from {self.build_dir})"
        return f"python ({self.reason})"


def abi_tag() -> str:
    """This interpreter's extension tag (``cpython-311-x86_64-linux-gnu``)."""
    suffix = str(sysconfig.get_config_var("EXT_SUFFIX") or importlib.machinery.EXTENSION_SUFFIXES[0])
    return suffix.removesuffix(".so").removesuffix(".pyd").strip(".") or sys.implementation.cache_tag


def cache_root() -> Path:
    """``MPSIM_CACHE_DIR``, else ``~/.cache/mpsim``."""
    root = os.environ.get("MPSIM_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mpsim"


def build_dir() -> Path:
    """Where the build for this interpreter lives."""
    return cache_root() / "engine" / abi_tag()


def package_root() -> Path:
    """The installed ``mpsim`` package's directory (its sources, for the hashes)."""
    return Path(__file__).resolve().parent


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def engine_mode() -> str:
    """``MPSIM_ENGINE`` checked: one of ``MODES``."""
    mode = os.environ.get("MPSIM_ENGINE", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise EngineError(f"MPSIM_ENGINE={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def read_manifest(where: Path) -> dict[str, object] | None:
    """The build's manifest in ``where``, or None when there is no readable one."""
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def stale_file(manifest: dict[str, object], root: Path) -> str | None:
    """The first source file (relative to ``root``) whose hash differs from the build's,
    or that is gone; None when the build matches the sources."""
    sources = manifest.get("sources")
    if not isinstance(sources, dict) or not sources:
        return MANIFEST
    for rel, digest in sources.items():
        path = root / rel
        try:
            if file_sha256(path) != digest:
                return str(rel)
        except OSError:
            return str(rel)
    return None


def extension_paths(manifest: dict[str, object], where: Path) -> dict[str, Path] | None:
    """Module name -> extension file for every compiled module and the shared library;
    None when one is missing."""
    modules = manifest.get("modules")
    group = manifest.get("group")
    if not isinstance(modules, list) or not isinstance(group, str):
        return None
    names = [*(str(m) for m in modules), f"{group}__mypyc"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    paths = {name: where / (name.replace(".", "/") + suffix) for name in names}
    return paths if all(p.is_file() for p in paths.values()) else None


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Answers for the compiled modules and their shared library only."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        where = self.paths.get(fullname)
        if where is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(where))
        return importlib.util.spec_from_file_location(fullname, where, loader=loader)


def engine_status(mode: str | None = None, where: Path | None = None,
                  root: Path | None = None) -> EngineState:
    """The engine a new process would run (what ``install`` would do, without doing it):
    the build in ``where`` checked against the sources in ``root`` now."""
    mode = engine_mode() if mode is None else mode
    where = build_dir() if where is None else where
    if mode == "python":
        return EngineState(mode, where, reason="MPSIM_ENGINE=python")
    manifest = read_manifest(where)
    if manifest is None:
        return EngineState(mode, where, reason="not built: `mpsim engine build` compiles it")
    stale = stale_file(manifest, package_root() if root is None else root)
    if stale is not None:
        return EngineState(mode, where, reason=f"stale: {stale} changed since the build; `mpsim engine build` again",
                           manifest=manifest)
    paths = extension_paths(manifest, where)
    if paths is None:
        return EngineState(mode, where, reason=f"incomplete build in {where}; `mpsim engine build` again",
                           manifest=manifest)
    return EngineState(mode, where, paths=paths, manifest=manifest)


_STATE: EngineState | None = None


def install() -> EngineState:
    """Decide once per process which engine runs (``engine_status``) and, for the compiled one,
    put its import hook first on ``sys.meta_path``. Must run before any compiled module
    is imported (``mpsim.sim``'s first line)."""
    global _STATE
    if _STATE is not None:
        return _STATE
    state = engine_status()
    if state.mode == "compiled" and not state.in_use:
        raise EngineError(f"MPSIM_ENGINE=compiled, but the compiled engine cannot be used: {state.reason}")
    if state.in_use:
        sys.meta_path.insert(0, _CompiledFinder(state.paths))
    _STATE = state
    return state


def state() -> EngineState:
    """This process's engine (``install``'s decision)."""
    return install()
