"""The one entry point that runs a job's strategy (``mpsim.plans.strategies``) through the cache."""

from __future__ import annotations

from collections.abc import Collection

from mpsim.planners.best import Part, plan_best
from mpsim.planners.cache import cached_plan, cached_verdict, job_key, known_plan
from mpsim.planners.context import Ctx, Planned, make_context
from mpsim.plans.job import JobSpec
from mpsim.plans.strategies import STRATEGIES, combines, strategy_named

__all__ = ["STRATEGIES", "combines", "made_plan", "plan_fits", "plan_job", "run_planner", "strategy_named"]


def run_planner(strategy: str, ctx: Ctx) -> Planned:
    """Run a named planner on a job, remembering its answer by content (``cache``)."""
    return cached_plan(strategy, ctx, strategy_named(strategy).planner_fn())


def plan_job(job: JobSpec, known_not_fitting: Collection[Part] = ()) -> Planned:
    """Plan and simulate ``job`` with its strategy and partition. ``known_not_fitting``: with
    ``best``, (planner, partition) pairs it need not run (``plan_best``)."""
    strategy = strategy_named(job.strategy)
    ctx = make_context(job, strategy.keeps)
    if known_not_fitting and strategy.combines:
        # its own cache entry: with planners left out, a plan that does not fit may differ
        return cached_plan(f"best without {sorted(known_not_fitting)}", ctx,
                           lambda c: plan_best(c, known_not_fitting))
    return run_planner(strategy.name, ctx)


def plan_fits(job: JobSpec) -> bool:
    """Whether ``job``'s single strategy finds a plan that fits: from its plan when one was
    made, else by its existence check where it has one (``Strategy.exists``: it stops at
    the first plan that fits), else by planning. The same verdict as ``plan_job``."""
    strategy = strategy_named(job.strategy)
    ctx = make_context(job, strategy.keeps)
    made = known_plan(strategy.name, ctx)
    if made is not None:
        return made.result.fits
    exists = strategy.exists_fn()
    if exists is None:
        return run_planner(strategy.name, ctx).result.fits
    return cached_verdict(strategy.name, ctx, exists)


def made_plan(job: JobSpec) -> tuple[tuple[object, ...], Planned] | None:
    """The plan this process has made for ``job`` under its single strategy, with its cache
    key (``cache.job_key``, for ``cache.adopt_plan`` in another process); None when none was."""
    strategy = strategy_named(job.strategy)
    ctx = make_context(job, strategy.keeps)
    made = known_plan(strategy.name, ctx)
    return None if made is None else (job_key(strategy.name, ctx), made)
