"""SimPy's fast path: the one module that touches SimPy's private attributes.

The engine runs tens of thousands of events per simulated iteration; going through
SimPy's public methods costs a method call and a ``try`` per event. The functions here
do what those methods do, reading and writing SimPy's internals directly:

- ``Environment._queue`` (a heap of ``(time, priority, id, event)``), ``Environment._now``
  and ``Environment._eid`` (the counter that numbers scheduled events);
- ``Event._ok``, ``Event._value`` (set when an event is triggered) and ``Event._defused``
  (present once a failure has been handled).

They were written against simpy 4.1 (``simpy.Environment.step`` and
``simpy.events.Process._resume``), and each keeps SimPy's event order exactly. An
event that would be processed right after the running callback, with nothing queued
for the instant and nothing left for the callback to do, may be skipped and its work
done at once (``go_on_now``: a copy engine granted as it is asked for, a lone landing
of the network, a swap's signal, a compute step's memory recheck, a landed copy's
recheck and signals fired in the order of their events, ``DeviceMemory.end_free_last``):
the order of everything else is the same, only the counter's numbers are fewer.

Four places leave that rule and move events in the order of one instant (each says so
in its doc): a prefetched swap-in schedules its sleep as it is made, not from its urgent
start (``swapper.SwapInSteps``); a host copy is granted its engine without events, as it
asks or by the release, and a host swap-out takes its engine in the stream's step
(``copy_engine.EnginePool.take``); a flow that starts alone keeps the network's pending
wake-up (``network``); a compute stream's step schedules its memory recheck at its end,
or runs it there when it would be next (``memory.DeviceMemory.settle``). The first two
move events scheduled for a later instant ahead of others scheduled in the same instant,
which shows only where two fall on the very same later instant; the last moves a
recheck behind what the step scheduled after its poke, none of it for the same instant
in the runs measured. Measured with ``benchmarks/engine_equivalence.py`` (full, against 44a91a1): of
118 jobs, 3 differ, with the same iteration times and per-GPU peaks. In one (PipeDream,
cpu-swap, gpt-15.4b on dgx1-v100) a weight version's stash-out and swap-in, equal in
size and started in one instant, land in one instant in the other order: the same spans
and times, and the host's series passes through the other intermediate value at 98
instants. In two the network's kept wake-ups move span times by at most 4.2e-16 relative.

On import
``check_simpy`` makes sure the installed simpy still has those internals and, if not,
raises one ``SimpyInternalsError`` naming the version and what is missing, instead of an
``AttributeError`` deep inside a run.
"""

from __future__ import annotations

import gc
import importlib.metadata
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from heapq import heappop, heappush
from typing import Any, ClassVar

import simpy
import simpy.events

from mpsim.errors import MpsimError

__all__ = ["Detached", "Fired", "SimpyInternalsError", "call_in", "call_inner", "call_soon", "check_simpy",
           "events_scheduled", "fire_in_place", "gc_paused", "go_on", "go_on_now",
           "mark_processed", "missing_internals", "run_until_empty", "sleep"]

Steps = Generator[simpy.Event, object, None]
NORMAL = simpy.events.NORMAL
URGENT = simpy.events.URGENT


class SimpyInternalsError(MpsimError):
    """The installed simpy lacks an internal that mpsim's fast path uses."""


def missing_internals(env: object, event: object) -> list[str]:
    """What of SimPy's internals ``env`` and ``event`` lack; ``event`` must be an event of
    ``env`` that has succeeded (so it sits in ``env``'s queue) and been marked defused."""
    missing = [f"Environment.{name}" for name in ("_queue", "_now", "_eid") if not hasattr(env, name)]
    queue = getattr(env, "_queue", None)
    if queue is not None and not (isinstance(queue, list)
                                  and any(isinstance(e, tuple) and len(e) == 4 and e[3] is event for e in queue)):
        missing.append("Environment._queue as a list of (time, priority, id, event)")
    eid = getattr(env, "_eid", None)
    if eid is not None and not hasattr(eid, "__next__"):
        missing.append("Environment._eid as a counter")
    missing += [f"Event.{name}" for name in ("_ok", "_value", "_defused") if not hasattr(event, name)]
    if not hasattr(simpy.events, "URGENT"):
        missing.append("simpy.events.URGENT")
    return missing


