"""The combined planner (``--strategy best``, DESIGN "Planners: Combined").

Each single planner is run under both partitions (compute-balanced as PipeDream and
DAPPLE, memory-balanced as mCAP); MPress's includes the device-mapping search and a
per-tensor choice among host swap, recomputation and D2D swap, TSPLIT's adds splits.
Every candidate plan is simulated, and the fastest that fits on every GPU wins; when
none fits, the offload systems (ZeRO-Offload, ZeRO-Infinity: ``Strategy.best_fallback``)
are tried as a last resort, and the fastest of them that fits wins; when none of those
fits either, the plan of the others with the lowest highest per-GPU peak. So the combined planner is
never worse than any single one on the same job, by construction, and its plan names
the planner and partition that produced it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import replace

from mpsim.planners.cache import cached_plan
from mpsim.planners.context import Ctx, Planned, make_context
from mpsim.plans.job import PARTITIONS, partitions_of
from mpsim.plans.strategies import BEST_FALLBACK, IN_BEST, strategy_named

SINGLE = IN_BEST
"""The single planners ``best`` tries (``Strategy.in_best``), in the registry's order."""
FALLBACK = BEST_FALLBACK
"""The planners ``best`` asks only when none of ``SINGLE`` fits under any partition
(``Strategy.best_fallback``), after them."""


Part = tuple[str, str]
"""A single planner and the partition it runs under."""

KEEP_ALL = "none"
"""The planner that keeps everything: under a partition where it fits, ``combine`` asks no other."""


def plan_best(ctx: Ctx, known_not_fitting: Collection[Part] = ()) -> Planned:
    """The combined plan. ``known_not_fitting``: (planner, partition) pairs already known
    not to fit this job (``fits``'s search knows it from the single planners' searches);
    they are not run, so when nothing fits, the answer is the lowest peak of the rest."""
    return combine(lambda name, partition: plan_part(ctx, name, partition), known_not_fitting,
                   partitions_of(ctx.job.parallelism))


def plan_part(ctx: Ctx, name: str, partition: str) -> Planned:
    """One single planner's plan for the job of ``ctx`` under ``partition`` (cached)."""
    strategy = strategy_named(name)
    sub = make_context(ctx.job.but(partition=partition, strategy=name), strategy.keeps)
    return cached_plan(name, sub, strategy.planner_fn())


def parts(known_not_fitting: Collection[Part] = (), partitions: tuple[str, ...] = PARTITIONS) -> list[Part]:
    """Every (planner, partition) the combined plan may run, in its order (``partitions``:
    ``mpsim.plans.job.partitions_of`` the layout): ``SINGLE``'s, then ``FALLBACK``'s."""
    return [(name, partition) for names in (SINGLE, FALLBACK) for partition in partitions for name in names
            if (name, partition) not in known_not_fitting]


def combine(plan_of: Callable[[str, str], Planned], known_not_fitting: Collection[Part] = (),
            partitions: tuple[str, ...] = PARTITIONS) -> Planned:
    """The combined plan from ``plan_of(planner, partition)``, asked in ``parts`` order;
    under a partition where keeping everything fits, the rest are not asked (nothing to
    save: keeping everything is fastest), and the ``FALLBACK`` planners are asked only when
    nothing asked before fits. The fastest plan that fits wins, else the lowest highest
    peak of those not in ``FALLBACK``; ties go to the first asked. ``plan_of`` may look up plans made
    elsewhere (``fits`` runs the parts in parallel): the answer is the same."""
    tried: list[tuple[str, str, Planned]] = []
    kept_all: set[str] = set()
    for name, partition in parts(known_not_fitting, partitions):
        if partition in kept_all or (name in FALLBACK and any(t[2].result.fits for t in tried)):
            continue
        tried.append((name, partition, plan_of(name, partition)))
        if name == KEEP_ALL and tried[-1][2].result.fits:
            kept_all.add(partition)

    def key(t: tuple[str, str, Planned]) -> tuple:
        r = t[2].result
        return (0, -r.samples_per_s) if r.fits else (1, r.max_peak_bytes)

    fitting_or_main = [t for t in tried if t[2].result.fits or t[0] not in FALLBACK]
    name, partition, best = min(fitting_or_main or tried, key=key)
    label = label_of((name, partition))
    plan = best.plan.model_copy(update={"strategy": label})
    result = replace(best.result, strategy=label)
    return Planned(plan, result, sum(t[2].simulations for t in tried))


def label_of(part: Part) -> str:
    """The combined plan's strategy label when ``part`` made it: ``best (mpress, compute partition)``."""
    return f"best ({part[0]}, {part[1]} partition)"


_LABEL = re.compile(r"best \((?P<name>[\w-]+), (?P<partition>\w+) partition\)")


def part_of(label: str) -> Part | None:
    """The part that made a combined plan, from its label (``label_of``); None for another label."""
    m = _LABEL.fullmatch(label)
    return (m["name"], m["partition"]) if m else None

