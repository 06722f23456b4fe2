"""Layers to pipeline stages.

``compute_balanced`` is the partition PipeDream's and DAPPLE's planners aim for: contiguous
stages whose largest compute time is as small as possible. It is solved exactly as the
classic min-max linear partition problem by dynamic programming over prefix sums:
best[k][j] = min_i max(best[k-1][i], S[j] - S[i]), O(p n^2) with each stage count's
(j, i) table vectorised, so 100 layers over 16 stages take a few milliseconds.
"""

from __future__ import annotations

import numpy as np

from mpsim.errors import MpsimError

Stages = list[tuple[int, int]]
"""Per stage, the half-open layer range [start, end)."""


def compute_balanced(layer_cost: np.ndarray, n_stages: int) -> Stages:
    """Contiguous, non-empty stages minimising the largest stage cost (exact).

    Among optimal partitions the one whose earlier stages end earliest is returned, so the
    result is deterministic.
    """
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(layer_cost, dtype=float))))
    span = prefix[:, None] - prefix[None, :]  # span[j, i]: cost of layers [i, j), whatever the stage
    return min_max_partition([span] * n_stages)


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


def _range_max(values: np.ndarray) -> np.ndarray:
    """m[i, j] = max(values[i:j]) for i < j (0 elsewhere), by a running maximum per start."""
    n = len(values)
    m = np.zeros((n + 1, n + 1))
    for i in range(n):
        m[i, i + 1:] = np.maximum.accumulate(values[i:])
    return m


def stage_peak_table(added: np.ndarray, transient: np.ndarray, boundary_in: np.ndarray,
                     boundary_out: np.ndarray) -> np.ndarray:
    """peak[j, i]: predicted peak of a stage holding layers [i, j) (mCAP 3.3, listing 1.1:
    the first layer's mem_isolated plus the others' mem_added). ``added[l]`` is what layer
    l holds for the whole iteration on this stage, ``transient[l]`` what it holds only while
    it runs (so a stage pays the largest one), ``boundary_in[i]`` / ``boundary_out[j]`` the
    receive and send buffers of a stage starting at layer i / ending before layer j."""
    prefix = np.concatenate(([0.0], np.cumsum(added)))
    span = prefix[:, None] - prefix[None, :]
    peak = span + _range_max(transient).T + boundary_in[None, :] + boundary_out[:, None]
    return peak


def min_max_partition(tables: list[np.ndarray]) -> Stages:
    """Contiguous, non-empty stages minimising the highest stage cost (exact), where stage
    k's cost of layers [i, j) is ``tables[k][j, i]``: compute time for ``compute_balanced``
    (every stage alike), the predicted peak for mCAP's memory-balanced partition.

    A stage's peak depends on its layer range and its position (how many microbatches it
    holds, how many weight versions), so each stage has its own table:
    best[k][j] = min_i max(best[k-1][i], tables[k][j, i]), best[k][j] the lowest bottleneck
    putting layers [0, j) on k + 1 stages; among optimal partitions the one whose earlier
    stages end earliest. mCAP (3.4) searches the same space by brute force or Bayesian
    optimisation.
    """
    n_stages = len(tables)
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    n = tables[0].shape[0] - 1
    if n_stages > n:
        raise MpsimError(f"cannot split {n} layers into {n_stages} non-empty stages: use at most {n} stages")
    inf = np.inf
    j_idx, i_idx = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    best = np.full((n_stages, n + 1), inf)
    cut = np.zeros((n_stages, n + 1), dtype=int)
    best[0, 1:] = tables[0][1:, 0]
    for k in range(1, n_stages):
        cand = np.maximum(best[k - 1][None, :], tables[k])
        cand[(i_idx < k) | (i_idx >= j_idx)] = inf  # the last stage starts at i >= k and is non-empty
        cut[k] = np.argmin(cand, axis=1)  # first minimum: the earliest cut among ties
        best[k] = cand[np.arange(n + 1), cut[k]]
    stages: Stages = []
    end = n
    for k in range(n_stages - 1, 0, -1):
        start = int(cut[k, end])
        stages.append((start, end))
        end = start
    stages.append((0, end))
    return stages[::-1]


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
