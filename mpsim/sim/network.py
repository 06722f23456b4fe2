"""Links as fluid resources shared max-min fairly by concurrent transfers.

Timing assumptions: a transfer first waits its route's setup latency, then flows. While
flows are active each gets its max-min fair rate (progressive filling: repeatedly find
the link whose remaining capacity divided by its unfrozen flows is smallest, freeze those
flows at that share). Rates are recomputed whenever a flow starts or ends, so a transfer
alone on a link takes latency + bytes / bandwidth, and two that start together on one
link each get half of it.

One wake-up is pending at a time, for the next flow to land. A flow that starts alone
(every other flow keeps its rate) and lands no earlier than that wake-up leaves it as it
is (``Network._joins_alone``): no new wake-up, no stale one left in the queue. The
instant of a wake-up kept so is the one worked out when it was scheduled, not worked out
again from the bytes left at the start: equal in exact arithmetic, different in the last
bit at times (``engine_equivalence``, full: 2 of 118 jobs moved, span times by at most
4.2e-16 relative, link busy times by 1e-15; iteration times and peaks unchanged).
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import defaultdict
from collections.abc import Callable

import simpy

from mpsim.hardware.topology import Route
from mpsim.sim.simpy_fast import Fired, call_in, fire_in_place, go_on_now

_EPS = 1e-12


class _Path:
    """What the fluid model needs of a route, worked out once per run: its links' names
    and bandwidths and the narrowest of those (a flow's rate when it shares no link)."""

    __slots__ = ("route", "links", "names", "ids", "narrowest", "latency_s", "number")

    def __init__(self, route: Route) -> None:
        self.route = route
        """Held so that the route outlives the ``id`` that keys this path."""
        self.links = route.links
        self.names = tuple(link.name for link in route.links)
        with _NUMBERING:  # runs on several threads share the numbers
            for name in self.names:
                if name not in _LINKS:
                    _LINKS[name] = len(_LINKS)
            self.ids = tuple(_LINKS[name] for name in self.names)
        """The links' numbers (``_LINKS``)."""
        self.narrowest = min(link.bandwidth for link in route.links)
        self.latency_s = route.latency_s
        self.number = id(route)
        """The route's ``id``: what keys the rate memo (``_CONFIGS``)."""


class _Group:
    """Flows that land as one: an event fired when the last of ``left`` has landed."""

    __slots__ = ("event", "left")

    def __init__(self, event: simpy.Event, left: int) -> None:
        self.event = event
        self.left = left

    def succeed(self) -> None:
        self.left -= 1
        if not self.left:
            self.event.succeed()

    def fire(self) -> None:
        """``succeed``, the event fired in place (``simpy_fast.fire_in_place``)."""
        self.left -= 1
        if not self.left:
            fire_in_place(self.event)


Landing = Callable[[simpy.Event | None], None]
"""Called when a flow of ``Network.transfer_then`` lands (with None when in place)."""


class _Flow:
    """An active flow: its path, bytes left (as of the network's last change), rate,
    what its landing fires and its start number."""

    __slots__ = ("path", "remaining", "rate", "done", "seq")

    def __init__(self, path: _Path, n_bytes: float, done: simpy.Event | _Group | Landing, seq: int) -> None:
        self.path = path
        self.remaining = float(n_bytes)
        self.rate = 0.0
        self.done = done
        self.seq = seq


class Network:
    """Owns every active flow; ``transfer`` returns an event that fires when bytes land.

    The rates depend on nothing but the routes of the active flows in their order, so
    each such configuration's rates (and the links it keeps busy) are worked out once and
    remembered (``_CONFIGS``): a run repeats a few configurations many times, and the
    runs of a search on one server share most of them."""

    def __init__(self, env: simpy.Environment, record_rates: bool = False) -> None:
        self.env = env
        self.record_rates = record_rates
        self.rate_log: list[tuple[float, dict[str, float]]] = []
        """(time, bytes/s per busy link) at every change, when ``record_rates``."""
        self._flows: list[_Flow] = []
        self._numbers: list[int] = []
        """The active flows' route ids, in the flows' order (the configuration)."""
        self._last = 0.0
        self._wakeup: Fired | None = None
        """The pending wake-up, emptied (never unscheduled) when a later change supersedes it."""
        self._wake_at_s = 0.0
        """When the pending wake-up fires."""
        self._rates: tuple[float, ...] = ()
        """The active flows' rates, in their order (their configuration's)."""
        self._seq = 0
        self._bytes: list[float] = [0.0] * len(_LINKS)
        """Bytes sent over each link (by its number in ``_LINKS``)."""
        self._busy_s: list[float] = [0.0] * len(_LINKS)
        """Seconds each link (by its number in ``_LINKS``) has been busy."""
        self._paths: dict[int, _Path] = {}
        self._busy: tuple[int, ...] = ()
        """The links the active flows keep busy, by number (``_advance`` charges them)."""

    @property
    def bytes_by_link(self) -> dict[str, float]:
        """Bytes sent over each link a transfer has used, in the order first used."""
        return {name: self._bytes[i] for name, i in self._used_links()}

    @property
    def busy_s_by_link(self) -> dict[str, float]:
        """Seconds each link has been busy, for the links busy at some time."""
        return {name: self._busy_s[i] for name, i in self._used_links() if self._busy_s[i] > 0}

    def _used_links(self) -> list[tuple[str, int]]:
        """(name, number) of each link a transfer has used, in the order first used."""
        return [pair for path in self._paths.values() for pair in zip(path.names, path.ids, strict=True)]

    def _path(self, route: Route) -> _Path:
        path = self._paths.get(id(route))
        if path is None:
            path = self._paths[id(route)] = _Path(route)
            if len(self._busy_s) < len(_LINKS):  # links numbered since this network began
                self._busy_s.extend([0.0] * (len(_LINKS) - len(self._busy_s)))
                self._bytes.extend([0.0] * (len(_LINKS) - len(self._bytes)))
        return path

    def _counted_path(self, route: Route, n_bytes: int) -> _Path:
        """``route``'s path, with ``n_bytes`` counted on each of its links."""
        path = self._paths.get(id(route))
        if path is None:
            path = self._path(route)
        moved = self._bytes
        for i in path.ids:
            moved[i] += n_bytes
        return path

    def transfer(self, route: Route, n_bytes: int) -> simpy.Event:
        env = self.env
        done = simpy.Event(env)
        path = self._counted_path(route, n_bytes)
        if n_bytes <= 0:

            def land(_e: simpy.Event) -> None:
                done.succeed()

            call_in(env, path.latency_s, land)
            return done
        call_in(env, path.latency_s, lambda _e: self._start(path, n_bytes, done))
        return done

    def transfer_then(self, route: Route, n_bytes: int, then: Landing) -> None:
        """``transfer`` for a caller that runs as callbacks: ``then`` is called where the
        transfer's event would be processed (through an event of no delay scheduled in
        that event's place, or in place where ``transfer``'s event would fire in place),
        with no event made for it."""
        env = self.env
        path = self._counted_path(route, n_bytes)
        if n_bytes <= 0:
            call_in(env, path.latency_s, lambda _e: call_in(env, 0.0, then))  # as transfer's land + succeed
            return
        call_in(env, path.latency_s, lambda _e: self._start(path, n_bytes, then))

    def transfer_all(self, routes: list[Route], n_bytes: list[int], latency_s: float) -> simpy.Event:
        """Flows that start together after ``latency_s`` (one rate update for all of
        them, not one each) and an event that fires when the last has landed: a ring
        collective's concurrent sends (``mpsim.sim.collectives``)."""
        done = self.env.event()
        paths = []
        for route, n in zip(routes, n_bytes, strict=True):
            path = self._path(route)
            paths.append(path)
            for i in path.ids:
                self._bytes[i] += n
        sends = [(path, n) for path, n in zip(paths, n_bytes) if n > 0]
        if not sends:

            def land(_e: simpy.Event) -> None:
                done.succeed()

            call_in(self.env, latency_s, land)
            return done
        group = _Group(done, len(sends))

        def start(_e: simpy.Event) -> None:
            self._advance()
            for path, n in sends:
                self._add_flow(path, n, group)
            self._reschedule()

        call_in(self.env, latency_s, start)
        return done

    # -- fluid model -----------------------------------------------------------------------
    def _advance(self) -> None:
        """Take the bytes moved since the last change off every flow and charge the busy
        links (``_start`` and ``_wake`` do the same inline)."""
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
            busy_s = self._busy_s
            for i in self._busy:
                busy_s[i] += dt
        self._last = now

    def _add_flow(self, path: _Path, n_bytes: int, done: simpy.Event | _Group | Landing) -> None:
        self._seq += 1
        self._flows.append(_Flow(path, n_bytes, done, self._seq))
        self._numbers.append(path.number)

    def _start(self, path: _Path, n_bytes: int, done: simpy.Event | Landing) -> None:
        """A flow starts after its latency: ``_advance``, ``_add_flow`` and ``_reschedule``
        with the first two written out (this runs once per copy)."""
        now = self.env.now
        dt = now - self._last
        flows = self._flows
        if dt > 0:
            for f in flows:
                f.remaining -= f.rate * dt
            busy_s = self._busy_s
            for i in self._busy:
                busy_s[i] += dt
        self._last = now
        self._seq += 1
        flow = _Flow(path, n_bytes, done, self._seq)
        flows.append(flow)
        self._numbers.append(path.number)
        if self._wakeup is None or not self._joins_alone(flow):
            self._reschedule()

    def _joins_alone(self, flow: _Flow) -> bool:
        """Whether ``flow``, just started, leaves every other flow its rate and lands no
        earlier than the pending wake-up: then that wake-up stands (the others' landing
        times have not moved) and ``flow`` takes its rate without a new one. The wake-up
        keeps the instant worked out when it was scheduled, where rescheduling would
        work it out again from the bytes left now (the same instant in exact arithmetic,
        the float rounded once less)."""
        key = tuple(self._numbers)
        config = _CONFIGS.get(key)
        if config is None:
            config = _remember(key, self._flows)
        rates = config[0]
        if rates[:-1] != self._rates:
            return False
        rate = rates[-1]
        if self.env.now + flow.remaining / rate < self._wake_at_s:
            return False
        flow.rate = rate
        self._rates, self._busy = rates, config[3]
        if self.record_rates:
            self._record_rates()
        return True

    def _reschedule(self) -> None:
        """Set every active flow's rate (its configuration's, remembered or worked out)
        and schedule a wake-up for the first to land at those rates. The wake-up it
        supersedes stays in the queue with no callbacks (popped and dropped in its
        turn), so every event keeps its place and a stale one costs no call."""
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup.callbacks.clear()
            self._wakeup = None
        flows = self._flows
        if not flows:
            self._busy = self._rates = ()
            if self.record_rates:
                self.rate_log.append((self.env.now, {}))
            return
        key = tuple(self._numbers)
        config = _CONFIGS.get(key)
        if config is None:
            config = _remember(key, flows)
        rates, _names, _routes, self._busy = config
        self._rates = rates
        dt = math.inf
        for f, rate in zip(flows, rates):
            f.rate = rate
            left_s = f.remaining / rate
            if left_s < dt:
                dt = left_s
        if self.record_rates:
            self._record_rates()
        if dt < 0.0:
            dt = 0.0
        self._wake_at_s = self.env.now + dt
        self._wakeup = call_in(self.env, dt, self._wake)

    def _record_rates(self) -> None:
        per_link: dict[str, float] = defaultdict(float)
        for f in self._flows:
            for link in f.path.links:
                per_link[link.name] += f.rate
        self.rate_log.append((self.env.now, dict(per_link)))

    def _wake(self, _event: simpy.Event) -> None:
        """Land the flows that are done (by the rounding tolerance; the earliest one when
        rounding left only slivers), re-rate the others, then fire the landed flows'
        events in the order they started (the flows' list is in that order: flows are
        appended as they start and removed in place). One landed flow whose event would
        be the next processed (``simpy_fast.go_on_now``: this is the wake-up's only
        callback and this its last act) fires in place: its waiter goes on inside this
        call, in the same order, one event fewer per copy. ``_advance`` is written out."""
        self._wakeup = None
        now = self.env.now
        dt = now - self._last
        flows, numbers = self._flows, self._numbers
        if dt > 0:
            for f in flows:
                f.remaining -= f.rate * dt
            busy_s = self._busy_s
            for i in self._busy:
                busy_s[i] += dt
        self._last = now
        landed = [i for i, f in enumerate(flows) if f.remaining <= _EPS * (f.rate if f.rate > 1.0 else 1.0)]
        if not landed:  # rounding left a sliver: finish the earliest flow now
            landed = [min(range(len(flows)), key=lambda i: (flows[i].remaining / flows[i].rate, flows[i].seq))]
        if len(landed) == 1:
            i = landed[0]
            finished = [flows.pop(i)]
            del numbers[i]
        else:
            finished = [flows[i] for i in landed]
            for i in reversed(landed):
                del flows[i]
                del numbers[i]
        self._reschedule()
        if len(finished) == 1 and go_on_now(self.env):  # its waiter goes on now: same order
            done = finished[0].done
            if isinstance(done, _Group):
                done.fire()
            elif isinstance(done, simpy.Event):
                fire_in_place(done)
            else:
                done(None)
            return
        for f in finished:
            done = f.done
            if isinstance(done, (simpy.Event, _Group)):
                done.succeed()
            else:  # where a succeeded event would go: now, NORMAL, the next number
                call_in(self.env, 0.0, done)


_LINKS: dict[str, int] = {}
"""Every link name met in this process, numbered in the order met: a network charges
busy time to a list by these numbers (a list index, where a dict of names would hash).
Numbered under ``_NUMBERING``, as runs on several threads may meet new links at once."""
_NUMBERING = threading.Lock()

CONFIGS = 8192
"""Configurations remembered per process (``_CONFIGS``)."""
_Config = tuple[tuple[float, ...], tuple[str, ...], tuple[Route, ...], tuple[int, ...]]
_CONFIGS: dict[tuple[int, ...], _Config] = {}
"""Per configuration (the active flows' route ids, in order): each flow's rate, the links
they keep busy, the routes themselves, and the busy links' numbers (``_LINKS``). Holding
the routes keeps their ids from being reused by other objects while the entry lives, so
equal keys always mean the same routes."""


def _remember(key: tuple[int, ...], flows: list[_Flow]) -> _Config:
    """Work out and remember a configuration's rates (the oldest half of the memo is let
    go when it is full)."""
    if len(_CONFIGS) >= CONFIGS:
        for old in list(_CONFIGS)[: CONFIGS // 2]:
            del _CONFIGS[old]
    rates, busy = _config_rates(flows)
    config = _CONFIGS[key] = (rates, busy, tuple(f.path.route for f in flows), tuple(_LINKS[name] for name in busy))
    return config


def _config_rates(flows: list[_Flow]) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """Max-min fair rates of ``flows`` (in their order) by progressive filling, and the
    links they keep busy; per link, the capacity left and the number of flows not yet
    frozen are kept up to date, so each round is one pass."""
    members: dict[str, list[_Flow]] = {}
    slots = 0
    for f in flows:
        names = f.path.names
        slots += len(names)
        for name in names:
            shared = members.get(name)
            if shared is None:
                members[name] = [f]
            else:
                shared.append(f)
    busy = tuple(members)
    if slots == len(members):  # no link shared: each flow runs at its narrowest link
        return tuple(f.path.narrowest for f in flows), busy
    capacity: dict[str, float] = {}
    for f in flows:
        f.rate = -1.0
        for link in f.path.links:
            capacity[link.name] = link.bandwidth
    _fill(members, capacity)
    return tuple(f.rate for f in flows), busy


def _fill(members: dict[str, list[_Flow]], capacity: dict[str, float]) -> None:
    """Progressive filling of flows whose rate is -1: freeze the flows of the link with
    the smallest fair share at that share, take it from their other links, repeat (ties
    go to the link met first, in flow order). The links wait in a heap of (share, order
    met); an entry whose share is no longer its link's is skipped (a newer one was pushed
    when the share changed), so each round costs a pop, not a scan of every link."""
    unfrozen = {name: len(flows) for name, flows in members.items()}
    order = {name: i for i, name in enumerate(members)}
    heap = [(capacity[name] / n, order[name], name) for name, n in unfrozen.items()]
    heapq.heapify(heap)
    while unfrozen:
        share, _, best_name = heapq.heappop(heap)
        waiting = unfrozen.get(best_name)
        if waiting is None or capacity[best_name] / waiting != share:
            continue
        for f in members[best_name]:
            if f.rate < 0:
                f.rate = share
                for name in f.path.names:
                    capacity[name] -= share
                    left = unfrozen[name] - 1
                    if left:
                        unfrozen[name] = left
                        heapq.heappush(heap, (capacity[name] / left, order[name], name))
                    else:
                        del unfrozen[name]
