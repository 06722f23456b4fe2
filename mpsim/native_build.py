"""``mpsim engine build``: compile the simulator's hottest modules (``mpsim.native.MODULES``)
to C extensions with mypyc, into the cache ``mpsim.native`` loads them from.

The build works on a copy of the installed package's Python sources in a scratch
directory (an installed or editable package is never written to), type-checks the
compiled modules there with mypy (the mpsim modules they import, simpy and numpy are read for
their types, silently; other packages are skipped as ``Any``), runs the C compiler
through setuptools in a child process (its output goes to ``build.log`` beside the
build), writes the manifest (each compiled module, and the SHA-256 of every mpsim source
file that importing ``mpsim.sim`` reads) and swaps the new build in whole, so that a
failed or interrupted build leaves the last good one in place.

Ctrl-C or SIGTERM stops the build at once: the child runs in a process group of its own
(with ``TMPDIR`` inside the scratch directory, so the compiler's temporary files land
there), which is sent SIGTERM, then SIGKILL; the scratch directory and the unfinished
build are removed, and ``BuildInterrupted`` says so in one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mpsim import native
from mpsim.signals import Signals, Stopped

OPT_LEVEL = "1"
"""mypyc's optimisation level: 1 compiles in seconds where 3 takes minutes on two cores,
for the same speed of ``bench_simulate --plan swap-heavy`` within its noise."""
MYPY_CONFIG = """\
[mypy]
python_version = {python}
follow_imports = skip
ignore_missing_imports = True
check_untyped_defs = True

[mypy-mpsim.*,simpy.*,numpy.*]
follow_imports = silent
"""
"""The build's mypy settings: the compiled modules are checked, the mpsim modules they
import and simpy and numpy read for their types (silently); every other package is
skipped, read as ``Any``, which changes nothing compiled (the compiled modules reach
those packages through Python calls either way) and keeps a venv with transformers or
Ray installed from costing half a minute of analysis of them."""
CHILD = """\
import os, sys, time
from mypyc.build import mypycify
from setuptools import setup
out, temp, opt, group, *paths = sys.argv[1:]
start = time.perf_counter()
modules = mypycify(paths, opt_level=opt, group_name=group, target_dir=temp + "/c")
print(f"mpsim: mypyc took {time.perf_counter() - start:.1f} s", flush=True)
setup(name=group, ext_modules=modules, script_args=["build_ext", "--build-lib", out, "--build-temp", temp + "/o"])
print(f"mpsim: mypyc and the C compiler took {time.perf_counter() - start:.1f} s", flush=True)
os._exit(0)  # freeing mypy's graph object by object at exit takes as long again
"""
"""What the child process runs in the scratch copy: mypyc, then setuptools' ``build_ext``."""


STOP_GRACE_S = 5.0
"""How long the child's process group has to end on SIGTERM before it is sent SIGKILL."""


class BuildInterrupted(native.EngineError):
    """A build stopped by SIGINT (Ctrl-C) or SIGTERM, its child processes ended and its
    scratch folders removed; the last good build is left as it was."""

    def __init__(self, signum: int, where: Path) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"engine build interrupted by {name}: the compiler was stopped and its scratch folders "
                         f"removed; {where} is as it was before")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by it (130, 143)."""
        return 128 + self.signum


_signals = Signals()
"""The handler ``_signals.installed()`` sets while a run lasts; ``held()`` works whether or not it is."""


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc`` and every process of its group (the C compiler it started): SIGTERM,
    then SIGKILL for what is left after ``STOP_GRACE_S``; ``proc`` is reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group has ended
            break
        if sig == signal.SIGTERM:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
    proc.wait()


def _run_child(args: list[str], cwd: Path, env: dict[str, str], sink: IO[str]) -> int:
    """Run ``args`` in a process group of its own, output to ``sink``; its exit status.
    Anything raised while it runs (``Stopped``, KeyboardInterrupt) ends the whole group
    first."""
    proc = None
    try:
        with _signals.held():
            proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return proc.wait()
    except BaseException:
        if proc is not None:
            _end_group(proc)
        raise


@dataclass(frozen=True)
class BuildReport:
    """What ``build`` made."""

    build_dir: Path
    modules: tuple[str, ...]
    n_sources: int
    """mpsim source files the manifest hashes."""
    seconds: float


def check_toolchain() -> None:
    """Raise ``EngineError`` (one line) when mypyc or the C compiler is missing."""
    if importlib.util.find_spec("mypyc") is None or importlib.util.find_spec("setuptools") is None:
        raise native.EngineError("building the compiled engine needs mypy's compiler (mypyc) and setuptools: "
                                 "pip install 'mpsim[native]'")
    compiler = str(sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        raise native.EngineError(f"building the compiled engine needs a C compiler: {compiler!r} is not on PATH "
                                 "(Debian: apt-get install gcc python3-dev)")
    include = sysconfig.get_path("include")
    if not Path(include, "Python.h").is_file():
        raise native.EngineError(f"building the compiled engine needs Python's headers: no Python.h in {include}")


def copy_sources(package: Path, dest: Path) -> None:
    """The package's ``.py`` files, as a package tree ``dest/mpsim``."""
    for src in package.rglob("*.py"):
        target = dest / "mpsim" / src.relative_to(package)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)


