"""The page's runs in a worker process, so that a cancelled run gives all of its memory
back and stops in whatever phase it is in (tracing, planning or simulating).

One worker process computes one run at a time and stays up between runs, keeping the
planners' caches warm. Cancelling a run ends the worker (the next run starts a fresh
one, about 0.4 s of imports), so nothing the run allocated stays with the server: the
server's own memory is only the uploads, the finished runs' results and the page.

The worker reports simulated tasks (``mpsim.api.reporting``, as the CLI's bar) at most
every ``PROGRESS_EVERY_S``; the server checks for a cancel every ``CANCEL_POLL_S``.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from mpsim import api
from mpsim.errors import MpsimError

PROGRESS_EVERY_S = 0.1
"""The longest the worker keeps a task count to itself."""
CANCEL_POLL_S = 0.05
"""How often the server looks at a running job's cancel flag."""
REAP_S = 2.0
"""How long a worker whose pipe closed is waited for, to read its exit code."""
_SPAWN = multiprocessing.get_context("spawn")  # never fork a threaded server


class Cancelled(Exception):
    """The run was asked to stop; its worker has been ended."""


class WorkerDied(Exception):
    """The worker ended without an answer (killed for memory, for instance)."""


class _Progress:
    """Counts simulated tasks in the worker and sends the count now and then."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self.tasks, self._sent_at = conn, 0, time.monotonic()

    def on_task(self) -> None:
        self.tasks += 1
        now = time.monotonic()
        if now - self._sent_at >= PROGRESS_EVERY_S:
            self._conn.send(("tasks", self.tasks))
            self._sent_at = now


def _answer(work: Callable[[Any], Any], request: Any, conn: Connection) -> tuple[str, Any]:
    progress = _Progress(conn)
    try:
        with api.reporting(progress.on_task):
            outcome = work(request)
    except MpsimError as exc:
        return "failed", str(exc)
    except Exception as exc:  # the server shows it in one line; the worker's stderr keeps the trace
        traceback.print_exc()
        return "failed", f"internal error: {type(exc).__name__}: {exc}"
    conn.send(("tasks", progress.tasks))
    return "done", outcome


def _serve(conn: Connection) -> None:
    """The worker's loop: a (work, request) pair in, progress and one answer out, until
    the server closes its end."""
    while True:
        try:
            work, request = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        conn.send(_answer(work, request, conn))


class RunWorker:
    """The server's handle on its worker process; ``run`` is called by one thread at a time."""

    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The worker's process id while it is up (tests and benchmarks)."""
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def _started(self) -> tuple[Connection, Any]:
        with self._lock:
            if self._process is None or not self._process.is_alive():
                ours, theirs = _SPAWN.Pipe()
                self._process = _SPAWN.Process(target=_serve, args=(theirs,), name="mpsim-serve-worker", daemon=True)
                self._process.start()
                theirs.close()
                self._conn = ours
            assert self._conn is not None
            return self._conn, self._process

    def run(self, work: Callable[[Any], Any], request: Any, on_tasks: Callable[[int], None],
            cancel: threading.Event) -> Any:
        """``work(request)`` in the worker (both picklable; ``work`` a module-level function);
        raises ``Cancelled`` soon after ``cancel`` is set, ``MpsimError`` with the run's
        one-line message, or ``WorkerDied``."""
        conn, process = self._started()
        conn.send((work, request))
        while True:
            if cancel.is_set():
                self.stop()
                raise Cancelled
            if not wait([conn, process.sentinel], timeout=CANCEL_POLL_S):
                continue
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                process.join(timeout=REAP_S)  # its pipe may close before it is reaped: the exit code then
                code = process.exitcode
                self.stop()
                raise WorkerDied(f"the run's worker process ended without an answer (exit code {code}); "
                                 "it may have run out of memory") from None
            if kind == "tasks":
                on_tasks(value)
            elif kind == "done":
                return value
            else:
                raise MpsimError(value)

    def stop(self) -> None:
        """End the worker now (a cancel, or the server closing); its memory goes with it."""
        with self._lock:
            process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.join(timeout=5)
            process.close()
