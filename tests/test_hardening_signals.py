"""Ctrl-C and SIGTERM leave nothing running (issue 45, item 4).

- ``mpsim validate``: SIGTERM killed mpsim alone; torchrun (in mpsim's process group but
  not signalled) and its ranks (each in a session of its own, as torch's elastic agent
  starts them) ran on, and the scratch folder stayed. The run now ends torchrun's group and
  every rank's, removes the scratch folder (torchrun's temporary files land in it) and says
  so in one line, exit 128 + the signal.
- ``choose --tokens``, ``choose`` and ``fits`` with ``-j 2``: SIGTERM killed the main
  process at once (no handler), so the pool was never shut down and multiprocessing's
  resource tracker warned of the pool's "leaked semaphore objects"; no line said what
  happened. SIGTERM now stops the pool as Ctrl-C does, with one line and exit 143.

Each test runs the real command in a process of its own, waits (watching ``/proc``) until
its children run, signals it, and checks the exit code, standard error and that no process
of its tree is left. The bounds only turn a hang into a failure (a busy 2-core machine may
be slow); no duration is asserted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or not hasattr(os, "killpg"),
                                reason="needs Linux's /proc and process groups")

BOUND_S = 300
"""The longest a step is waited for before the test fails (seconds at most, unloaded)."""
GONE_S = 60
"""How long the processes of the tree have, after the command has exited, to be gone."""


def _processes() -> dict[int, tuple[str, int]]:
    """pid -> (state, parent pid) of every process."""
    seen = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seen[int(entry.name)] = (fields[0], int(fields[1]))
    return seen


def _tree(root: int) -> set[int]:
    """``root``'s descendants (not ``root``)."""
    parents = {pid: ppid for pid, (_, ppid) in _processes().items()}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pids: set[int]) -> dict[int, str]:
    """Which of ``pids`` still run (zombies, which run nothing, left out), with their command lines."""
    return {pid: _cmdline(pid)[-100:] for pid, (state, _) in _processes().items() if pid in pids and state != "Z"}


