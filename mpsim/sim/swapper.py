"""A stage's swaps: activations to host or peer GPUs and back, PipeDream weight versions
and streamed optimizer states to the host."""

from __future__ import annotations

from collections.abc import Generator
from functools import lru_cache
from typing import Any, NamedTuple, cast

import simpy

from mpsim.hardware.topology import HOST
from mpsim.sim.context import RunContext
from mpsim.sim.memory import Entry
from mpsim.sim.program import SwapIn, SwapOut, chunk
from mpsim.sim.result import Span
from mpsim.sim.simpy_fast import call_in, call_soon, go_on
from mpsim.sim.spawn import spawn

STASH = -1
"""Pseudo-layer of a PipeDream weight version kept in host memory."""

Peers = tuple[tuple[int, float], ...]


def striped(peers: Peers, n_bytes: int) -> list[tuple[int, int]]:
    """Bytes per peer of a striped copy (MPress III-C); the last part takes the rounding."""
    parts, given = [], 0
    for i, (peer, fraction) in enumerate(peers):
        part = n_bytes - given if i == len(peers) - 1 else int(round(n_bytes * fraction))
        given += part
        parts.append((peer, part))
    return parts


@lru_cache(maxsize=4096)
def returned_parts(si: SwapIn) -> list[tuple[int, int]]:
    """Bytes each peer gives back to a D2D swap-in: what the swap-outs of the layer's
    micro-tensors striped there, summed (each micro-tensor is striped on its own)."""
    totals = dict.fromkeys((peer for peer, _ in si.peers), 0)
    for c in range(si.chunks):
        n_bytes = chunk(si.own_bytes, c, si.chunks) + chunk(si.input_bytes, c, si.chunks)
        for peer, part in striped(si.peers, n_bytes):
            totals[peer] += part
    return list(totals.items())


class SwapLabels(NamedTuple):
    """The strings one layer's swap of one microbatch writes (span names, memory log
    labels and its ledger category), made once per process (``swap_labels``)."""

    out_span: str
    out_host: str
    out_own: str
    out_input: str
    out_ledger: str
    in_span: str
    in_own: str
    in_input: str
    in_ledger: str
    in_host: str
    ledger: str


@lru_cache(maxsize=1 << 16)
def swap_labels(layer: int, mb: int, gpu: int, target: str) -> SwapLabels:
    """``SwapLabels`` of layer ``layer`` (``STASH``: the weight version) of microbatch
    ``mb`` swapped from GPU ``gpu`` to ``target``: a search simulates the same swaps
    run after run, and a swap-heavy run would otherwise format a dozen strings per swap."""
    if layer == STASH:
        label = f"weight version of microbatch {mb}"
        return SwapLabels(f"stash W mb{mb}", f"{label} from GPU {gpu}", "", "", "", f"swap-in W mb{mb}",
                          f"{label} swapped in", "", f"{label} swapped in", f"{label} back on GPU {gpu}", "saved:stash")
    label = f"layer {layer} microbatch {mb}"
    return SwapLabels(f"swap-out L{layer} mb{mb}", f"swap-out of {label} from GPU {gpu}",
                      f"{label} saved activations swapped out", f"{label} saved input swapped out",
                      f"{label} swapped out", f"swap-in L{layer} mb{mb}", f"{label} saved activations swapped in",
                      f"{label} saved input swapped in", f"{label} swapped in", f"{label} back on GPU {gpu}",
                      f"saved:{target}")


