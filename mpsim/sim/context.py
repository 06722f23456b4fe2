"""What the engine's components share during one run: the environment, the network, the
memory owners, copy engines, the signals between components, and what the run records."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy

from mpsim.hardware.topology import HOST, Route
from mpsim.sim import progress
from mpsim.sim.copy_engine import CopyEngines, EnginePool
from mpsim.sim.layout import Layout
from mpsim.sim.memory import DeviceMemory, MemoryLog
from mpsim.sim.network import Network
from mpsim.sim.result import COSTS, Span
from mpsim.sim.simpy_fast import events_scheduled, fire_in_place, go_on_now
from mpsim.units import GiB


class Signals:
    """Named one-shot events between components, made on first use by either side:
    ``("activation"|"gradient", stage, mb)`` a boundary tensor has landed,
    ``("out"|"in", stage, mb, layer)`` a swap-out or swap-in has landed. ``reached`` holds the
    (stage, mb, layer) whose backward waits for its swap-in (``reach``); ``when_reached``
    gives an event for it to whoever must not start before (an on-demand swap-in)."""

    def __init__(self, env: simpy.Environment) -> None:
        self._env = env
        self._events: dict[tuple[object, ...], simpy.Event] = {}
        self.reached: set[tuple[int, int, int]] = set()

    def __call__(self, *key: object) -> simpy.Event:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self._env.event()
        return ev

    def fire(self, *key: object) -> None:
        """Succeed the signal ``key`` as a callback's last act: in place, its waiters
        going on now, where its event would be the next processed
        (``simpy_fast.go_on_now``), else through its event."""
        event = self(*key)
        if go_on_now(self._env):
            fire_in_place(event)
        else:
            event.succeed()

    def reach(self, key: tuple[int, int, int]) -> None:
        """The backward of (stage, mb, layer) has reached the layer and waits for it."""
        self.reached.add(key)
        waiting = self._events.get(("reach", *key))
        if waiting is not None:
            waiting.succeed()

    def when_reached(self, key: tuple[int, int, int]) -> simpy.Event | None:
        """An event for ``reach(key)``, or None when it has happened."""
        return None if key in self.reached else self("reach", *key)


class CostLedger:
    """Seconds each technique cost each GPU (``COSTS``), each entry with the time it was
    paid, so that a PipeDream run counts the measured iteration only."""

    def __init__(self, env: simpy.Environment, n_gpus: int) -> None:
        self._env = env
        self._paid: list[list[Any]] = [[] for _ in range(n_gpus)]
        """Per GPU, laid flat: time paid, cost, seconds, ... (no tuple per entry: nothing
        for the cyclic garbage collector to scan after a run)."""

    def add(self, gpu: int, what: str, seconds: float) -> None:
        if seconds:
            self._paid[gpu].extend((self._env.now, what, seconds))

    def total(self, gpu: int, window_s: tuple[float, float] | None = None) -> dict[str, float]:
        """Seconds per cost paid in ``(start, end]`` (the whole run when None)."""
        out = dict.fromkeys(COSTS, 0.0)
        paid = self._paid[gpu]
        for at_s, what, seconds in zip(paid[0::3], paid[1::3], paid[2::3], strict=True):
            if window_s is None or window_s[0] < at_s <= window_s[1]:
                out[what] += seconds
        return out


class RunContext:
    """One run's shared state; components hold a reference and never copy it."""

    def __init__(self, layout: Layout) -> None:
        topo = layout.topology
        self.layout = layout
        self.topo = topo
        self.env = simpy.Environment()
        self.net = Network(self.env, layout.record_link_rates)
        self.log = MemoryLog(topo.n_gpus + 2)
        self.signals = Signals(self.env)
        self.memory = [DeviceMemory(self.env, g, topo.capacity_bytes, self.log, self.signals.reached)
                       for g in range(topo.n_gpus)]
        """The owner of each GPU's memory."""
        self.replicas = layout.host_ways
        """Copies of the simulated GPU's work: every tensor-parallel rank of every
        data-parallel replica gets its share of the host's memory, NVMe and CPU (the engine
        simulates one rank of replica 0; ``data_parallel``, ``tensor_group``;
        ``Layout.host_ways``)."""
        self.servers = layout.view_servers
        """Servers (hosts) the simulated GPUs sit on."""
        self.host = DeviceMemory(self.env, topo.n_gpus, self.host_share_bytes, self.log)
        """The owner of replica 0's share of pinned host memory (it never waits)."""
        self.nvme = DeviceMemory(self.env, topo.n_gpus + 1, self.nvme_share_bytes, self.log)
        """Replica 0's share of the NVMe drives (ZeRO-Infinity's offload target)."""
        self.offload = self.nvme if layout.offload_device == "nvme" else self.host
        """Where the plan's offloaded parameters and optimizer states live."""
        self.engines = [CopyEngines(self.env, g, topo.spec.gpu.peer_copy_engines) for g in range(topo.n_gpus)]
        self.on_demand = layout.swap_timing == "on-demand"
        """Swaps as the GPU-CPU swap baseline runs them (``PlanFile.swap_timing``)."""
        self.spans: list[Span] = []
        self.costs = CostLedger(self.env, topo.n_gpus)
        self.on_task = progress.current()
        """Called after every task when a caller shows progress (``sim.progress``)."""
        self._host_ways: dict[tuple[int, bool], HostWay] = {}
        """Per (GPU, toward the host): what its host copies share (``start_host_copy``)."""

    @property
    def host_share_bytes(self) -> int:
        return self.topo.host_memory_bytes * self.servers // self.replicas

    @property
    def nvme_share_bytes(self) -> int:
        nvme = self.topo.spec.nvme
        return 0 if nvme is None else int(nvme.capacity_gib * GiB) * self.servers // self.replicas

    def nvme_seconds(self, n_bytes: int, write: bool) -> float:
        """Replica 0's share of NVMe traffic: every replica moves as much at once, so the
        drives' bandwidth is shared ``replicas`` ways."""
        nvme = self.topo.spec.nvme
        if nvme is None:
            return 0.0
        return n_bytes * self.replicas / ((nvme.write_gbps if write else nvme.read_gbps) * 1e9)

    def events_scheduled(self) -> int:
        """SimPy events scheduled so far (a measure of simulation work): SimPy numbers
        every scheduled event from one counter, read here without a per-event hook
        (``simpy_fast.events_scheduled``)."""
        return events_scheduled(self.env)

    @property
    def torch_pipelining(self) -> bool:
        return self.layout.runtime == "torch-pipelining"

    def host_copy(self, gpu: int, n_bytes: int, to_host: bool, label: str) -> Generator[simpy.Event, object, None]:
        """A copy between ``gpu`` and pinned host memory. Timing: waits in FIFO order for
        the GPU's d2h or h2d engine, then flows over the PCIe route; memory is the
        caller's business."""
        with self.host_engines(gpu, to_host).request() as req:
            yield req
            start = self.env.now
            yield self.net.transfer(self.host_route(gpu, to_host), n_bytes)
        self.host_span(gpu, to_host, label, start)

    def host_engines(self, gpu: int, to_host: bool) -> EnginePool:
        """The GPU's copy engines toward the host (d2h) or from it (h2d)."""
        return self.engines[gpu].d2h if to_host else self.engines[gpu].h2d

    def host_route(self, gpu: int, to_host: bool) -> Route:
        return self.topo.route(gpu, HOST) if to_host else self.topo.route(HOST, gpu)

    def host_span(self, gpu: int, to_host: bool, label: str, start_s: float) -> None:
        """A host copy's busy interval, from ``start_s`` to now, on the GPU's d2h or h2d lane."""
        self.spans.append(Span(gpu, "d2h" if to_host else "h2d", label, start_s, self.env.now))

    def start_host_copy(self, gpu: int, n_bytes: int, to_host: bool, label: str, then: Callable[[], None]) -> None:
        """``host_copy`` for a caller that waits for nothing else: the same steps on the
        same events, each a callback instead of a process resumed, and ``then()`` called
        when the copy has landed and its engine is given back (``HostCopy``)."""
        way = self._host_ways.get((gpu, to_host))
        if way is None:
            way = self._host_ways[(gpu, to_host)] = HostWay(self, gpu, to_host)
        HostCopy(way, n_bytes, label, then)


