"""Schedules (task orders, in-flight bounds) and the exact compute-balanced partition."""

import itertools
import random

import numpy as np
import pytest

from mpsim.errors import MpsimError
from mpsim.plans.partition import compute_balanced
from mpsim.plans.schedule import PIPEDREAM_ITERATIONS, Task, stage_tasks


def max_in_flight(tasks):
    live = peak = 0
    for t in tasks:
        live += {"F": 1, "B": -1, "U": 0}[t.kind]
        peak = max(peak, live)
    return peak


def test_1f1b_stage0_order_for_4_stages_8_microbatches():
    f, b = (lambda k: Task("F", k)), (lambda k: Task("B", k))
    assert stage_tasks("1f1b", 0, 4, 8) == [f(0), f(1), f(2), f(3), b(0), f(4), b(1), f(5), b(2), f(6), b(3), f(7),
                                           b(4), b(5), b(6), b(7), Task("U", 7)]


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (8, 16), (3, 7)])
def test_1f1b_stage_i_holds_at_most_p_minus_i(p, m):
    for i in range(p):
        assert max_in_flight(stage_tasks("1f1b", i, p, m)) == p - i


@pytest.mark.parametrize("p,m", [(4, 4), (4, 9)])
def test_gpipe_holds_all_m(p, m):
    for i in range(p):
        assert max_in_flight(stage_tasks("gpipe", i, p, m)) == m


def test_pipedream_admits_p_minus_i_and_updates_after_every_backward():
    p, m = 4, 4
    for i in range(p):
        tasks = stage_tasks("pipedream", i, p, m)
        assert max_in_flight(tasks) == p - i
        assert sum(t.kind == "U" for t in tasks) == m * PIPEDREAM_ITERATIONS
        for k, t in enumerate(tasks):
            if t.kind == "B":
                assert tasks[k + 1] == Task("U", t.microbatch)


def test_every_microbatch_runs_forward_before_backward_once():
    for name in ("gpipe", "1f1b", "pipedream"):
        for i in range(4):
            tasks = stage_tasks(name, i, 4, 8)
            fw = [t.microbatch for t in tasks if t.kind == "F"]
            bw = [t.microbatch for t in tasks if t.kind == "B"]
            assert sorted(fw) == sorted(bw) == list(range(len(fw)))
            for k in fw:
                assert tasks.index(Task("F", k)) < tasks.index(Task("B", k))


def test_schedule_rejects_too_few_microbatches():
    with pytest.raises(MpsimError, match="at least as many microbatches as stages"):
        stage_tasks("1f1b", 0, 8, 4)
    assert stage_tasks("gpipe", 0, 8, 4)  # GPipe can run with fewer


def brute_force(cost, p):
    n = len(cost)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(cost[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_compute_balanced_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 10)
        p = rng.randint(1, n)
        cost = [rng.choice([0.5, 1.0, 2.0, 3.0, 7.0]) * rng.random() for _ in range(n)]
        stages = compute_balanced(np.array(cost), p)
        assert len(stages) == p
        assert stages[0][0] == 0 and stages[-1][1] == n
        assert all(a < b for a, b in stages)
        assert all(stages[k][1] == stages[k + 1][0] for k in range(p - 1))
        got = max(sum(cost[a:b]) for a, b in stages)
        assert got == pytest.approx(brute_force(cost, p), rel=1e-12)


def test_compute_balanced_known_case():
    assert compute_balanced(np.array([1, 1, 1, 1, 4.0]), 2) == [(0, 4), (4, 5)]
    assert compute_balanced(np.array([3, 1, 1, 1, 1, 1.0]), 3) == [(0, 1), (1, 3), (3, 6)]


def test_compute_balanced_rejects_more_stages_than_layers():
    with pytest.raises(MpsimError, match="cannot split 3 layers into 4"):
        compute_balanced(np.ones(3), 4)


# --- Linear-memory partitioning: identical to the quadratic tables it replaced ---------------
# The functions below are the partitioner as it was before memory became linear in the layers:
# whole (n + 1) x (n + 1) tables, one vectorised argmin per stage. The new code must return the
# very same stages on every input, ties included.

from unittest.mock import patch  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mpsim.plans import partition  # noqa: E402
from mpsim.plans.partition import PeakCost, SpanCost, min_max_partition, stage_peak_table  # noqa: E402


def quadratic_min_max_partition(tables):
    n_stages = len(tables)
    n = tables[0].shape[0] - 1
    inf = np.inf
    j_idx, i_idx = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    best = np.full((n_stages, n + 1), inf)
    cut = np.zeros((n_stages, n + 1), dtype=int)
    best[0, 1:] = tables[0][1:, 0]
    for k in range(1, n_stages):
        cand = np.maximum(best[k - 1][None, :], tables[k])
        cand[(i_idx < k) | (i_idx >= j_idx)] = inf
        cut[k] = np.argmin(cand, axis=1)
        best[k] = cand[np.arange(n + 1), cut[k]]
    stages = []
    end = n
    for k in range(n_stages - 1, 0, -1):
        start = int(cut[k, end])
        stages.append((start, end))
        end = start
    stages.append((0, end))
    return stages[::-1]


def quadratic_compute_balanced(layer_cost, n_stages):
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(layer_cost, dtype=float))))
    span = prefix[:, None] - prefix[None, :]
    return quadratic_min_max_partition([span] * n_stages)


