"""Device memory: one owner per device through which every byte is allocated and freed,
and the log it writes, analysed after the run.

``DeviceMemory`` is the only way memory changes (DESIGN "Memory has one owner"): each
change updates the live count, writes the log and wakes whoever waits for room, in one
step. An allocation that may wait (``acquire``, ``acquire_task``) waits while it does
not fit and a free is under way on that device (a swap-out, a send or a releasing piece
in flight), and is granted in the same instant the check passes, so nothing can take the
room between the check and the grant. When no free is under way it goes ahead even if
it does not fit, so a job that does not fit still runs to the end and shows its demand;
the log then names the first point over capacity as the out-of-memory.

The log (``MemoryLog``) is exact. A piece of a stage's forward or backward registers all
its per-layer allocations at once from a precomputed template (offsets within the piece,
byte deltas, categories) instead of one simulation event per layer; while it runs, the
owner holds the piece's highest point as a reservation, so the live count never falls
below the log's (a wait may start slightly early, never late). After the run, the events
of each device are ordered by (time, order of registration), summed, and give the peak,
the breakdown by category at the peak, the memory-over-time series and the first point
over capacity. The host's pinned memory has an owner and a log too.

Ledger categories (``saved:<technique>``) do not count as memory in use: they record
what a technique keeps off the GPU at each moment (bytes the plain plan would hold there
and this plan does not), so their sum at a GPU's peak is what each technique saved there
(MPress Table IV).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from mpsim.sim.simpy_fast import call_in, call_inner, fire_in_place, go_on_now

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "stash", "buffers", "workspace",
                               "peer_swap")
"""What memory in use is made of; ``peer_swap`` is space a GPU holds for other GPUs' D2D swaps."""
MODEL_STATES: tuple[str, ...] = CATEGORIES[:3]
"""The categories that do not depend on the batch: parameters, gradients, optimizer states."""
TECHNIQUES: tuple[str, ...] = ("recompute", "selective", "host", "peer", "split", "optimizer", "stash")
"""Ledger categories, logged as ``saved:<technique>``."""
CAT = {name: i for i, name in enumerate(CATEGORIES)}
CAT.update({f"saved:{name}": len(CATEGORIES) + i for i, name in enumerate(TECHNIQUES)})
N_REAL = len(CATEGORIES)


@dataclass(frozen=True)
class Template:
    """The memory events of one kind of task on one stage, relative to the task's start."""

    offsets_s: np.ndarray
    deltas: np.ndarray
    cats: np.ndarray
    labels: tuple[str, ...]
    """What each event is (layer and tensor), for naming the out-of-memory point."""
    peak_bytes: int = 0
    """Highest point of the real deltas in time order, relative to the start (>= 0)."""
    net_bytes: int = 0
    """Sum of the real deltas."""


def make_template(events: list[tuple[float, int, str, str]]) -> Template:
    """A template from (offset s, delta bytes, category, label) events, in the order given
    (the log keeps that order among events at the same offset)."""
    offsets = np.array([e[0] for e in events], dtype=float)
    deltas = np.array([e[1] for e in events], dtype=np.int64)
    cats = np.array([CAT[e[2]] for e in events], dtype=np.int64)
    real = np.where(cats < N_REAL, deltas, 0)[np.argsort(offsets, kind="stable")]
    running = np.cumsum(real)
    peak = max(0, int(running.max())) if len(running) else 0
    return Template(offsets, deltas, cats, tuple(e[3] for e in events), peak, int(real.sum()))


@dataclass
class GpuMemory:
    """Analysis of one GPU's log."""

    peak_bytes: int
    breakdown: dict[str, int]
    saved: dict[str, int]
    """Ledger at the peak: bytes each technique kept off this GPU at that moment."""
    times_s: np.ndarray
    used_bytes: np.ndarray
    oom: dict | None


