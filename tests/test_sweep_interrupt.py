"""Sweeps stopped by Ctrl-C, SIGTERM or kill -9: a real ``mpsim sweep -j 2`` in a process
group of its own, interrupted once a row is in the CSV. It stops at once with the rows kept,
leaves no worker behind, and a rerun resumes and runs every point exactly once.

"At once" is asserted by counting, not timing (a busy CI machine must not fail it): after
the signal at most one more row per worker is written, the results already back. The
stop times are printed (``pytest -s``); without the fix a stop took about a minute."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from mpsim.studies.sweep import FIELDS, KEY, grid, sweep

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")

# big enough models that the sweep takes seconds, and one point per task so the first row
# comes early: on a busy machine the signal must still find the sweep running
MODELS, SIZES, STRATEGIES = "gpt-10.3b,gpt-15.4b", "1,2,4,8", "none,recompute,cpu-swap,mpress"
N_POINTS = 2 * 4 * 4
WORKERS = 2
REAP_WAIT_S = 15.0
"""How long to wait for the group's processes to be gone before naming those left."""


def _cmd(csv_path: Path, *python_flags: str) -> list[str]:
    return [sys.executable, *python_flags, "-m", "mpsim.cli", "sweep", "--model", MODELS, "--microbatch", SIZES,
            "--strategy", STRATEGIES, "-j", str(WORKERS), "--batch", "1", "--csv", str(csv_path)]


