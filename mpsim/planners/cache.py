"""Planner answers remembered per process, keyed by content: ``best`` and ``fits`` ask for
the same plans many times."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from mpsim.planners.context import Ctx, Planned

CACHE_SIZE = 512
T = TypeVar("T")
_CACHE: OrderedDict[tuple[object, ...], Planned] = OrderedDict()


def job_key(strategy: str, ctx: Ctx) -> tuple[object, ...]:
    """What a planner's answer depends on: the server's and the trace's contents (hashes,
    so two different traces with one name never share an answer) and the job."""
    return (strategy, ctx.partition, ctx.topo.content_hash, ctx.trace.content_hash, ctx.schedule, ctx.microbatches,
            tuple(ctx.stages), tuple(ctx.gpus), ctx.record_link_rates, ctx.job.parallelism)


_VERDICTS: OrderedDict[tuple[object, ...], bool] = OrderedDict()


def known_plan(strategy: str, ctx: Ctx) -> Planned | None:
    """The answer already made for the same content, if any."""
    return _CACHE.get(job_key(strategy, ctx))


def adopt_plan(key: tuple[object, ...], planned: Planned) -> None:
    """Remember ``planned`` as the answer for ``key`` (``job_key``), made in another process
    (``mpsim.studies.capacity`` hands ``best`` the single searches' largest plans)."""
    remembered(_CACHE, key, lambda: planned)


def cached_verdict(strategy: str, ctx: Ctx, exists: Callable[[Ctx], bool]) -> bool:
    """``exists(ctx)`` (whether the planner finds a plan that fits), or the verdict given
    before for the same content."""
    return remembered(_VERDICTS, job_key(strategy, ctx), lambda: exists(ctx))


def cached_plan(strategy: str, ctx: Ctx, planner: Callable[[Ctx], Planned]) -> Planned:
    """``planner(ctx)``, or the answer it gave before for the same content."""
    return remembered(_CACHE, job_key(strategy, ctx), lambda: planner(ctx))


def remembered(store: OrderedDict[tuple[object, ...], T], key: tuple[object, ...], make: Callable[[], T]) -> T:
    """``store[key]``, made by ``make()`` on first use; the least recently used entry is
    forgotten past ``CACHE_SIZE``."""
    if key in store:
        store.move_to_end(key)
        return store[key]
    value = store[key] = make()
    if len(store) > CACHE_SIZE:
        store.popitem(last=False)
    return value