def _ctrl_c_default() -> None:
    """In the command's process before it starts: SIGINT at its default, as in a terminal (a
    test runner started in the background ignores SIGINT, and a child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signalled(args: list[str], started: str, count: int, signum: int, tmp_path: Path) -> tuple[int, str, set[int]]:
    """Run ``mpsim ARGS`` (``TMPDIR`` under ``tmp_path``), wait until ``count`` processes of its
    tree have ``started`` in their command line, send it ``signum``; its exit code, standard
    error, and the processes its tree held (waited for to be gone, within ``GONE_S``)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "MPSIM_PROGRESS_EVERY_S": "3600"}
    proc = subprocess.Popen([sys.executable, "-m", "mpsim.cli", *args], env=env, cwd=tmp_path, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_ctrl_c_default)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            seen |= _tree(proc.pid)
            if sum(started in _cmdline(pid) for pid in _running(seen)) >= count:
                break
            if proc.poll() is not None:
                pytest.fail(f"mpsim {' '.join(args)} ended before it was signalled: {proc.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{count} processes running {started!r} never appeared")
            time.sleep(0.02)
        seen |= _tree(proc.pid)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=BOUND_S)
        deadline = time.monotonic() + GONE_S
        while _running(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc.returncode, err, seen
    finally:  # whatever this test started and is still running, ended by its id
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _running(seen | _tree(proc.pid)):
            if started in _cmdline(pid) or "torch.distributed.run" in _cmdline(pid) or "multiprocessing" in \
                    _cmdline(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.torchrun
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signalled_validate_ends_torchrun_and_its_ranks_and_removes_its_scratch(tmp_path, signum):
    # gpt-tiny on two CPU stages (gloo), far more steps than it runs before the signal
    code, err, seen = _signalled(["validate", "--strategy", "none", "--steps", "100000", "--warmup", "0"],
                                 "mpsim.executor.executor", 3, signum, tmp_path)  # torchrun and its 2 ranks
    assert _running(seen) == {}, "left running after validate ended"
    assert code == 128 + signum, err  # 143 for SIGTERM, 130 for Ctrl-C, as a shell reports them
    assert err.splitlines() == [f"mpsim: validate interrupted by {signal.Signals(signum).name}: torchrun and its "
                                "ranks were stopped and the scratch folder removed"]
    # the scratch folder is gone, with torchrun's own folders in it; torch's per-user compile
    # cache, which measuring the model here makes in TMPDIR and every later run shares, stays
    left = [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []


def test_a_torchrun_that_ignores_sigterm_is_killed_with_its_ranks(tmp_path, monkeypatch):
    """After ``STOP_GRACE_S`` every group of the run gets SIGKILL: torchrun's, and that of a
    rank in a session of its own (as torch starts them) that ignores SIGTERM too."""
    from mpsim.studies import hardware_check as hc

    monkeypatch.setattr(hc, "STOP_GRACE_S", 0.5)
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)'], "
                "start_new_session=True); time.sleep(600)")
    log = tmp_path / "log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=sink, start_new_session=True)
    deadline = time.monotonic() + BOUND_S
    while log.read_text() != "1\n" and time.monotonic() < deadline:
        time.sleep(0.01)
    rank = _tree(proc.pid)
    assert len(rank) == 1
    try:
        hc._end_run(proc)
        deadline = time.monotonic() + GONE_S
        while _running(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.returncode == -signal.SIGKILL
        assert _running(rank) == {}
    finally:
        for pid in _running(rank):
            os.kill(pid, signal.SIGKILL)


SEARCHES = {
    "choose-tokens": ["choose", "-m", "llama-3-8b", "--tokens", "1e12", "--clusters", "aws-p4d", "-j", "2"],
    "choose": ["choose", "-m", "llama-3-8b", "--servers", "dgx-a100-80gb,dgx-h100,dgx1-v100", "-j", "2"],
    "fits": ["fits", "-m", "gpt-5.3b", "-j", "2"],
}


@pytest.mark.processes
@pytest.mark.parametrize(("search", "signum"), [("choose-tokens", signal.SIGTERM), ("choose", signal.SIGTERM),
                                                ("fits", signal.SIGTERM), ("choose-tokens", signal.SIGINT)])
def test_a_signalled_parallel_search_stops_its_workers_in_one_line(tmp_path, search, signum):
    args = SEARCHES[search]
    code, err, seen = _signalled(args, "multiprocessing.spawn", 2, signum, tmp_path)  # both workers
    assert _running(seen) == {}, "left running after the search ended"
    assert code == 128 + signum, err
    assert err.splitlines() == [f"mpsim: {args[0]} interrupted by {signal.Signals(signum).name}: stopped with its "
                                "worker processes, if any; nothing was written"]  # no resource_tracker warning


class _Raised(BaseException):
    pass


def _raise(signum, frame):
    raise _Raised


def test_a_sigterm_while_workers_start_is_raised_once_they_have():
    """The main thread's submits (which start the workers) run with SIGTERM held: a handler
    that raised in the middle of starting one left a worker that never got its start-up
    data, in no table, holding the pool's call queue open, and the process hung at exit."""
    from mpsim.studies.backends import LocalBackend

    submitted: list[tuple] = []

    class Pool:
        def submit(self, fn, *args):
            if not submitted:
                os.kill(os.getpid(), signal.SIGTERM)  # as if it came while the first worker starts
            submitted.append(args)
            return object()

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        with pytest.raises(_Raised):
            LocalBackend._submit(Pool(), [[1], [2], [3]], abs)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(submitted) == 3


def test_a_worker_started_while_the_pool_stops_is_ended_too():
    """``shutdown`` drops the pool's table of workers and its manager thread: both are taken
    before it, so a worker that another thread's submit started meanwhile (it lands in the
    table) is terminated, and the manager thread is waited for."""
    from mpsim.studies.backends import _stop_pool

    class Worker:
        def __init__(self):
            self.ended = False

        def terminate(self):
            self.ended = True

        kill = terminate

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return not self.ended

    class Manager:
        joined = False

        def join(self, timeout=None):
            Manager.joined = True

    early, late = Worker(), Worker()

    class Pool:
        _processes: dict[int, Worker] | None = {1: early}
        _executor_manager_thread: Manager | None = Manager()

        def shutdown(self, wait, cancel_futures):
            assert self._processes is not None
            self._processes[2] = late  # a submit that held the pool's lock first
            self._processes = None
            self._executor_manager_thread = None

    _stop_pool(Pool())  # type: ignore[arg-type]
    assert early.ended and late.ended and Manager.joined