class HostWay:
    """What every host copy of one GPU in one direction shares: the network, the spans,
    its engines, its route and its lane (``RunContext.host_engines``, ``host_route``,
    ``host_span``), looked up once per run. It holds no reference to the run (the run
    holds it): a finished run is freed by reference counting, not left to the cyclic
    garbage collector (``simpy_fast.gc_paused``)."""

    __slots__ = ("net", "spans", "gpu", "pool", "route", "lane")

    def __init__(self, run: RunContext, gpu: int, to_host: bool) -> None:
        self.net = run.net
        self.spans = run.spans
        self.gpu = gpu
        self.pool = run.host_engines(gpu, to_host)
        self.route = run.host_route(gpu, to_host)
        self.lane = "d2h" if to_host else "h2d"


class HostCopy:
    """One copy between a GPU and pinned host memory run as callbacks (``RunContext.
    start_host_copy``): it takes the engine (``EnginePool.take``: going on at once when
    one is free, else when a release hands it one), starts the flow
    (``Network.transfer_then``), and on the flow's landing gives the engine back,
    records the span and calls ``then``. Against ``host_copy`` it saves a process and
    its generator frames per copy, the request's and the transfer's events, and the
    grant and hand-over events (``EnginePool``'s doc says what that moves)."""

    __slots__ = ("way", "n_bytes", "label", "then", "start_s")

    def __init__(self, way: HostWay, n_bytes: int, label: str, then: Callable[[], None]) -> None:
        self.way = way
        self.n_bytes = n_bytes
        self.label = label
        self.then = then
        self.start_s = 0.0
        if way.pool.take(self):  # granted in place
            self.granted(None)

    def granted(self, _event: simpy.Event | None) -> None:
        """The engine is ours: the flow starts (after its route's latency)."""
        way = self.way
        net = way.net
        self.start_s = net.env.now
        net.transfer_then(way.route, self.n_bytes, self._landed)

    def _landed(self, _event: simpy.Event | None) -> None:
        way = self.way
        way.pool.release(self)
        way.spans.append(Span(way.gpu, way.lane, self.label, self.start_s, way.net.env.now))
        self.then()
