"""Progress of simulations for whoever shows it (the CLI's bar), without threading a
callback through every planner: a caller sets ``reporting(callback)`` around its work, and
each run reads it once and reports every finished task."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

OnTask = Callable[[], None]
_ON_TASK: ContextVar[OnTask | None] = ContextVar("mpsim_on_task", default=None)


@contextmanager
def reporting(on_task: OnTask) -> Iterator[None]:
    """Call ``on_task()`` after every task of every simulation run inside the block."""
    token = _ON_TASK.set(on_task)
    try:
        yield
    finally:
        _ON_TASK.reset(token)


def current() -> OnTask | None:
    return _ON_TASK.get()