def quadratic_range_max(values):
    n = len(values)
    m = np.zeros((n + 1, n + 1))
    for i in range(n):
        m[i, i + 1:] = np.maximum.accumulate(values[i:])
    return m


def quadratic_stage_peak_table(added, transient, boundary_in, boundary_out):
    prefix = np.concatenate(([0.0], np.cumsum(added)))
    span = prefix[:, None] - prefix[None, :]
    return span + quadratic_range_max(transient).T + boundary_in[None, :] + boundary_out[:, None]


# Few distinct values, zeros among them, so that ties are everywhere; fractions that do not add exactly.
_COSTS = st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.0, 3.0, 0.1, 0.2, 0.3, 1e-17, 7.5, 1e6])
_SIGNED = st.sampled_from([0.0, 1.0, 2.0, -1.0, 0.1, -0.3, 5.0])


@st.composite
def _cost_and_stages(draw, values=_COSTS, max_layers=24):
    cost = draw(st.lists(values, min_size=1, max_size=max_layers))
    return np.array(cost), draw(st.integers(1, len(cost)))


@settings(max_examples=400, deadline=None)
@given(_cost_and_stages())
def test_compute_balanced_equals_the_quadratic_table(case):
    cost, p = case
    assert compute_balanced(cost, p) == quadratic_compute_balanced(cost, p)


@settings(max_examples=200, deadline=None)
@given(_cost_and_stages(values=_SIGNED), st.integers(1, 40))
def test_general_min_max_equals_the_quadratic_table_with_negative_costs(case, block):
    """Negative costs take the general, blocked programme (small blocks: many per stage)."""
    cost, p = case
    with patch.object(partition, "BLOCK_ELEMENTS", block):
        assert compute_balanced(cost, p) == quadratic_compute_balanced(cost, p)


@settings(max_examples=200, deadline=None)
@given(_cost_and_stages(), st.integers(1, 40))
def test_blocked_span_programme_equals_the_bisection_and_the_table(case, block):
    cost, p = case
    prefix = np.concatenate(([0.0], np.cumsum(cost)))
    with patch.object(partition, "BLOCK_ELEMENTS", block):
        assert min_max_partition([SpanCost(prefix)] * p) == quadratic_compute_balanced(cost, p)


@st.composite
def _peak_case(draw):
    n = draw(st.integers(1, 16))
    p = draw(st.integers(1, n))
    small = st.sampled_from([0.0, 0.0, 1.0, 2.0, 3.0, 0.5, 0.1, 8.0])

    def vec(size):
        return np.array(draw(st.lists(small, min_size=size, max_size=size)))

    base, per_mb, transient = vec(n), vec(n), vec(n)
    b_in, b_out = vec(n + 1), vec(n + 1)
    return [(base + (p - k) * per_mb, transient, b_in, b_out) for k in range(p)]


@settings(max_examples=300, deadline=None)
@given(_peak_case(), st.integers(1, 40))
def test_memory_balanced_partition_equals_the_quadratic_table(stages, block):
    old_tables = [quadratic_stage_peak_table(*s) for s in stages]
    for new, old in zip((stage_peak_table(*s) for s in stages), old_tables):
        assert np.array_equal(new, old)
    with patch.object(partition, "BLOCK_ELEMENTS", block):
        assert min_max_partition([PeakCost(*s) for s in stages]) == quadratic_min_max_partition(old_tables)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.data())
def test_dense_tables_with_infinities_and_nans_partition_as_before(n, data):
    """Whole tables as given (the old interface): infinite and NaN costs pick the same cuts."""
    p = data.draw(st.integers(1, n))
    cell = st.sampled_from([0.0, 1.0, 1.0, 2.0, np.inf, np.nan, -1.0])
    tables = [np.array(data.draw(st.lists(cell, min_size=(n + 1) ** 2, max_size=(n + 1) ** 2))).reshape(n + 1, n + 1)
              for _ in range(p)]
    block = data.draw(st.integers(1, 30))
    with patch.object(partition, "BLOCK_ELEMENTS", block):
        assert min_max_partition(tables) == quadratic_min_max_partition(tables)


def test_memory_balanced_partition_of_a_traced_model_is_unchanged():
    from mpsim.data.catalog import load_trace
    from mpsim.planners.mcap import mcap_partition, peak_tables

    trace = load_trace("bert-0.64b").rescale(8)
    for schedule, recompute in [("pipedream", False), ("gpipe", True), ("1f1b", False)]:
        tables = peak_tables(trace, schedule, 8, 16, recompute)
        expected = quadratic_min_max_partition(tables)
        with patch.object(partition, "BLOCK_ELEMENTS", 100):
            assert mcap_partition(trace, schedule, 8, 16, recompute) == expected
        assert mcap_partition(trace, schedule, 8, 16, recompute) == expected
