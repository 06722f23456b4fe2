"""The named strategies and the one entry point that runs them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from mpsim.errors import MpsimError
from mpsim.planners.baselines import BASELINES
from mpsim.planners.context import Ctx, Planned, make_context
from mpsim.planners.mpress import MPRESS_STRATEGIES
from mpsim.planners.best import plan_best
from mpsim.planners.tsplit import plan_tsplit
from mpsim.topology import Topology
from mpsim.trace import Trace

STRATEGIES: dict[str, Callable[[Ctx], Planned]] = {**BASELINES, **MPRESS_STRATEGIES, "tsplit": plan_tsplit, "best": plan_best}

_CACHE: OrderedDict[tuple, Planned] = OrderedDict()
CACHE_SIZE = 512


def run_planner(strategy: str, ctx: Ctx) -> Planned:
    """Run a named planner on a job, remembering the last ``CACHE_SIZE`` answers in this
    process: ``best`` and ``fits`` ask for the same plans many times."""
    t = ctx.trace
    key = (strategy, ctx.partition, id(ctx.topo), ctx.topo.name, t.name, t.spec.params, t.n_layers, t.microbatch,
           ctx.schedule, ctx.microbatches, tuple(ctx.stages), tuple(ctx.gpus), ctx.record_link_rates)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    planned = STRATEGIES[strategy](ctx)
    _CACHE[key] = planned
    if len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return planned


def plan_job(strategy: str, topo: Topology, trace: Trace, schedule: str = "1f1b", microbatches: int = 16,
             n_stages: int | None = None, record_link_rates: bool = False, partition: str = "compute") -> Planned:
    """Plan and simulate ``trace`` on ``topo`` with a named strategy and partition
    (``record_link_rates``: the simulations keep every change of link rates, for Chrome-trace
    counters)."""
    planner = STRATEGIES.get(strategy)
    if planner is None:
        raise MpsimError(f"unknown strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    ctx = make_context(topo, trace, schedule, microbatches, n_stages, record_link_rates, partition,
                       recompute=strategy == "recompute")
    return run_planner(strategy, ctx)
