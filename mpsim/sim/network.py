"""Links as fluid resources shared max-min fairly by concurrent transfers.

Timing assumptions: a transfer first waits its route's setup latency, then flows. While
flows are active each gets its max-min fair rate (progressive filling: repeatedly find
the link whose remaining capacity divided by its unfrozen flows is smallest, freeze those
flows at that share). Rates are recomputed whenever a flow starts or ends, so a transfer
alone on a link takes latency + bytes / bandwidth, and two that start together on one
link each get half of it.
"""

from __future__ import annotations

from collections import defaultdict

import simpy

from mpsim.topology import Link, Route

_EPS = 1e-12


class _Flow:
    __slots__ = ("links", "remaining", "rate", "done", "seq")

    def __init__(self, links: tuple[Link, ...], n_bytes: float, done: simpy.Event, seq: int) -> None:
        self.links = links
        self.remaining = float(n_bytes)
        self.rate = 0.0
        self.done = done
        self.seq = seq


class Network:
    """Owns every active flow; ``transfer`` returns an event that fires when bytes land."""

    def __init__(self, env: simpy.Environment, record_rates: bool = False) -> None:
        self.env = env
        self.record_rates = record_rates
        self.rate_log: list[tuple[float, dict[str, float]]] = []
        """(time, bytes/s per busy link) at every change, when ``record_rates``."""
        self._flows: list[_Flow] = []
        self._last = 0.0
        self._version = 0
        self._seq = 0
        self.bytes_by_link: dict[str, float] = defaultdict(float)
        self.busy_s_by_link: dict[str, float] = defaultdict(float)

    def transfer(self, route: Route, n_bytes: int) -> simpy.Event:
        done = self.env.event()
        for link in route.links:
            self.bytes_by_link[link.name] += n_bytes
        if n_bytes <= 0:

            def land(_e: simpy.Event) -> None:
                done.succeed()

            self.env.timeout(route.latency_s).callbacks.append(land)
            return done
        start = self.env.timeout(route.latency_s)
        start.callbacks.append(lambda _e: self._start(route.links, n_bytes, done))
        return done

    # -- fluid model -----------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            busy: set[str] = set()
            for f in self._flows:
                f.remaining -= f.rate * dt
                busy.update(link.name for link in f.links)
            for name in busy:
                self.busy_s_by_link[name] += dt
        self._last = now

    def _start(self, links: tuple[Link, ...], n_bytes: int, done: simpy.Event) -> None:
        self._advance()
        self._seq += 1
        self._flows.append(_Flow(links, n_bytes, done, self._seq))
        self._reschedule()

    def _rates(self) -> None:
        """Max-min fair rates by progressive filling; per link, the capacity left and the
        number of flows not yet frozen are kept up to date, so each round is one pass."""
        capacity: dict[str, float] = {}
        members: dict[str, list[_Flow]] = defaultdict(list)
        slots = 0
        for f in self._flows:
            f.rate = -1.0
            slots += len(f.links)
            for link in f.links:
                capacity[link.name] = link.bandwidth
                members[link.name].append(f)
        if slots == len(members):  # no link shared: each flow runs at its narrowest link
            for f in self._flows:
                f.rate = min(link.bandwidth for link in f.links)
            return
        unfrozen = {name: len(flows) for name, flows in members.items()}
        while unfrozen:
            best_name = min(unfrozen, key=lambda name: capacity[name] / unfrozen[name])
            share = capacity[best_name] / unfrozen[best_name]
            for f in members[best_name]:
                if f.rate < 0:
                    f.rate = share
                    for link in f.links:
                        name = link.name
                        capacity[name] -= share
                        left = unfrozen[name] - 1
                        if left:
                            unfrozen[name] = left
                        else:
                            del unfrozen[name]

    def _reschedule(self) -> None:
        self._version += 1
        if not self._flows:
            if self.record_rates:
                self.rate_log.append((self.env.now, {}))
            return
        self._rates()
        if self.record_rates:
            per_link: dict[str, float] = defaultdict(float)
            for f in self._flows:
                for link in f.links:
                    per_link[link.name] += f.rate
            self.rate_log.append((self.env.now, dict(per_link)))
        dt = min(f.remaining / f.rate for f in self._flows)
        version = self._version
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later start or end
        self._advance()
        finished = [f for f in self._flows if f.remaining <= _EPS * max(1.0, f.rate)]
        if not finished:  # rounding left a sliver: finish the earliest flow now
            finished = [min(self._flows, key=lambda f: (f.remaining / f.rate, f.seq))]
        for f in finished:
            self._flows.remove(f)
        self._reschedule()
        for f in sorted(finished, key=lambda f: f.seq):
            f.done.succeed()