class Swapper:
    """The copies of one stage that move model data off its GPU and back.

    Timing: a swap-out waits for the engine of its kind (d2h for the host, a peer engine
    for D2D), flows over its route(s), and frees the GPU's bytes when the last part
    lands. A swap-in is prefetched so that, alone on an idle route, it would land when
    the backward needs it; its memory is granted when it may start (it waits while it
    does not fit and a free is under way or the backward has not reached it yet, TSPLIT
    eq. 3: M_k + size <= M) and only then does it queue for its engine."""

    def __init__(self, run: RunContext, stage: int, chunks: dict[int, int], peers: dict[int, Peers]) -> None:
        self.run = run
        self.stage = stage
        self.gpu = run.layout.gpu_of[stage]
        self.memory = run.memory[self.gpu]
        self._chunks = chunks
        self._peers = peers
        self._chunks_left: dict[tuple[int, int], int] = {}
        self._alone_s: dict[int, float] = {}

    # ---- activations --------------------------------------------------------------------
    def start_swap_out(self, mb: int, so: SwapOut) -> None:
        """Launch a swap-out; it counts as a free under way before the next piece asks.
        A swap to the host runs as callbacks (``RunContext.start_host_copy``) started
        here, in the stream's step: its engine is taken (or queued for) now, not from an
        urgent start event right after the step, so its copy's events are scheduled
        ahead of what the rest of the step schedules (the engine's queue order is the
        same: the stream's own later copies come after it either way)."""
        self.memory.begin_free()
        if so.target == "host":
            self._swap_out_to_host(mb, so)
        else:
            spawn(self.run.env, self._swap_out_to_peers(mb, so))

    def _swap_out_to_host(self, mb: int, so: SwapOut) -> None:
        n = so.own_bytes + so.input_bytes
        labels = swap_labels(so.layer, mb, self.gpu, so.target)

        def landed() -> None:
            self.run.host.change([(n, "activations", labels.out_host)])
            self._swapped_out(mb, so)

        self.run.start_host_copy(self.gpu, n, True, labels.out_span, landed)

    def _swap_out_to_peers(self, mb: int, so: SwapOut) -> Generator[simpy.Event, object, None]:
        n = so.own_bytes + so.input_bytes
        yield from self._to_peers(so, mb, n, f"layer {so.layer} microbatch {mb}")
        self._swapped_out(mb, so)

    def _swapped_out(self, mb: int, so: SwapOut) -> None:
        """The swap-out has landed: free its bytes on the GPU; the layer's last chunk
        signals it out. The last act of the landing's callback (``end_free_last``)."""
        labels = swap_labels(so.layer, mb, self.gpu, so.target)
        entries: list[Entry] = [(-so.own_bytes, "activations", labels.out_own)]
        if so.input_bytes:
            entries.append((-so.input_bytes, so.input_cat, labels.out_input))
        entries.append((so.own_bytes + so.input_bytes, labels.ledger, labels.out_ledger))
        key = (mb, so.layer)
        left = self._chunks_left.get(key, self._chunks[so.layer]) - 1
        self._chunks_left[key] = left
        if left == 0:
            self.memory.end_free_last(entries, self.run.signals("out", self.stage, mb, so.layer))
        else:
            self.memory.end_free_last(entries)

    def _to_peers(self, so: SwapOut, mb: int, n_bytes: int, label: str) -> Generator[simpy.Event, object, None]:
        """D2D swap-out striped over the peers; each peer's area is allocated as it starts."""
        run, g = self.run, self.gpu
        with run.engines[g].peer.request() as req:
            yield req
            start = run.env.now
            flows = []
            for peer, part in striped(self._peers[so.layer], n_bytes):
                run.memory[peer].change([(part, "peer_swap", f"D2D swap-in area for GPU {g} {label}")])
                flows.append(run.net.transfer(run.topo.route(g, peer), part))
            yield simpy.AllOf(run.env, flows)
        run.spans.append(Span(g, "copy", f"D2D swap-out L{so.layer} mb{mb}", start, run.env.now))

    def start_swap_in(self, mb: int, si: SwapIn, need_at_s: float) -> None:
        """Bring ``si`` back for microbatch ``mb``'s backward, needed at ``need_at_s``: as
        callbacks started where a process would start (``SwapInSteps``)."""
        SwapInSteps(self, mb, si, need_at_s)

    def _time_alone_s(self, si: SwapIn) -> float:
        """How long the swap-in takes alone on idle routes (worked out once per layer)."""
        alone = self._alone_s.get(si.layer)
        if alone is None:
            topo = self.run.topo
            if si.target == "host":
                alone = topo.route(HOST, self.gpu).time_alone_s(si.n_bytes)
            else:
                alone = max(topo.route(peer, self.gpu).time_alone_s(part) for peer, part in returned_parts(si))
            self._alone_s[si.layer] = alone
        return alone

    @staticmethod
    def _swap_in_entries(mb: int, si: SwapIn, gpu: int) -> list[Entry]:
        labels = swap_labels(si.layer, mb, gpu, si.target)
        if si.layer == STASH:
            return [(si.n_bytes, "stash", labels.in_own), (-si.n_bytes, "saved:stash", labels.in_ledger)]
        entries: list[Entry] = [(si.own_bytes, "activations", labels.in_own)]
        if si.input_bytes:
            entries.append((si.input_bytes, si.input_cat, labels.in_input))
        entries.append((-si.n_bytes, labels.ledger, labels.in_ledger))
        return entries

    def _from_host(self, mb: int, si: SwapIn) -> None:
        """The host copy of a swap-in, as callbacks (``RunContext.start_host_copy``); on
        landing the host's bytes are freed and the swap-in signalled."""
        run = self.run
        labels = swap_labels(si.layer, mb, self.gpu, si.target)

        def landed() -> None:
            run.host.change([(-si.n_bytes, "stash" if si.layer == STASH else "activations", labels.in_host)])
            run.signals.fire("in", self.stage, mb, si.layer)

        run.start_host_copy(self.gpu, si.n_bytes, False, labels.in_span, landed)

    def _from_peers(self, mb: int, si: SwapIn) -> Generator[simpy.Event, object, None]:
        """The D2D copies of a swap-in; the swap-in is signalled once all have landed."""
        run, g = self.run, self.gpu
        parts = returned_parts(si)
        with run.engines[g].peer.request() as req:
            yield req
            start = run.env.now
            yield simpy.AllOf(run.env, [run.net.transfer(run.topo.route(peer, g), part) for peer, part in parts])
        for peer, part in parts:
            run.memory[peer].change([(-part, "peer_swap",
                                      f"D2D swap area of GPU {g} layer {si.layer} microbatch {mb} released")])
        run.spans.append(Span(g, "copy", f"D2D swap-in L{si.layer} mb{mb}", start, run.env.now))
        run.signals.fire("in", self.stage, mb, si.layer)

    # ---- weight versions and optimizer states -------------------------------------------
    def stash_out(self, mb: int, n_bytes: int) -> Generator[simpy.Event, object, None]:
        """PipeDream weight version to host memory after the forward (nothing to free on
        the GPU: the live weights stay)."""
        run = self.run
        labels = swap_labels(STASH, mb, self.gpu, "host")
        yield from run.host_copy(self.gpu, n_bytes, True, labels.out_span)
        run.host.change([(n_bytes, "stash", labels.out_host)])
        run.signals.fire("out", self.stage, mb, STASH)

    def start_optimizer_out(self, layer: int, n_bytes: int) -> None:
        """Stream a layer's optimizer states back to the host after its update."""
        self.memory.begin_free()
        spawn(self.run.env, self._optimizer_out(layer, n_bytes))

    def _optimizer_out(self, layer: int, n_bytes: int) -> Generator[simpy.Event, object, None]:
        yield from self.run.host_copy(self.gpu, n_bytes, True, f"optimizer states out L{layer}")
        label = f"layer {layer} optimizer states streamed out"
        self.memory.end_free([(-n_bytes, "optimizer", label), (n_bytes, "saved:optimizer", label)])


