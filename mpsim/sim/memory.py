"""Per-GPU memory: a log of allocations and frees analysed after the run, and the live
count of bytes in use that decides when an allocation must wait.

The log (``MemoryLog``) is exact. A piece of a stage's forward or backward registers all
its per-layer allocations at once from a precomputed template (offsets within the piece,
byte deltas, categories) instead of one simulation event per layer. After the run, the
events of each GPU are ordered by (time, order of registration), summed, and give the
peak, the breakdown by category at the peak, the memory-over-time series and the first
point where a GPU exceeded its capacity. The host's pinned memory is one more log.

Ledger categories (``saved:<technique>``) do not count as memory in use: they record
what a technique keeps off the GPU at each moment (bytes the plain plan would hold there
and this plan does not), so their sum at a GPU's peak is what each technique saved there
(MPress Table IV).

``LiveMemory`` decides waits (DESIGN "The simulation"): an allocation that does not fit
waits while frees are under way on that GPU (a swap-out in flight) and goes ahead when
none are, so a job that does not fit still runs to the end and shows its demand. While a
piece runs, its highest point is held as a reservation, so the live count never falls
below the log's (it may wait slightly early, never late).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import simpy

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "stash", "buffers", "workspace",
                               "peer_swap")
"""What memory in use is made of; ``peer_swap`` is space a GPU holds for other GPUs' D2D swaps."""
TECHNIQUES: tuple[str, ...] = ("recompute", "host", "peer", "split", "optimizer", "stash")
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
    _single: list[list[tuple[float, int, int, int, str]]] = field(default_factory=list)
    _templated: list[list[tuple[float, int, Template, str]]] = field(default_factory=list)
    _order: int = 0

    def __post_init__(self) -> None:
        self._single = [[] for _ in range(self.n_gpus)]
        self._templated = [[] for _ in range(self.n_gpus)]

    def event(self, gpu: int, time_s: float, delta: int, category: str, label: str) -> None:
        self._order += 1
        self._single[gpu].append((time_s, self._order, delta, CAT[category], label))

    def task(self, gpu: int, start_s: float, template: Template, task_label: str) -> None:
        self._order += 1
        self._templated[gpu].append((start_s, self._order, template, task_label))

    def analyse(self, gpu: int, capacity: int) -> GpuMemory:
        singles = self._single[gpu]
        parts_t = [np.array([e[0] for e in singles], dtype=float)]
        parts_o = [np.array([e[1] for e in singles], dtype=float)]
        parts_d = [np.array([e[2] for e in singles], dtype=np.int64)]
        parts_c = [np.array([e[3] for e in singles], dtype=np.int64)]
        for start, order, tpl, _label in self._templated[gpu]:
            k = len(tpl.deltas)
            parts_t.append(start + tpl.offsets_s)
            parts_o.append(order + np.arange(k) / (k + 1))  # keep template order among equal times
            parts_d.append(tpl.deltas)
            parts_c.append(tpl.cats)
        t = np.concatenate(parts_t)
        o = np.concatenate(parts_o)
        d = np.concatenate(parts_d)
        c = np.concatenate(parts_c)
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

    def _label_at(self, gpu: int, flat_index: int) -> str:
        """The label of the event at position ``flat_index`` of the unsorted concatenation."""
        singles = self._single[gpu]
        if flat_index < len(singles):
            return singles[flat_index][4]
        flat_index -= len(singles)
        for _start, _order, tpl, task_label in self._templated[gpu]:
            if flat_index < len(tpl.deltas):
                return f"{task_label} {tpl.labels[flat_index]}"
            flat_index -= len(tpl.deltas)
        return "?"


class LiveMemory:
    """Bytes in use per GPU as the run goes, and the frees under way (swap-outs in flight)."""

    def __init__(self, env: simpy.Environment, n_gpus: int, capacity_bytes: int) -> None:
        self.env = env
        self.capacity = capacity_bytes
        self.used = [0] * n_gpus
        self.freeing = [0] * n_gpus
        self._landed = [env.event() for _ in range(n_gpus)]

    def wait_for_room(self, gpu: int, n_bytes: int) -> Generator[simpy.Event, object, float]:
        """Wait while ``n_bytes`` do not fit and a free is under way; return seconds waited."""
        start = self.env.now
        while self.used[gpu] + n_bytes > self.capacity and self.freeing[gpu]:
            yield self._landed[gpu]
        return self.env.now - start

    def changed(self, gpu: int) -> simpy.Event:
        """An event that fires at the next free that lands (or ``poke``) on ``gpu``."""
        return self._landed[gpu]

    def poke(self, gpu: int) -> None:
        """Wake whoever waits on ``gpu`` without a change in bytes (a stream reached a point)."""
        landed, self._landed[gpu] = self._landed[gpu], self.env.event()
        landed.succeed()

    def free_landed(self, gpu: int, n_bytes: int) -> None:
        """A free that was under way has happened: wake whoever waits for room."""
        self.used[gpu] -= n_bytes
        self.freeing[gpu] -= 1
        landed, self._landed[gpu] = self._landed[gpu], self.env.event()
        landed.succeed()