@dataclass
class MemoryLog:
    n_gpus: int
    _single: list[list[Any]] = field(default_factory=list)
    """Per device, its single events laid flat: time, order, bytes, category, label, ...
    (five items each: no tuple per event, so the cyclic garbage collector has nothing of
    the log's to scan after a run)."""
    _templated: list[list[Any]] = field(default_factory=list)
    """Per device, its tasks laid flat: start, order, template, label, ... (four items each)."""
    _order: int = 0

    def __post_init__(self) -> None:
        self._single = [[] for _ in range(self.n_gpus)]
        self._templated = [[] for _ in range(self.n_gpus)]

    def events(self, gpu: int, time_s: float, entries: Sequence[Entry]) -> int:
        """Log ``entries`` (bytes, category, label) of ``gpu`` at ``time_s``, in order, and
        return the bytes they add to what tensors use (the ``saved:`` ledger adds none)."""
        singles, n_bytes, order = self._single[gpu], 0, self._order
        put = singles.extend
        for delta, category, label in entries:
            order += 1
            c = CAT[category]
            put((time_s, order, delta, c, label))
            if c < N_REAL:
                n_bytes += delta
        self._order = order
        return n_bytes

    def task(self, gpu: int, start_s: float, template: Template, task_label: str) -> None:
        self._order += 1
        self._templated[gpu].extend((start_s, self._order, template, task_label))

    def analyse(self, gpu: int, capacity: int) -> GpuMemory:
        t, o, d, c = self._events(gpu)
        idx = np.lexsort((o, t))
        t, d, c = t[idx], d[idx], c[idx]
        used = np.cumsum(np.where(c < N_REAL, d, 0))
        if len(used) == 0:
            return GpuMemory(0, {k: 0 for k in CATEGORIES}, {k: 0 for k in TECHNIQUES}, t, used, None)
        peak_pos = int(np.argmax(used))
        peak = int(used[peak_pos])
        at_peak = np.zeros(len(CAT), dtype=np.int64)
        np.add.at(at_peak, c[: peak_pos + 1], d[: peak_pos + 1])
        breakdown = {name: int(at_peak[i]) for i, name in enumerate(CATEGORIES)}
        # the ledger moves at instants: take every ledger event of the peak's instant
        upto = int(np.searchsorted(t, t[peak_pos], side="right"))
        ledger = np.zeros(len(CAT), dtype=np.int64)
        np.add.at(ledger, c[:upto], np.where(c[:upto] >= N_REAL, d[:upto], 0))
        saved = {name: int(ledger[N_REAL + i]) for i, name in enumerate(TECHNIQUES)}
        oom = None
        over = np.nonzero((used > capacity) & (d > 0) & (c < N_REAL))[0]
        if len(over):
            pos = int(over[0])
            oom = {
                "gpu": gpu,
                "time_s": float(t[pos]),
                "task": self._label_at(gpu, int(idx[pos])),
                "need_bytes": int(d[pos]),
                "free_bytes": int(capacity - (used[pos] - d[pos])),
            }
        return GpuMemory(peak, breakdown, saved, t, used, oom)

    def _events(self, gpu: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every event of ``gpu``, unsorted: the single ones, then each task's template
        laid at its start, as (times, orders, deltas, categories). A template's events
        take its task's order plus i / (k + 1) for the i-th of k, which keeps them in
        template order among equal times. Whole-array arithmetic: each task's start and
        order are repeated over its events and added once (element by element the same
        sums as adding them task by task)."""
        singles = self._single[gpu]
        tasks = self._templated[gpu]
        tpls: list[Template] = tasks[2::4]
        sizes = np.array([len(tpl.deltas) for tpl in tpls], dtype=np.int64)
        starts = np.repeat(np.array(tasks[0::4], dtype=float), sizes)
        orders = np.repeat(np.array(tasks[1::4], dtype=np.int64), sizes)
        t = np.concatenate([np.array(singles[0::5], dtype=float),
                            starts + np.concatenate([tpl.offsets_s for tpl in tpls] or [np.zeros(0)])])
        o = np.concatenate([np.array(singles[1::5], dtype=float),
                            orders + np.concatenate([_fractions(len(tpl.deltas)) for tpl in tpls] or [np.zeros(0)])])
        d = np.concatenate([np.array(singles[2::5], dtype=np.int64)] + [tpl.deltas for tpl in tpls])
        c = np.concatenate([np.array(singles[3::5], dtype=np.int64)] + [tpl.cats for tpl in tpls])
        return t, o, d, c

    def _label_at(self, gpu: int, flat_index: int) -> str:
        """The label of the event at position ``flat_index`` of the unsorted concatenation."""
        singles = self._single[gpu]
        if flat_index < len(singles) // 5:
            return str(singles[5 * flat_index + 4])
        flat_index -= len(singles) // 5
        tasks = self._templated[gpu]
        for tpl, task_label in zip(tasks[2::4], tasks[3::4], strict=True):
            if flat_index < len(tpl.deltas):
                return f"{task_label} {tpl.labels[flat_index]}"
            flat_index -= len(tpl.deltas)
        return "?"


_Waiter = tuple[int, Hashable | None, simpy.Event]
"""A wait for room (``DeviceMemory._until``): the bytes asked, the point it is held
until (or None), the gate."""

@functools.lru_cache(maxsize=256)
def _fractions(k: int) -> np.ndarray:
    """i / (k + 1) for i < k: a template's event orders after its task's (``MemoryLog``)."""
    return np.arange(k) / (k + 1)


Entry = tuple[int, str, str]
"""One change of a device's memory: (bytes, category, label); negative bytes free."""


def real_bytes(entries: Sequence[Entry]) -> int:
    """Bytes in use that ``entries`` add (ledger entries add none)."""
    return sum(delta for delta, cat, _label in entries if CAT[cat] < N_REAL)


class DeviceMemory:
    """The one owner of a device's memory: live bytes in use, frees under way, waiters.

    ``reached`` is the run's set of points the compute streams have reached
    (``Signals.reached``): an allocation held until a point (``acquire``'s ``held_until``)
    waits for room beside the running task's climb while its point is not in it."""

    def __init__(self, env: simpy.Environment, device: int, capacity_bytes: int, log: MemoryLog,
                 reached: AbstractSet[Hashable] = frozenset()) -> None:
        self.env = env
        self.device = device
        self.capacity = capacity_bytes
        self.log = log
        self.reached = reached
        self.used = 0
        """Bytes in use now, the highest point of running pieces included."""
        self.frees_under_way = 0
        self.climb_bytes = 0
        """How far above its current level the task running on this device will still
        climb (``program.climbs``); a prefetch held for later leaves that much room."""
        self._waiting: list[_Waiter] = []
        """Who waits for a change, in order (``_until``)."""
        self._deferring = False
        """Whether a stream's step defers its poke's recheck to its end (``defer_pokes``)."""
        self._deferred: list[_Waiter] | None = None
        """The waiters a deferred recheck will look at (``settle``)."""

    def change(self, entries: Sequence[Entry]) -> None:
        """Allocate and free now, without waiting (an allocation may exceed capacity: the
        log reports it as the out-of-memory)."""
        n_bytes = self.log.events(self.device, self.env.now, entries)
        self.used += n_bytes
        if n_bytes < 0 and self._waiting:
            self._poke_waiting()

    def acquire(self, entries: Sequence[Entry],
                held_until: Hashable | None = None) -> Generator[simpy.Event, object, float]:
        """Wait while ``entries`` do not fit and a free is under way, or, while the point
        ``held_until`` has not been reached, until they fit beside what the running task
        will still climb; then make the change in the same instant. Returns seconds waited."""
        n_bytes, start = real_bytes(entries), self.env.now
        if self._must_wait(n_bytes, held_until):
            yield self._until(n_bytes, held_until)
        self.change(entries)
        return self.env.now - start

    def acquire_then(self, entries: Sequence[Entry], held_until: Hashable | None, then: Callable[[], None]) -> None:
        """``acquire`` for a caller that runs as callbacks: the change is made and
        ``then()`` called when ``acquire`` would go on (at once, or when the wait ends)."""
        n_bytes = real_bytes(entries)
        if self._must_wait(n_bytes, held_until):
            def granted(_event: simpy.Event) -> None:
                self.change(entries)
                then()

            self._until(n_bytes, held_until).callbacks.append(granted)
            return
        self.change(entries)
        then()

    def _until(self, n_bytes: int, held_until: Hashable | None) -> simpy.Event:
        """An event that fires once ``_must_wait(n_bytes, held_until)`` turns false, checked
        at every change (``poke``) in the waiter's turn, as a process re-checking in a loop would be. A
        waiter that must go on waiting costs one call, not a process resume; the event
        never enters SimPy's queue: it fires in place (``simpy_fast.fire_in_place``), so the waiter
        goes on in the same instant and turn as it did when it woke itself."""
        gate = self.env.event()
        self._waiting.append((n_bytes, held_until, gate))
        if self._deferring:  # a stream's step ends waiting for room: its waiter is in line first
            self.settle()
        return gate

    def _must_wait(self, n_bytes: int, held_until: Hashable | None) -> bool:
        if held_until is not None and held_until not in self.reached:
            return self.used + n_bytes + self.climb_bytes > self.capacity
        return self.used + n_bytes > self.capacity and self.frees_under_way > 0

    def set_climb(self, n_bytes: int) -> None:
        """The running task's climb ahead changed; a smaller one may let a prefetch go."""
        if n_bytes < self.climb_bytes:
            self.climb_bytes = n_bytes
            if self._waiting:
                self._poke_waiting()
        else:
            self.climb_bytes = n_bytes

    def begin_free(self) -> None:
        """A free is under way (a copy that releases memory when it lands)."""
        self.frees_under_way += 1

    def end_free(self, entries: Sequence[Entry]) -> None:
        """The free announced by ``begin_free`` happens now."""
        self.frees_under_way -= 1
        self.change(entries)
        if self._waiting:
            self._poke_waiting()

    def end_free_last(self, entries: Sequence[Entry], *signals: simpy.Event) -> None:
        """``end_free`` as its callback's last act, then only ``signals`` fired in turn
        (a landed swap-out's, a send's). Where the recheck's event would be the next
        processed (``simpy_fast.go_on_now``), the waiters are rechecked now and the
        signals fired in place right after them, as the events, scheduled one after the
        other, would be processed; all but the last run as inner calls
        (``simpy_fast.call_inner``), so that nothing they let go
        takes the place an event after them held. Otherwise as ``end_free``, then the
        signals succeeded in turn (the first in place where it would be next)."""
        self.frees_under_way -= 1
        self.used += self.log.events(self.device, self.env.now, entries)
        waiting = self._waiting
        if go_on_now(self.env):
            if waiting:
                self._waiting = []
                if not signals:
                    self._recheck(waiting)
                    return
                call_inner(self._recheck, waiting)
            for signal in signals[:-1]:
                call_inner(fire_in_place, signal)
            if signals:
                fire_in_place(signals[-1])
            return
        if waiting:
            self._poke_waiting()
        for signal in signals:
            signal.succeed()

    def start_task(self, template: Template, label: str) -> None:
        """Log a piece's events and hold its highest point until ``finish_task``."""
        self.log.task(self.device, self.env.now, template, label)
        self.used += template.peak_bytes  # never negative: no poke
        if template.net_bytes < 0:
            self.frees_under_way += 1

    def start_piece(self, template: Template, label: str, climb_bytes: int) -> None:
        """``start_task``, then ``set_climb(climb_bytes)``: a piece of a compute task starts."""
        self.log.task(self.device, self.env.now, template, label)
        self.used += template.peak_bytes
        if template.net_bytes < 0:
            self.frees_under_way += 1
        if climb_bytes < self.climb_bytes:
            self.climb_bytes = climb_bytes
            if self._waiting:
                self._poke_waiting()
        else:
            self.climb_bytes = climb_bytes

    def acquire_task(self, template: Template, label: str) -> Generator[simpy.Event, object, float]:
        """``start_task`` once the piece's highest point fits or no free is under way."""
        start = self.env.now
        if self.task_must_wait(template):
            yield self._until(template.peak_bytes, None)
        self.start_task(template, label)
        return self.env.now - start

    def task_must_wait(self, template: Template) -> bool:
        """Whether a piece must wait for room before it starts (``acquire_task``)."""
        return self.used + template.peak_bytes > self.capacity and self.frees_under_way > 0

    def finish_task(self, template: Template) -> None:
        """The piece has ended: what it holds drops from its highest point to its net."""
        self.end_piece(template, self.climb_bytes)

    def end_piece(self, template: Template, climb_bytes: int) -> None:
        """``finish_task``, then ``set_climb(climb_bytes)``: a piece of a compute task ends."""
        net = template.net_bytes
        n_bytes = net - template.peak_bytes
        self.used += n_bytes
        if n_bytes < 0 and self._waiting:
            self._poke_waiting()
        if net < 0:
            self.frees_under_way -= 1
            if self._waiting:
                self._poke_waiting()
        if climb_bytes < self.climb_bytes:
            self.climb_bytes = climb_bytes
            if self._waiting:
                self._poke_waiting()
        else:
            self.climb_bytes = climb_bytes

    def poke(self) -> None:
        """Wake whoever waits on this device (memory freed, or a stream reached a point):
        one event, scheduled now, re-checks them in the order they began to wait; one
        that must go on waiting waits for the next poke after it (``_recheck``)."""
        if self._waiting:  # nobody waiting: nothing to schedule
            self._poke_waiting()

    def _poke_waiting(self) -> None:
        """``poke`` with someone waiting."""
        batch, self._waiting = self._waiting, []
        if self._deferring:
            if self._deferred is None:  # the recheck is scheduled, or done, by ``settle``
                self._deferred = batch
                return
            self._schedule_recheck(self._deferred)  # a second batch in one step: keep their order
            self._deferred = None
        self._schedule_recheck(batch)

    def _schedule_recheck(self, batch: list[_Waiter]) -> None:
        call_in(self.env, 0.0, lambda _e: self._recheck(batch))

    def defer_pokes(self, on: bool = True) -> None:
        """A compute stream's step begins: the recheck a poke schedules waits for the
        step's end (``settle``); with ``on`` false, nothing changes."""
        self._deferring = on

    def settle(self, last_act: bool = True) -> None:
        """The step that ``defer_pokes`` began ends: the recheck of its first poke runs
        now when its event would be the next processed (``last_act``: the stream only
        waits from here on, and ``simpy_fast.go_on_now``: nothing queued for this
        instant), else its event is scheduled now. A wait for room settles the step
        itself once the waiter is in line (``_until``).

        Timing: the waiters are let go against the state the step leaves, as when the
        event was scheduled at the poke and processed after the step. The event now
        takes its place at the step's end, behind what the step scheduled since the
        poke: in a stream's step of prefetched swaps without data or tensor parallelism
        that is a copy's start after its route's latency, or a process's urgent start,
        neither for the same instant on a route with a latency (on-demand swaps, whose
        reach events would be, are not deferred: ``ComputeStream._run_pieces``)."""
        self._deferring = False
        batch = self._deferred
        if batch is not None:
            self._deferred = None
            if last_act and go_on_now(self.env):
                self._recheck(batch)
            else:
                self._schedule_recheck(batch)

    def _recheck(self, batch: list[_Waiter]) -> None:
        """Let go, in order, each of ``batch`` that need not wait any more (its waiter
        goes on at once, inside this call, and may change memory and poke again); put
        the others back in line, behind whoever began to wait meanwhile. The test is
        ``_must_wait``'s, written out: this loop runs for every waiter at every poke.
        A waiter let go before the batch's last is fired as an inner call
        (``simpy_fast.call_inner``): this loop still has work after it, so it
        must not skip an event of its own (``go_on_now``). What the test reads of this
        owner (bytes in use, the climb, frees under way, the line) changes only while a
        waiter goes on, so it is read again after each."""
        last_gate = batch[-1][2]  # by its gate: a compiled engine boxes a waiter's tuple anew at each use
        reached, capacity = self.reached, self.capacity
        room = capacity - self.used
        held_room, freeing, put_back = room - self.climb_bytes, self.frees_under_way > 0, self._waiting.append
        for waiter in batch:
            n_bytes, held_until, gate = waiter
            if held_until is not None and held_until not in reached:
                wait = n_bytes > held_room
            else:
                wait = n_bytes > room and freeing
            if wait:
                put_back(waiter)
            elif gate is last_gate:  # this call's last act
                fire_in_place(gate)
            else:
                call_inner(fire_in_place, gate)
                room = capacity - self.used
                held_room, freeing, put_back = room - self.climb_bytes, self.frees_under_way > 0, self._waiting.append
