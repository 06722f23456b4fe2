"""Per-GPU memory as a log of allocations and frees, analysed after the run.

In this release memory never changes timing: when a job does not fit, the run goes on as
if memory were unlimited so that each GPU's peak shows its demand. That lets a stage's
forward or backward register all its per-layer allocations at once from a precomputed
template (offsets within the task, byte deltas, categories) instead of one simulation
event per layer. After the run, the events of each GPU are ordered by (time, order of
registration), summed, and give the peak, the breakdown by category at the peak, the
memory-over-time series and the first point where a GPU exceeded its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "stash", "buffers", "workspace")
CAT = {name: i for i, name in enumerate(CATEGORIES)}


@dataclass(frozen=True)
class Template:
    """The memory events of one kind of task on one stage, relative to the task's start."""

    offsets_s: np.ndarray
    deltas: np.ndarray
    cats: np.ndarray
    labels: tuple[str, ...]
    """What each event is (layer and tensor), for naming the out-of-memory point."""


@dataclass
class GpuMemory:
    """Analysis of one GPU's log."""

    peak_bytes: int
    breakdown: dict[str, int]
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
        used = np.cumsum(d)
        if len(used) == 0:
            return GpuMemory(0, {k: 0 for k in CATEGORIES}, t, used, None)
        peak_pos = int(np.argmax(used))
        peak = int(used[peak_pos])
        at_peak = np.zeros(len(CATEGORIES), dtype=np.int64)
        np.add.at(at_peak, c[: peak_pos + 1], d[: peak_pos + 1])
        breakdown = {name: int(at_peak[i]) for i, name in enumerate(CATEGORIES)}
        oom = None
        over = np.nonzero(used > capacity)[0]
        if len(over):
            pos = int(over[0])
            oom = {
                "gpu": gpu,
                "time_s": float(t[pos]),
                "task": self._label_at(gpu, int(idx[pos])),
                "need_bytes": int(d[pos]),
                "free_bytes": int(capacity - (used[pos] - d[pos])),
            }
        return GpuMemory(peak, breakdown, t, used, oom)

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
