"""Planner answers remembered per process, keyed by content: ``best`` and ``fits`` ask for
the same plans many times."""

from __future__ import annotations

from collections.abc import Callable

from mpsim.caches import Lru
from mpsim.planners.context import Ctx, Planned

CACHE_SIZE = 512
_CACHE: Lru[tuple[object, ...], Planned] = Lru(CACHE_SIZE)


def job_key(strategy: str, ctx: Ctx) -> tuple[object, ...]:
    """What a planner's answer depends on: the server's and the trace's contents (hashes,
    so two different traces with one name never share an answer) and the job, its runtime
    profile and the expert load included (they change the times and bytes a planner weighs)."""
    return (strategy, ctx.partition, ctx.topo.content_hash, ctx.trace.content_hash, ctx.schedule, ctx.microbatches,
            tuple(ctx.stages), tuple(ctx.gpus), ctx.record_link_rates, ctx.job.parallelism, ctx.job.runtime_profile,
            ctx.job.expert_load)


_VERDICTS: Lru[tuple[object, ...], bool] = Lru(CACHE_SIZE)


def known_plan(strategy: str, ctx: Ctx) -> Planned | None:
    """The answer already made for the same content, if any."""
    return _CACHE.get(job_key(strategy, ctx))


def adopt_plan(key: tuple[object, ...], planned: Planned) -> None:
    """Remember ``planned`` as the answer for ``key`` (``job_key``), made in another process
    (``mpsim.studies.capacity`` hands ``best`` the single searches' largest plans)."""
    _CACHE.put(key, planned)


def cached_verdict(strategy: str, ctx: Ctx, exists: Callable[[Ctx], bool]) -> bool:
    """``exists(ctx)`` (whether the planner finds a plan that fits), or the verdict given
    before for the same content."""
    return _VERDICTS.remember(job_key(strategy, ctx), lambda: exists(ctx))


def cached_plan(strategy: str, ctx: Ctx, planner: Callable[[Ctx], Planned]) -> Planned:
    """``planner(ctx)``, or the answer it gave before for the same content."""
    return _CACHE.remember(job_key(strategy, ctx), lambda: planner(ctx))
