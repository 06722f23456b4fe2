"""Schedules (task orders, in-flight bounds) and the exact compute-balanced partition."""

import itertools
import random

import numpy as np
import pytest

from mpsim.errors import MpsimError
from mpsim.partition import compute_balanced
from mpsim.schedule import PIPEDREAM_ITERATIONS, Task, stage_tasks


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
