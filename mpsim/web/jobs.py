"""Runs queued one at a time, each computed in the worker process (``mpsim.web.worker``),
with progress and cancelling.

Progress is the count of simulated tasks the worker reports; cancelling sets a flag the
job's thread checks every ``worker.CANCEL_POLL_S``, ending the worker (and so the run,
in any phase, with all of its memory) and marking the job cancelled.
"""

from __future__ import annotations

import re
import threading
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpsim.errors import MpsimError
from mpsim.web.worker import Cancelled, RunWorker, WorkerDied

MAX_JOBS = 32
"""Finished runs kept for their downloads; the oldest is dropped beyond this."""
MAX_WAITING = 4
"""Runs that may wait for the one in progress before new ones are refused."""


MAX_WORD_CHARS = 100
"""A word of an error message longer than this (a value echoed back: a 20,000-character
server name) is cut to its start and end, so the answer stays one short line."""


def short_message(message: str) -> str:
    """``message`` on one line, each overlong word cut (``MAX_WORD_CHARS``)."""
    one_line = " ".join(message.split())
    return re.sub(rf"\S{{{MAX_WORD_CHARS + 1},}}", lambda m: f"{m[0][:60]}...{m[0][-20:]}", one_line)


class Busy(Exception):
    """Too many runs waiting."""


@dataclass
class PageRun:
    id: str
    inputs: Any
    state: str = "waiting"
    """waiting, running, done, failed or cancelled."""
    tasks: int = 0
    """Simulated tasks so far."""
    error: str | None = None
    outcome: Any = None
    """What the work returned (for a job view, the plan with its result)."""
    cancel: threading.Event = field(default_factory=threading.Event)
    cache: dict[str, Any] = field(default_factory=dict)
    """Rendered charts and downloads, made once on first request."""

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    def status(self) -> dict:
        return {"id": self.id, "state": self.state, "tasks": self.tasks, "error": self.error}

    def set_tasks(self, tasks: int) -> None:
        self.tasks = tasks


class JobRunner:
    """Starts each run in its own thread, which waits for the one worker (``compute_lock``)
    and hands it the run; ``work(job)`` calls ``self.worker.run``."""

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, PageRun] = OrderedDict()
        self._lock = threading.Lock()
        self.compute_lock = threading.Lock()
        self.worker = RunWorker()

    def close(self) -> None:
        """Cancel every run and end the worker."""
        with self._lock:
            for job in self._jobs.values():
                job.cancel.set()
        self.worker.stop()

    def start(self, inputs: Any, work: Callable[[PageRun], Any]) -> PageRun:
        with self._lock:
            waiting = sum(1 for j in self._jobs.values() if not j.finished)
            if waiting > MAX_WAITING:
                raise Busy(f"{waiting} runs are waiting or running; cancel one or wait")
            job = PageRun(uuid.uuid4().hex, inputs)
            self._jobs[job.id] = job
            self._drop_old()
        threading.Thread(target=self._run, args=(job, work), name=f"mpsim-job-{job.id[:8]}", daemon=True).start()
        return job

    def _drop_old(self) -> None:
        finished = [k for k, j in self._jobs.items() if j.finished]
        for key in finished[: max(0, len(self._jobs) - MAX_JOBS)]:
            del self._jobs[key]

    def get(self, job_id: str) -> PageRun | None:
        with self._lock:
            return self._jobs.get(job_id)

    def _run(self, job: PageRun, work: Callable[[PageRun], Any]) -> None:
        with self.compute_lock:
            if job.cancel.is_set():
                job.state = "cancelled"
                return
            job.state = "running"
            try:
                job.outcome = work(job)
                job.state = "done"
            except Cancelled:
                job.state = "cancelled"
            except (MpsimError, WorkerDied) as exc:
                job.error, job.state = short_message(str(exc)), "failed"
            except Exception as exc:  # never let a run take the server down
                traceback.print_exc()
                job.error, job.state = f"internal error: {type(exc).__name__}: {exc}", "failed"
