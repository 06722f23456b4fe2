"""Layers to pipeline stages.

``compute_balanced`` is the partition PipeDream's and DAPPLE's planners aim for: contiguous
stages whose largest compute time is as small as possible. It is solved exactly as the
classic min-max linear partition problem by dynamic programming over prefix sums:
best[k][j] = min_i max(best[k-1][i], S[j] - S[i]), the earliest i among ties.

Memory is linear in the number of layers n: a stage's cost of every layer range (an
(n + 1) x (n + 1) table) is never held whole. ``min_max_partition`` takes each stage's
cost as a ``StageCost`` and asks it for a block of rows at a time (``BLOCK_ELEMENTS``
entries), keeping best[k - 1] and, per stage, the cut of every prefix (O(p n)). Its time is
O(p n^2), vectorised by block: 100 layers over 16 stages in milliseconds, 10,000 layers
over 8 stages in seconds. Compute time never falls when a stage gains a layer, so
``compute_balanced`` does better for non-negative costs: best[k - 1] rises with i and the
last stage's cost falls, so the minimum sits where they cross, found by bisection for every
j at once in O(p n log n), with the very same arithmetic and tie-break as the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from mpsim.errors import MpsimError

PARTITIONS: tuple[str, ...] = ("compute", "memory")
"""``compute``: stages balance compute time (PipeDream, DAPPLE); ``memory``: they balance
the predicted per-GPU peak (mCAP)."""


def check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise MpsimError(f"unknown partition {partition!r}: expected one of {', '.join(PARTITIONS)}")


Stages = list[tuple[int, int]]
"""Per stage, the half-open layer range [start, end)."""

BLOCK_ELEMENTS = 1 << 20
"""Cost-table entries one block of the dynamic programme holds (8 MiB of float64)."""


class StageCost(Protocol):
    """A stage's cost of every layer range, ``cost[j, i]`` for layers [i, j), a block of rows at a time."""

    @property
    def n_layers(self) -> int: ...

    def block(self, j0: int, j1: int, width: int) -> np.ndarray:
        """``cost[j, i]`` for j in [j0, j1) and i in [0, width), shape (j1 - j0, width);
        any value where i >= j (no such stage)."""
        ...


class DenseCost:
    """A stage cost given as its whole (n + 1) x (n + 1) table (small cases, brute-force checks)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    @property
    def n_layers(self) -> int:
        return int(self.table.shape[0]) - 1

    def block(self, j0: int, j1: int, width: int) -> np.ndarray:
        return self.table[j0:j1, :width]


class SpanCost:
    """The summed cost of layers [i, j): prefix[j] - prefix[i] (compute time)."""

    def __init__(self, prefix: np.ndarray) -> None:
        self.prefix = prefix

    @property
    def n_layers(self) -> int:
        return len(self.prefix) - 1

    def block(self, j0: int, j1: int, width: int) -> np.ndarray:
        return self.prefix[j0:j1, None] - self.prefix[None, :width]


def range_max_block(values: np.ndarray, j0: int, j1: int, width: int) -> np.ndarray:
    """m[j - j0, i] = max(values[i:j]) for i < j, 0 where i >= j; j in [j0, j1), i in [0, width)."""
    out = np.zeros((j1 - j0, width))
    left = min(width, j0)
    if left:  # starts before the block: the maximum up to j0, then on to j
        to_j0 = np.maximum.accumulate(values[:j0][::-1])[::-1][:left]
        from_j0 = np.concatenate(([-np.inf], np.maximum.accumulate(values[j0:j1 - 1])))
        out[:, :left] = np.maximum(from_j0[:, None], to_j0[None, :])
    for i in range(left, min(width, j1)):  # starts inside the block
        out[i - j0 + 1:, i] = np.maximum.accumulate(values[i:j1 - 1])
    return out


class PeakCost:
    """The predicted peak of a stage holding layers [i, j) (mCAP 3.3, listing 1.1: the first
    layer's mem_isolated plus the others' mem_added): ``added[l]`` is what layer l holds for
    the whole iteration on this stage, ``transient[l]`` what it holds only while it runs (so
    a stage pays the largest one), ``boundary_in[i]`` / ``boundary_out[j]`` the receive and
    send buffers of a stage starting at layer i / ending before layer j."""

    def __init__(self, added: np.ndarray, transient: np.ndarray, boundary_in: np.ndarray,
                 boundary_out: np.ndarray) -> None:
        self.prefix = np.concatenate(([0.0], np.cumsum(added)))
        self.transient, self.boundary_in, self.boundary_out = transient, boundary_in, boundary_out

    @property
    def n_layers(self) -> int:
        return len(self.prefix) - 1

    def block(self, j0: int, j1: int, width: int) -> np.ndarray:
        peak = self.prefix[j0:j1, None] - self.prefix[None, :width]
        peak += range_max_block(self.transient, j0, j1, width)
        peak += self.boundary_in[None, :width]
        peak += self.boundary_out[j0:j1, None]
        return peak


def stage_peak_table(added: np.ndarray, transient: np.ndarray, boundary_in: np.ndarray,
                     boundary_out: np.ndarray) -> np.ndarray:
    """``PeakCost``'s whole table, peak[j, i] (quadratic memory: for small cases and checks)."""
    cost = PeakCost(added, transient, boundary_in, boundary_out)
    return cost.block(0, cost.n_layers + 1, cost.n_layers + 1)


