"""Progress on standard error while a long command runs (rich): drawn on a terminal; in a
log (standard error not a terminal) a search writes one line now and then instead
(``LogLines``: every ``LOG_EVERY_S`` seconds, nothing for a search that ends sooner).
Ctrl-C or SIGTERM ends such a command in one line (``stops_on_signals``)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from mpsim import api
from mpsim.errors import MpsimError

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
    log = LogLines(what, console.is_terminal)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        try:
            yield PointsBar(bar, total, log)
        finally:  # a search thread still winding down after an interruption writes no line after its last
            log.active = False


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

        try:
            yield step
        finally:
            log.active = False


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as KeyboardInterrupt is for SIGINT
    (``stops_on_signals``)."""


@contextmanager
def stops_on_signals(command: str, what: str) -> Iterator[None]:
    """Ctrl-C or SIGTERM inside ends ``command`` with one line on standard error, ``mpsim:
    COMMAND interrupted by SIGNAL: WHAT``, and exit 128 + the signal (130, 143), once the
    block's own cleanup has run (worker processes stopped, the progress bar gone). Only the
    first signal raises (SIGTERM as ``Terminated``, SIGINT as KeyboardInterrupt); later ones
    are ignored, so they cannot cut that cleanup short. A signal left ignored by whoever
    started mpsim stays ignored. An ``MpsimError`` that carries the ``signum`` that stopped
    it (``validate``'s run, which ends torchrun itself) ends the command with its own line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if raised:
            return
        raised.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()

    previous = _handle_signals(on_signal)
    try:
        yield
    except BaseException as exc:
        raised.append(0)  # from here on every signal is ignored until the line is out
        signum, line = _stopped_by(exc)
        if not signum:
            _handle_signals(previous)
            raise
    else:
        _handle_signals(previous)
        return
    click.echo(f"mpsim: {line or f'{command} interrupted by {signal.Signals(signum).name}: {what}'}", err=True)
    _handle_signals(previous)
    sys.exit(128 + signum)


_Handler = Callable[[int, FrameType | None], Any] | int | None


def _handle_signals(handler: _Handler | dict[int, _Handler]) -> dict[int, _Handler]:
    """Set SIGINT's and SIGTERM's handler (one for both, or one each), leaving a signal that
    is ignored as it is; the handlers they had."""
    previous: dict[int, _Handler] = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, was in previous.items():
        now = handler.get(sig, was) if isinstance(handler, dict) else handler
        if was != signal.SIG_IGN and now is not None:
            signal.signal(sig, now)
    return previous


def _stopped_by(exc: BaseException) -> tuple[int, str]:
    """The signal that raised ``exc`` (0 for none) and the line an error gives for it."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT, ""
    if isinstance(exc, Terminated):
        return signal.SIGTERM, ""
    signum = getattr(exc, "signum", None)
    if isinstance(exc, MpsimError) and isinstance(signum, int):
        return signum, str(exc)
    return 0, ""