class SwapInSteps:
    """One swap-in run as callbacks, each step where the process it replaces went on:
    started through an urgent event scheduled now (``simpy_fast.call_soon``, as a
    process starts); waits for the swap-out to have landed; waits until the copy, alone
    on its route, would land when the backward needs it (under ``torch-pipelining``
    re-timed from the gradient's arrival when that comes late; with on-demand swaps,
    until the backward reaches the layer); takes its memory (``DeviceMemory.acquire_then``:
    held while the backward has not reached the layer and it does not fit beside the
    running task's climb); then copies from the host (``Swapper._from_host``) or from the
    peers (``Swapper._from_peers``, a generator run from there on). The same events in
    the same order as the process; no generator frames per step.

    One step is taken earlier: a prefetch whose swap-out has landed and whose first act
    is its sleep schedules that sleep as it is made, not from its urgent start event
    (``_sleeps_at_once``): the start would only read the same state (nothing lands
    between the two: they lie in one instant, before any event of normal priority) and
    schedule the same wake-up, so one event fewer per such swap-in. The wake-up's place
    in the queue moves ahead of the events scheduled in that instant between the two
    (by the stream after its prefetch, and by the urgent events before the start);
    it matters only if one of them falls on the very same later instant (a tie of two
    sums of floats)."""

    __slots__ = ("swapper", "mb", "si", "need_at_s")

    def __init__(self, swapper: Swapper, mb: int, si: SwapIn, need_at_s: float) -> None:
        self.swapper = swapper
        self.mb = mb
        self.si = si
        self.need_at_s = need_at_s
        if not self._sleeps_at_once():
            call_soon(swapper.run.env, self._start)

    def _sleeps_at_once(self) -> bool:
        """Schedule the sleep before the copy now, when ``_start`` would only do that
        (the swap-out has landed, swaps are prefetched and the copy is not due yet)."""
        sw = self.swapper
        run = sw.run
        if run.on_demand or cast(Any, run.signals("out", sw.stage, self.mb, self.si.layer)).callbacks is not None:
            return False
        wake_s, env = self.need_at_s - sw._time_alone_s(self.si), run.env
        if wake_s > env.now:
            call_in(env, wake_s - env.now, self._after_sleep)
            return True
        return False

    def _start(self, _event: simpy.Event) -> None:
        sw = self.swapper
        out = sw.run.signals("out", sw.stage, self.mb, self.si.layer)
        waiters = cast(Any, out).callbacks  # None once processed (SimPy types it as a list)
        if waiters is not None:  # not processed yet: wait for it
            waiters.append(self._until_start)
        else:
            self._until_start(out)

    def _until_start(self, _event: simpy.Event) -> None:
        sw = self.swapper
        run, alone = sw.run, sw._time_alone_s(self.si)
        env = run.env
        if run.on_demand:
            reached = run.signals.when_reached((sw.stage, self.mb, self.si.layer))
            waiters = None if reached is None else cast(Any, reached).callbacks  # None once processed
            if waiters is not None:
                waiters.append(self._acquire)
            else:
                self._acquire(None)
            return
        if self.need_at_s - alone > env.now:
            call_in(env, self.need_at_s - alone - env.now, self._after_sleep)
        else:
            self._after_sleep(None)

    def _after_sleep(self, _event: simpy.Event | None) -> None:
        sw = self.swapper
        run = sw.run
        if run.torch_pipelining and sw.stage < run.layout.n_stages - 1:
            gradient = run.signals("gradient", sw.stage, self.mb)
            if not gradient.triggered:
                gradient.callbacks.append(self._after_gradient)
                return
        self._acquire(None)

    def _after_gradient(self, _event: simpy.Event) -> None:
        alone = self.swapper._time_alone_s(self.si)
        if self.si.need_offset_s > alone:
            call_in(self.swapper.run.env, self.si.need_offset_s - alone, self._acquire)
        else:
            self._acquire(None)

    def _acquire(self, _event: simpy.Event | None) -> None:
        sw, si = self.swapper, self.si
        sw.memory.acquire_then(sw._swap_in_entries(self.mb, si, sw.gpu), (sw.stage, self.mb, si.layer), self._copy)

    def _copy(self) -> None:
        sw = self.swapper
        if self.si.target == "host":
            sw._from_host(self.mb, self.si)
        else:
            go_on(sw._from_peers(self.mb, self.si))