def compute_balanced(layer_cost: np.ndarray, n_stages: int) -> Stages:
    """Contiguous, non-empty stages minimising the largest stage cost (exact).

    Among optimal partitions the one whose earlier stages end earliest is returned, so the
    result is deterministic.
    """
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    cost = np.asarray(layer_cost, dtype=float)
    prefix = np.concatenate(([0.0], np.cumsum(cost)))
    if np.all(cost >= 0) and np.isfinite(prefix).all() and n_stages <= len(cost):
        return _monotone_partition(prefix, n_stages)
    return min_max_partition([SpanCost(prefix)] * n_stages)


def validate_stages(stages: Stages, n_layers: int) -> None:
    """A partition must cover every layer once, in order, with no empty stage."""
    pos = 0
    for s, (start, end) in enumerate(stages):
        if start != pos or end <= start:
            raise MpsimError(f"partition stage {s} is [{start}, {end}); "
                             f"expected it to start at layer {pos} and be non-empty")
        pos = end
    if pos != n_layers:
        raise MpsimError(f"partition covers layers [0, {pos}) but the model has {n_layers} layers")


def min_max_partition(tables: Sequence[np.ndarray | StageCost]) -> Stages:
    """Contiguous, non-empty stages minimising the highest stage cost (exact), where stage
    k's cost of layers [i, j) is ``tables[k][j, i]``: compute time for ``compute_balanced``
    (every stage alike), the predicted peak for mCAP's memory-balanced partition. Each is a
    ``StageCost``, or a whole table (an array).

    A stage's peak depends on its layer range and its position (how many microbatches it
    holds, how many weight versions), so each stage has its own cost:
    best[k][j] = min_i max(best[k-1][i], tables[k][j, i]), best[k][j] the lowest bottleneck
    putting layers [0, j) on k + 1 stages; among optimal partitions the one whose earlier
    stages end earliest. mCAP (3.4) searches the same space by brute force or Bayesian
    optimisation.
    """
    costs = [DenseCost(t) if isinstance(t, np.ndarray) else t for t in tables]
    n_stages = len(costs)
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    n = costs[0].n_layers
    if n_stages > n:
        raise MpsimError(f"cannot split {n} layers into {n_stages} non-empty stages: use at most {n} stages")
    cut = np.zeros((n_stages, n + 1), dtype=np.int32)
    best = np.full(n + 1, np.inf)
    best[1:] = costs[0].block(1, n + 1, 1)[:, 0]
    for k in range(1, n_stages):
        best = _min_max_stage(costs[k], best, k, cut[k])
    return _trace_back(cut)