def ctrl_c_default() -> None:
    """In the sweep's process before it starts: SIGINT at its default, as in a terminal.
    A test runner started in the background by a non-interactive shell ignores SIGINT, and
    a child would inherit that (Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _rows(csv_path: Path) -> int:
    try:
        return max(0, csv_path.read_bytes().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of the group that are still running (a zombie left for a non-reaping init
    to collect has exited)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    alive = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(d.name))
    return alive


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[-80:]
    except OSError:
        return "?"


def _interrupt(tmp_path: Path, send) -> tuple[int, int, str, Path]:
    """Start the sweep, wait for its first row, ``send(pid)``; the exit code, the rows on
    disk when the signal was sent, standard error and the CSV."""
    csv_path = tmp_path / "s.csv"
    err_path = tmp_path / "err.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(_cmd(csv_path), stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path,
                                start_new_session=True, preexec_fn=ctrl_c_default)
    try:
        deadline = time.monotonic() + 120
        while _rows(csv_path) < 1:
            assert proc.poll() is None, "the sweep ended before its first row"
            assert time.monotonic() < deadline, "no row after 120 s"
            time.sleep(0.02)
        rows_at_signal = _rows(csv_path)
        assert rows_at_signal < N_POINTS, "the sweep finished before it could be interrupted"
        t0 = time.monotonic()
        send(proc.pid)
        code = proc.wait(timeout=60)
        stop_s = time.monotonic() - t0
        deadline = time.monotonic() + REAP_WAIT_S
        while _alive_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {pid: _cmdline(pid) for pid in _alive_in_group(proc.pid)}
        assert not left, f"processes left behind: {left}"
    finally:
        if proc.poll() is None or _alive_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"\nstopped {stop_s:.2f} s after the signal, {_rows(csv_path)} of {N_POINTS} rows kept")
    return code, rows_at_signal, err_path.read_text(), csv_path


def _check_rows_unique(csv_path: Path) -> pd.DataFrame:
    frame = pd.read_csv(csv_path, keep_default_na=False)
    assert tuple(frame.columns) == FIELDS
    assert not frame.duplicated(list(KEY)).any()
    return frame


def _rerun_completes(tmp_path: Path, csv_path: Path) -> None:
    """The same command again, warnings as errors: it resumes and every point is there once."""
    before = len(_check_rows_unique(csv_path))
    done = subprocess.run(_cmd(csv_path, "-W", "error"), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "Traceback" not in done.stderr
    frame = _check_rows_unique(csv_path)
    assert len(frame) == N_POINTS and f"{N_POINTS} points in" in done.stdout
    assert before >= 1


@pytest.mark.processes
@pytest.mark.parametrize("how, signum, code", [
    ("sigint-group", signal.SIGINT, 130),  # Ctrl-C in a terminal
    ("sigint-parent", signal.SIGINT, 130),
    ("sigterm-parent", signal.SIGTERM, 143),
])
def test_an_interrupted_parallel_sweep_stops_at_once_and_resumes(tmp_path, how, signum, code):
    send = (lambda pid: os.killpg(pid, signum)) if how.endswith("group") else (lambda pid: os.kill(pid, signum))
    got, rows_at_signal, err, csv_path = _interrupt(tmp_path, send)
    assert got == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"mpsim: sweep interrupted by {signal.Signals(signum).name}: ")
    assert f"of {N_POINTS} points kept in" in last and "run the same command again to resume" in last
    assert "Traceback" not in err and "Warning" not in err
    kept = len(_check_rows_unique(csv_path))
    assert 1 <= kept < N_POINTS and f": {kept} of {N_POINTS}" in last
    assert kept <= rows_at_signal + WORKERS  # stopped at once: only results already back were written
    _rerun_completes(tmp_path, csv_path)


@pytest.mark.processes
def test_a_killed_sweep_leaves_no_worker_and_loses_only_points_in_flight(tmp_path):
    got, _, _, csv_path = _interrupt(tmp_path, lambda pid: os.kill(pid, signal.SIGKILL))
    assert got == -signal.SIGKILL
    _rerun_completes(tmp_path, csv_path)


def _points():
    return grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", [1, 2], [16], ["none", "recompute"])


def test_a_last_line_cut_short_is_dropped_on_resume(tmp_path):
    path = tmp_path / "s.csv"
    sweep(_points()[:3], path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-25])  # the third row cut in the middle, as a kill during its write
    notes: list[str] = []
    frame = sweep(_points(), path, note=notes.append)
    assert len(notes) == 1 and "dropped a last line cut short" in notes[0]
    assert len(frame) == 4
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert all(len(r) == len(FIELDS) for r in rows) and len(rows) == 5
    assert len({tuple(r[:len(KEY)]) for r in rows[1:]}) == 4


def test_a_last_line_with_too_few_columns_is_dropped(tmp_path):
    path = tmp_path / "s.csv"
    sweep(_points()[:1], path)
    with path.open("a") as f:
        f.write("dgx1-v100,gpt-5.3b,1f1b\n")
    notes: list[str] = []
    assert len(sweep(_points(), path, note=notes.append)) == 4
    assert len(notes) == 1 and len(_check_rows_unique(path)) == 4


def test_a_line_glued_onto_a_cut_one_is_dropped(tmp_path):
    """What older versions left: a cut row with the next row appended to it."""
    path = tmp_path / "s.csv"
    sweep(_points()[:3], path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1][:30] + lines[2] + lines[3])
    notes: list[str] = []
    frame = sweep(_points(), path, note=notes.append)
    assert len(notes) == 1 and "malformed" in notes[0]
    assert len(frame) == 4 and len(_check_rows_unique(path)) == 4


def test_a_header_cut_short_starts_the_file_again(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("server,model,sched")
    notes: list[str] = []
    assert len(sweep(_points(), path, note=notes.append)) == 4
    assert len(notes) == 1 and len(_check_rows_unique(path)) == 4


@pytest.mark.processes
def test_cli_notes_the_dropped_line_and_a_sweep_warns_nothing(tmp_path):
    path = tmp_path / "s.csv"
    sweep(_points()[:2], path)
    path.write_bytes(path.read_bytes()[:-5])
    done = subprocess.run([sys.executable, "-W", "error", "-m", "mpsim.cli", "sweep", "--model", "gpt-5.3b",
                           "--microbatch", "1,2", "--strategy", "none,recompute", "-j", "2", "--csv", str(path),
                           "--plot", str(tmp_path / "s.png")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        f"mpsim: note: {path}: dropped a last line cut short (its point runs again)"]
    assert len(_check_rows_unique(path)) == 4
