"""SIGTERM or Ctrl-C during ``mpsim engine build`` (issue 45) left mypyc and the C compiler
running and the scratch folders behind: the Python process died at once and its child,
in the same process group but not signalled, carried on. The build now runs the child in
a process group of its own, ends that group on SIGTERM or SIGINT, removes its scratch
folders and says so in one line.

Each test runs a real ``mpsim engine build`` (into a cache under ``tmp_path``, with
``TMPDIR`` there so its scratch folder can be watched), signals it at a point seen in
``/proc``, and checks what is left. The bounds only turn a hang into a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsim import native, native_build

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(os, "killpg"),
                                reason="needs Linux's /proc and process groups")

BOUND_S = 600
"""The longest any step is waited for (a build takes seconds; 2 busy cores may be slow)."""


def _processes() -> dict[int, tuple[str, int, int, str]]:
    """pid -> (state, parent pid, process group, command name) of every process."""
    seen = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seen[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]), comm)
    return seen


def _tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents = {pid: ppid for pid, (_, ppid, _, _) in _processes().items()}
    found, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in found]
        found.update(children)
        frontier = children
    return found


def _running(pids: set[int]) -> list[tuple[int, str]]:
    """Which of ``pids`` still run (zombies, which run nothing, left out)."""
    return [(pid, comm) for pid, (state, _, _, comm) in _processes().items() if pid in pids and state != "Z"]


@pytest.fixture
def toolchain() -> None:
    try:
        native_build.check_toolchain()
    except native.EngineError as exc:
        pytest.skip(str(exc))


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path, Path]:
    scratch_root, cache = tmp_path / "tmp", tmp_path / "cache"
    scratch_root.mkdir()
    env = {**os.environ, "MPSIM_CACHE_DIR": str(cache), "TMPDIR": str(scratch_root)}
    env.pop("MPSIM_ENGINE", None)
    proc = subprocess.Popen([sys.executable, "-m", "mpsim.cli", "engine", "build"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    return proc, scratch_root, cache


def _wait_for_child(proc: subprocess.Popen[str], scratch_root: Path, with_compiler: bool) -> int:
    """The build's child, once the scratch folder is there and the child runs
    (``with_compiler``: once the child has started another process, the C compiler)."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the build ended before it was signalled: {proc.communicate()}")
        if any(scratch_root.glob("mpsim-engine-*")):
            children = sorted(_tree(proc.pid) - {proc.pid})
            if children and (not with_compiler or len(children) > 1):
                return children[0]
        time.sleep(0.01)
    pytest.fail("the build's child or compiler never appeared")


@pytest.mark.parametrize(("signum", "with_compiler"), [(signal.SIGTERM, True), (signal.SIGINT, False)],
                         ids=["sigterm-while-compiling", "ctrl-c-while-mypyc-runs"])
def test_a_signalled_build_ends_its_children_and_removes_its_scratch(tmp_path, toolchain, signum, with_compiler):
    proc, scratch_root, cache = _start(tmp_path)
    tree: set[int] = set()
    try:
        child = _wait_for_child(proc, scratch_root, with_compiler)
        tree = _tree(proc.pid) - {proc.pid}
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=BOUND_S)
        # the build reaps its child before it exits, so the child is gone by now (before the
        # fix it ran on, compiling, for seconds after); what the child started was sent
        # SIGTERM, then SIGKILL, and goes within moments
        leader_left = _running({child})
        deadline = time.monotonic() + 60
        while _running(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _running(tree)
    finally:  # whatever this test started and is still running, ended by its id
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, _ in _running(_tree(proc.pid) | set().union(*(_tree(p) for p in tree))):
            if pid != proc.pid:
                os.kill(pid, signal.SIGKILL)
    assert leader_left == [], f"the build's child still ran after the build ended: {leader_left}"
    assert left == [], f"still running after the build ended: {left}"
    where = cache / "engine" / native.abi_tag()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err  # 143 for SIGTERM, 130 for Ctrl-C, as a shell reports them
    assert err.splitlines()[-1] == (f"mpsim: engine build interrupted by {name}: the compiler was stopped "
                                    f"and its scratch folders removed; {where} is as it was before")
    assert list(scratch_root.iterdir()) == []  # the scratch folder and the compiler's files in it
    assert sorted(p.name for p in where.parent.iterdir()) == [f"{where.name}.build.log"]  # no half build
    assert os.getpgid(os.getpid()) != child  # the child led a group of its own, ended whole


def test_a_child_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    """The group gets SIGKILL after ``STOP_GRACE_S`` when SIGTERM does not end it."""
    monkeypatch.setattr(native_build, "STOP_GRACE_S", 0.5)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(600)"
    log = tmp_path / "log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=sink, start_new_session=True)
    deadline = time.monotonic() + BOUND_S
    while log.read_text() != "up\n" and time.monotonic() < deadline:
        time.sleep(0.01)
    native_build._end_group(proc)
    assert proc.returncode == -signal.SIGKILL