def _min_max_stage(cost: StageCost, prev: np.ndarray, k: int, cut: np.ndarray) -> np.ndarray:
    """best[k] from best[k - 1] (``prev``), the cut of every prefix written to ``cut``:
    rows of max(prev[i], cost[j, i]) a block at a time, the first minimum over k <= i < j."""
    n = len(prev) - 1
    best = np.full(n + 1, np.inf)
    rows = max(1, BLOCK_ELEMENTS // (n + 1))
    for j0 in range(k + 1, n + 1, rows):
        j1 = min(j0 + rows, n + 1)
        cand = np.maximum(prev[None, :j1], cost.block(j0, j1, j1))
        cand[:, :k] = np.inf  # the last stage starts at i >= k
        inside = cand[:, j0:]
        inside[np.triu(np.ones(inside.shape, dtype=bool))] = np.inf  # and is non-empty: i < j
        first = np.argmin(cand, axis=1)
        value = cand[np.arange(j1 - j0), first]
        first[value == np.inf] = 0  # no finite choice: the whole row's first minimum, at i = 0
        cut[j0:j1] = first
        best[j0:j1] = value
    return best


def _trace_back(cut: np.ndarray) -> Stages:
    stages: Stages = []
    end = cut.shape[1] - 1
    for k in range(cut.shape[0] - 1, 0, -1):
        start = int(cut[k, end])
        stages.append((start, end))
        end = start
    stages.append((0, end))
    return stages[::-1]


def _monotone_partition(prefix: np.ndarray, n_stages: int) -> Stages:
    """``min_max_partition([SpanCost(prefix)] * n_stages)`` for a non-decreasing, finite
    ``prefix`` (non-negative costs), in O(p n log n) time: see ``_monotone_stage``."""
    n = len(prefix) - 1
    cut = np.zeros((n_stages, n + 1), dtype=np.int32)
    best = np.full(n + 1, np.inf)
    best[1:] = prefix[1:] - prefix[0]
    for k in range(1, n_stages):
        best = _monotone_stage(prefix, best, k, cut[k])
    return _trace_back(cut)


def _monotone_stage(prefix: np.ndarray, prev: np.ndarray, k: int, cut: np.ndarray) -> np.ndarray:
    """``_min_max_stage`` for the span cost of non-negative layers. For a prefix [0, j),
    f(i) = max(prev[i], c(i)) over k <= i < j with c(i) = S[j] - S[i]: prev rises with i
    (putting more layers on k stages never lowers their bottleneck, rounding being
    monotone) and c falls. Before the first i where prev[i] >= c(i) (``split``), f = c,
    falling to c(split - 1), first reached at the first i with c(i) <= c(split - 1); from
    ``split`` on, f = prev, lowest at ``split``. The earlier wins a tie, as the table's
    first minimum does."""
    n = len(prefix) - 1
    j = np.arange(k + 1, n + 1)
    end = prefix[j]
    split = _first_true(lambda i: prev[i] >= end - prefix[i], np.full(len(j), k), j)
    before = np.maximum(split - 1, k)
    falling = end - prefix[before]  # c(split - 1)
    take_before = (split > k) & ((split == j) | (falling <= prev[split]))
    earliest = _first_true(lambda i: end - prefix[i] <= falling, np.full(len(j), k), before)
    first = np.where(take_before, earliest, split)
    cut[k + 1:] = first
    best = np.full(n + 1, np.inf)
    best[k + 1:] = np.maximum(prev[first], end - prefix[first])
    return best


def _first_true(holds: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per lane, the first i in [lo, hi) where ``holds`` (false then true along i), else hi;
    ``holds`` is asked about indices up to hi."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        yes = holds(mid)
        hi = np.where(open_ & yes, mid, hi)
        lo = np.where(open_ & ~yes, mid + 1, lo)


def highest_peak(tables: list[np.ndarray], stages: Stages) -> float:
    """The highest predicted stage peak of a partition."""
    return max(float(tables[k][b, a]) for k, (a, b) in enumerate(stages))


def brute_force(tables: list[np.ndarray]) -> tuple[Stages, float]:
    """mCAP-BF (3.4): every one of the C(L-1, G-1) partitions, the lowest highest peak.
    For checking ``min_max_partition`` on cases small enough to enumerate."""
    from itertools import combinations

    n_stages, n = len(tables), tables[0].shape[0] - 1
    best: tuple[Stages, float] | None = None
    for cuts in combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        stages = [(bounds[k], bounds[k + 1]) for k in range(n_stages)]
        peak = highest_peak(tables, stages)
        if best is None or peak < best[1]:
            best = (stages, peak)
    assert best is not None
    return best
