"""The named strategies and the one entry point that runs them."""

from __future__ import annotations

from collections.abc import Callable

from mpsim.errors import MpsimError
from mpsim.planners.best import SINGLE_PLANNERS, plan_best
from mpsim.planners.cache import cached_plan
from mpsim.planners.context import Ctx, Planned, make_context
from mpsim.topology import Topology
from mpsim.trace import Trace

STRATEGIES: dict[str, Callable[[Ctx], Planned]] = {**SINGLE_PLANNERS, "best": plan_best}


def run_planner(strategy: str, ctx: Ctx) -> Planned:
    """Run a named planner on a job, remembering its answer by content (``cache``)."""
    return cached_plan(strategy, ctx, STRATEGIES[strategy])


def plan_job(strategy: str, topo: Topology, trace: Trace, schedule: str = "1f1b", microbatches: int = 16,
             n_stages: int | None = None, record_link_rates: bool = False, partition: str = "compute",
             known_not_fitting: frozenset[tuple[str, str]] = frozenset()) -> Planned:
    """Plan and simulate ``trace`` on ``topo`` with a named strategy and partition
    (``record_link_rates``: the simulations keep every change of link rates, for Chrome-trace
    counters). ``known_not_fitting``: with ``best``, (planner, partition) pairs it need not
    run (``plan_best``)."""
    planner = STRATEGIES.get(strategy)
    if planner is None:
        raise MpsimError(f"unknown strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    ctx = make_context(topo, trace, schedule, microbatches, n_stages, record_link_rates, partition,
                       recompute=strategy in ("recompute", "recompute-segments", "recompute-all"),
                       selective=strategy == "selective")
    if known_not_fitting and strategy == "best":
        # its own cache entry: with planners left out, a plan that does not fit may differ
        return cached_plan(f"best without {sorted(known_not_fitting)}", ctx,
                           lambda c: plan_best(c, known_not_fitting))
    return run_planner(strategy, ctx)