def check_simpy(env: object | None = None, event: object | None = None) -> None:
    """Raise ``SimpyInternalsError`` (one line) if the installed simpy, or ``env`` and
    ``event`` when given, lack an internal this module uses."""
    if env is None or event is None:
        env = simpy.Environment()
        event = env.event()
        event.succeed()
        event.defused = True
    missing = missing_internals(env, event)
    if missing:
        raise SimpyInternalsError(
            f"simpy {_simpy_version()} lacks what mpsim's fast path (mpsim.sim.simpy_fast) uses: "
            f"{', '.join(missing)}; install the simpy release mpsim is tested with (4.1)")


def _simpy_version() -> str:
    try:
        return importlib.metadata.version("simpy")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(simpy, "__version__", "(unknown version)"))


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (and resume it, if it was
    on, however the block ends; a block inside another one leaves it to the outer).

    A run allocates tens of thousands of objects that live until its result is made
    (events, the memory log, spans) and frees nearly all of them by reference counting
    when it ends: a collection while they live scans every one and finds nothing, one
    after they are freed scans only what the result keeps. ``engine.simulate_layout``
    runs a whole simulation, result included, inside one pause."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_until_empty(env: simpy.Environment) -> None:
    """``env.run()`` without a deadline, inlined: the same events in the same order (by
    time, priority, then scheduling order), each one's callbacks called in turn, and a
    failed event that nobody defused raised, as ``simpy.Environment.step`` does; without
    a method call and a ``try`` per event.

    Python's cyclic garbage collector is paused while the loop runs (and resumed, if it
    was on, however the loop ends): a run's events are freed by reference counting as
    they are popped and leave next to no cycles (a few objects per run), so the
    collections their allocations would trigger find nothing and cost several per cent
    of the loop (``gc_paused``)."""
    with gc_paused():
        _run_events(env)


def _run_events(env: simpy.Environment) -> None:
    """``run_until_empty``'s loop."""
    queue, pop = env._queue, heappop
    while queue:
        env._now, _, _, event = pop(queue)
        callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc


def fire_in_place(event: simpy.Event) -> None:
    """Succeed ``event`` and run its callbacks now, as SimPy would when processing it,
    without scheduling it (its waiters resume inside the current callback)."""
    event._ok = True
    event._value = None
    callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
    for callback in callbacks or ():
        callback(event)


def mark_processed(event: simpy.Event) -> None:
    """Make ``event`` succeeded (value None) and processed without scheduling it: a
    process that yields it goes on at once. It must have no callbacks yet."""
    event._ok = True
    event._value = None
    event.callbacks = None  # type: ignore[assignment]


class _Inner:
    """How many ``call_inner`` calls are under way (see ``go_on_now``)."""

    depth: ClassVar[int] = 0


def call_inner(callback: Callable[..., None], *args: Any) -> None:
    """Call ``callback(*args)`` for a caller that has more to do once it returns
    (``DeviceMemory._recheck`` firing a waiter's gate in place with ``fire_in_place``
    before it looks at the next; ``DeviceMemory.end_free_last``: a recheck with a signal
    to fire after it): while it runs, ``go_on_now`` says no, as the caller is not at its
    callback's end."""
    _Inner.depth += 1
    try:
        callback(*args)
    finally:
        _Inner.depth -= 1


def go_on_now(env: simpy.Environment) -> bool:
    """Whether the running callback may do at once what it would otherwise do through an
    event scheduled now, as its very last act, without changing the run's order.

    Such an event (time now, priority ``NORMAL``, the next number of the counter) is
    processed right after the running callback returns when nothing else is queued for
    this instant (the queue's head lies later): nothing can run between the two. So it
    may go on now when (1) the queue holds nothing for this instant, (2) it is the
    callback's last act (a process that yields the event right after asking for it
    and was resumed by the loop, or by a callback fired in place as that callback's
    last act: never under ``call_inner``). Events it schedules then come in
    the same order as they would have; only the counter's numbers are fewer."""
    queue = env._queue
    return _Inner.depth == 0 and (not queue or queue[0][0] > env._now)