def module_path(module: str) -> str:
    """``mpsim.sim.network`` -> ``mpsim/sim/network.py``."""
    return module.replace(".", "/") + ".py"


def imported_sources(src: Path) -> dict[str, str]:
    """Relative path (to the package) -> SHA-256 of every mpsim file that importing
    ``mpsim.sim`` from ``src`` reads, found by importing it there with the Python engine."""
    probe = ("import json, sys, mpsim.sim\n"
             "print(json.dumps(sorted({m.__file__ for n, m in sys.modules.items()"
             " if n.split('.')[0] == 'mpsim' and getattr(m, '__file__', None)})))")
    env = {**os.environ, "MPSIM_ENGINE": "python", "PYTHONPATH": str(src)}
    with _signals.held():  # a second or two; a signal meanwhile stops the build after it
        done = subprocess.run([sys.executable, "-c", probe], cwd=src, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise native.EngineError(f"importing the copied sources failed: {done.stderr.strip().splitlines()[-1:]}")
    package = (src / "mpsim").resolve()
    files = [Path(f).resolve() for f in json.loads(done.stdout)]
    return {str(f.relative_to(package)): native.file_sha256(f) for f in files}


def compile_into(src: Path, out: Path, modules: Sequence[str], opt_level: str, log: Path) -> None:
    """Run mypyc and the C compiler on ``modules`` of the copy in ``src``, extensions
    into ``out``; the child's output to ``log``."""
    (src / "mypy.ini").write_text(MYPY_CONFIG.format(python=f"{sys.version_info[0]}.{sys.version_info[1]}"))
    args = [sys.executable, "-c", CHILD, str(out), str(src / "build"), opt_level, native.GROUP,
            *(module_path(m) for m in modules)]
    tmp = src / "tmp"  # the compiler's temporary files, removed with the scratch directory
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "MPSIM_ENGINE": "python", "PYTHONPATH": str(src), "TMPDIR": str(tmp)}
    with log.open("w") as sink:
        code = _run_child(args, src, env, sink)
    if code != 0:
        raise native.EngineError(f"mypyc or the C compiler failed (exit {code}); its output is in {log}")


def build_engine(modules: Sequence[str] = native.MODULES, where: Path | None = None,
                 opt_level: str = OPT_LEVEL) -> BuildReport:
    """Compile ``modules`` into ``where`` (default ``native.build_dir()``), replacing what
    is there only once the new build is complete. Ctrl-C or SIGTERM ends the child
    processes, removes the scratch folders and raises ``BuildInterrupted``."""
    unknown = [m for m in modules if m not in native.MODULES]
    if unknown or not modules:
        raise native.EngineError(f"cannot compile {', '.join(unknown) or 'nothing'}: "
                                 f"the compiled engine's modules are {', '.join(native.MODULES)}")
    check_toolchain()
    where = native.build_dir() if where is None else where
    with _signals.installed():
        try:
            return _build(modules, where, opt_level)
        except Stopped as exc:
            raise BuildInterrupted(exc.signum, where) from None
        except KeyboardInterrupt:  # raised some other way (this handler turns SIGINT into Stopped)
            raise BuildInterrupted(signal.SIGINT, where) from None


def _build(modules: Sequence[str], where: Path, opt_level: str) -> BuildReport:
    where.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    out = where.with_name(f".{where.name}.new-{os.getpid()}")  # beside the build: renamed in place at the end
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix="mpsim-engine-") as scratch:
            src = Path(scratch, "src")
            copy_sources(native.package_root(), src)
            log = where.parent / f"{where.name}.build.log"
            compile_into(src, out, modules, opt_level, log)  # the log stays beside the build
            sources = imported_sources(src)
        manifest = {"modules": list(modules), "group": native.GROUP, "sources": sources, "opt_level": opt_level,
                    "python": sys.version.split()[0], "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (out / native.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        swap_in(out, where)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return BuildReport(where, tuple(modules), len(sources), time.perf_counter() - start)


def swap_in(new: Path, where: Path) -> None:
    """Put the build in ``new`` (a directory beside ``where``) at ``where`` by renaming:
    the old build, if any, is renamed aside first and removed after. A process that has
    loaded the old build keeps its mapped files; a new one finds the new build whole."""
    old = where.with_name(f".{where.name}.old-{os.getpid()}")
    if where.exists():
        where.rename(old)
    try:
        new.rename(where)
    except OSError as exc:  # another build renamed its own in meanwhile
        raise native.EngineError(f"another build finished in {where} meanwhile ({exc.strerror}); "
                                 "`mpsim engine status` says whether it is in use") from exc
    finally:
        shutil.rmtree(old, ignore_errors=True)


def remove_engine(where: Path | None = None) -> tuple[Path, bool]:
    """Delete the build (``mpsim engine clean``): where it was looked for, and whether
    there was one."""
    where = native.build_dir() if where is None else where
    if not where.exists():
        return where, False
    shutil.rmtree(where)
    return where, True
