"""SIGINT and SIGTERM turned into an exception while a long child process runs (the
engine build's compiler, ``validate``'s torchrun), so the caller ends the child and cleans
up before it exits. One handler for both: ``Signals``."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)
"""The signals ``Signals.installed`` turns into ``Stopped``."""


class Stopped(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM inside ``Signals.installed``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM while a child runs: the first raises ``Stopped``, later ones are
    ignored (they cannot cut the cleanup short). Inside ``held()`` (a child being started,
    before there is a handle to end it by; a scratch folder being removed) a signal is kept
    and raised as the block ends. ``held()`` works whether or not the handler is installed."""

    def __init__(self) -> None:
        self.stopped = False
        self.holding = False
        self.pending: int | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopped:
            return
        if self.holding:
            self.pending = signum
            return
        self.stopped = True
        raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        outer, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = outer
            if not outer and self.pending is not None and not self.stopped:
                self.stopped = True
                raise Stopped(self.pending)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Inside, SIGINT and SIGTERM raise ``Stopped`` in the main thread (``handle``), from a
        fresh state; the previous handlers come back after. Off the main thread (where
        handlers cannot be set) nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.stopped, self.holding, self.pending = False, False, None
        previous = {sig: signal.signal(sig, self.handle) for sig in HANDLED}
        try:
            yield
        finally:
            self.stopped = True  # a signal from here on comes too late to stop anything
            for sig, handler in previous.items():
                signal.signal(sig, handler)