class Fired(simpy.Event):
    """An event that is scheduled the moment it is made, already succeeded (value None),
    and is nothing but its callbacks: what SimPy's loop (``run_until_empty``,
    ``simpy.Environment.step``) and a process yielding it read of an event
    (``callbacks``, ``_ok``, ``_value``), without ``simpy.Event.__init__``, ``Timeout``'s
    checks and ``Environment.schedule``'s call. It takes the queue place a
    ``simpy.Timeout`` of the same delay made at the same moment would take (same time,
    priority ``NORMAL``, the next number of the counter), so a run's event order is
    unchanged. It has no ``env``: combine it with nothing (``&``, ``|``, ``AllOf``)."""

    _ok = True
    _value = None

    def __init__(self, env: simpy.Environment, delay_s: float) -> None:  # no super().__init__: see the class doc
        if delay_s < 0:
            raise ValueError(f"negative delay {delay_s}")
        self.callbacks: list[Any] = []
        heappush(env._queue, (env._now + delay_s, NORMAL, next(env._eid), self))


_new_fired = Fired.__new__
"""Makes a ``Fired`` without ``__init__`` (``sleep``, ``call_in``, ``call_soon``)."""


def sleep(env: simpy.Environment, delay_s: float) -> simpy.Event:
    """What ``env.timeout(delay_s)`` is to a process that yields it, in the same place
    of the queue, made cheaply (``Fired``, without a call of its ``__init__``: this runs
    for most events of a run); ``delay_s`` must not be negative."""
    if delay_s < 0:
        raise ValueError(f"negative delay {delay_s}")
    event = _new_fired(Fired)
    event.callbacks = []
    heappush(env._queue, (env._now + delay_s, NORMAL, next(env._eid), event))
    return event


def call_in(env: simpy.Environment, delay_s: float, callback: Any) -> Fired:
    """``env.timeout(delay_s).callbacks.append(callback)``, in the same place of the
    queue, made cheaply (as ``sleep``); ``delay_s`` must not be negative. Returns the
    event (its callbacks may be cleared to call nothing)."""
    if delay_s < 0:
        raise ValueError(f"negative delay {delay_s}")
    event = _new_fired(Fired)
    event.callbacks = [callback]
    heappush(env._queue, (env._now + delay_s, NORMAL, next(env._eid), event))
    return event


def call_soon(env: simpy.Environment, callback: Any) -> None:
    """Call ``callback`` through an urgent event scheduled now: the place in the queue
    where ``Detached`` (and ``simpy.Environment.process``) start a process, for work
    that runs as a chain of callbacks instead of a generator (``spawn``)."""
    start = _new_fired(Fired)  # an urgent Fired of no delay
    start.callbacks = [callback]
    heappush(env._queue, (env._now, URGENT, next(env._eid), start))


def events_scheduled(env: simpy.Environment) -> int:
    """Events ``env`` has scheduled so far: SimPy numbers every scheduled event from one
    counter (this reads it by taking its next number, so call it once, at the end)."""
    return next(env._eid)


def go_on(steps: Steps) -> None:
    """Run a generator from here, in the running callback, as ``Detached`` would from its
    first resume on (for callbacks that hand the rest of their work to a process)."""
    Detached.__new__(Detached).go_on(steps)


class Detached:
    """A generator run the way ``simpy.Environment.process`` runs one (started through an
    urgent event scheduled now; resumed on each event it yields, at once when that event
    has already been processed; a failure thrown in and marked defused), but with no
    end-of-process event (``mpsim.sim.spawn``). ``alive`` is true until the generator
    has returned (``simpy.Process.is_alive``, for whoever checks that a run finished)."""

    __slots__ = ("_steps", "alive")

    def __init__(self, env: simpy.Environment, steps: Steps) -> None:
        self._steps = steps
        self.alive = True
        start = Fired.__new__(Fired)  # an urgent Fired of no delay
        start.callbacks = [self._resume]
        heappush(env._queue, (env._now, URGENT, next(env._eid), start))

    def go_on(self, steps: Steps) -> None:
        """Start ``steps`` now, without the urgent start event (``simpy_fast.go_on``)."""
        self._steps = steps
        self.alive = True
        self._resume(_STARTED)

    def _resume(self, event: simpy.Event) -> None:
        """Send the event's value in (throw its failure), and wait on what comes next."""
        steps = self._steps
        while True:
            try:
                if event._ok:
                    event = steps.send(event._value)
                else:
                    event._defused = True
                    event = steps.throw(event._value)
            except StopIteration:
                self.alive = False
                return
            if event.callbacks is not None:  # not processed yet: wait for it
                event.callbacks.append(self._resume)
                return


check_simpy()


_STARTED = Fired.__new__(Fired)
"""A processed event of value None: what starts a generator in ``Detached.go_on``."""
