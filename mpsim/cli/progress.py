"""Progress on standard error while a long command runs (rich): drawn on a terminal; in a
log (standard error not a terminal) a search writes one line now and then instead
(``LogLines``: every ``LOG_EVERY_S`` seconds, nothing for a search that ends sooner)."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from mpsim import api

if TYPE_CHECKING:
    from rich.progress import Progress


LOG_EVERY_S = 30.0
"""Seconds between two progress lines in a log (``MPSIM_PROGRESS_EVERY_S`` overrides it;
0: a line at every step)."""


def _log_every_s() -> float:
    try:
        every = float(os.environ.get("MPSIM_PROGRESS_EVERY_S", LOG_EVERY_S))
    except ValueError:
        return LOG_EVERY_S
    return every if math.isfinite(every) and every >= 0 else LOG_EVERY_S


class LogLines:
    """A search's sign of life where no bar is drawn: ``mpsim: WHAT: STATE (N s)`` on
    standard error at most every ``LOG_EVERY_S`` seconds; nothing on a terminal (the bar
    is there), nothing before the first interval has passed."""

    def __init__(self, what: str, on_terminal: bool):
        self.what, self.active, self.every = what, not on_terminal, _log_every_s()
        self.start = self.last = time.monotonic()

    def tick(self, state: Callable[[], str]) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        sys.stderr.write(f"mpsim: {self.what}: {state()} ({now - self.start:.0f} s)\n")
        sys.stderr.flush()


def progress(what: str) -> Progress:
    """A bar without a total: ``what``, the bar, a count, a description, the time elapsed."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


class PointsBar:
    """Points done, failed and left, with the time left, for a run of many points on any
    backend. Points found already done (a resumed sweep) are counted apart, so they do not
    make the estimate of the time left look fast."""

    def __init__(self, bar: Any, total: int, log: LogLines | None = None):
        self.bar, self.total, self.log = bar, total, log
        self.done = self.failed = self.resumed = 0
        self.job = bar.add_task("", total=total, done=0, failed=0, left=total, resumed="")

    def _show(self, description: str) -> None:
        finished = self.done + self.failed
        if self.log is not None:
            self.log.tick(lambda: f"done {self.done}, failed {self.failed}, left "
                                  f"{max(0, self.total - self.resumed - finished)}"
                                  + (f" ({self.resumed} already done)" if self.resumed else "")
                                  + (f": {description}" if description else ""))
        self.bar.update(self.job, total=self.total - self.resumed, completed=finished, description=description,
                        done=self.done, failed=self.failed, left=self.total - self.resumed - finished,
                        resumed=f" ({self.resumed} already done)" if self.resumed else "")

    def point_done(self, description: str = "", resumed: bool = False) -> None:
        if resumed:
            self.resumed += 1
        else:
            self.done += 1
        self._show(description)

    def point_failed(self, description: str = "") -> None:
        self.failed += 1
        self._show(description)


@contextmanager
def points_progress(what: str, total: int) -> Iterator[PointsBar]:
    """A progress bar over points: done, failed, left, elapsed and estimated time left."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    columns = (TextColumn(what), BarColumn(),
               TextColumn("done {task.fields[done]}, failed {task.fields[failed]}, left {task.fields[left]}"
                          "{task.fields[resumed]}"),
               TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        yield PointsBar(bar, total, LogLines(what, console.is_terminal))


@contextmanager
def tasks_progress(what: str) -> Iterator[None]:
    """Simulated tasks counted while a simulate or plan runs (a planner simulates many
    candidate plans, so there is no total)."""
    with progress(what) as bar:
        job = bar.add_task("tasks simulated", total=None)
        count = [0]

        def on_task() -> None:  # the bar is updated every 256 tasks, so it costs nothing
            count[0] += 1
            if count[0] % 256 == 0:
                bar.advance(job, 256)

        with api.reporting(on_task):
            yield


@contextmanager
def steps_progress(what: str) -> Iterator[Callable[[str], None]]:
    """A bar that shows the step a command is at; yields the function that names it. In a
    log, a line now and then with the steps so far and the last (``LogLines``)."""
    with progress(what) as bar:
        job = bar.add_task("", total=None)
        log = LogLines(what, bar.console.is_terminal)
        steps = [0]

        def step(name: str) -> None:
            bar.update(job, description=name)
            steps[0] += 1
            log.tick(lambda: f"{steps[0]} done, last {name}")

        yield step
