"""The combined planner (``--strategy best``, DESIGN "Planners: Combined").

Each single planner is run under both partitions (compute-balanced as PipeDream and
DAPPLE, memory-balanced as mCAP); MPress's includes the device-mapping search and a
per-tensor choice among host swap, recomputation and D2D swap, TSPLIT's adds splits.
Every candidate plan is simulated, and the fastest that fits on every GPU wins; when
none fits, the one with the lowest highest per-GPU peak. So the combined planner is
never worse than any single one on the same job, by construction, and its plan names
the planner and partition that produced it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace

from mpsim.planners.baselines import BASELINES
from mpsim.planners.cache import cached_plan
from mpsim.planners.context import PARTITIONS, Ctx, Planned, make_context
from mpsim.planners.mpress import MPRESS_STRATEGIES
from mpsim.planners.tsplit import plan_tsplit

SINGLE = ("none", "recompute", "selective", "cpu-swap", "host-swap", "d2d", "mpress", "tsplit")
SINGLE_PLANNERS: dict[str, Callable[[Ctx], Planned]] = {**BASELINES, **MPRESS_STRATEGIES, "tsplit": plan_tsplit}


def plan_best(ctx: Ctx, known_not_fitting: Collection[tuple[str, str]] = ()) -> Planned:
    """The combined plan. ``known_not_fitting``: (planner, partition) pairs already known
    not to fit this job (``fits``'s search knows it from the single planners' searches);
    they are not run, so when nothing fits, the answer is the lowest peak of the rest."""
    n_stages = len(ctx.stages)
    tried: list[tuple[str, str, Planned]] = []
    for partition in PARTITIONS:
        for name in SINGLE:
            if (name, partition) in known_not_fitting:
                continue
            sub = make_context(ctx.topo, ctx.trace, ctx.schedule, ctx.microbatches, n_stages, ctx.record_link_rates,
                               partition, recompute=name == "recompute", selective=name == "selective")
            tried.append((name, partition, cached_plan(name, sub, SINGLE_PLANNERS[name])))
            if name == "none" and tried[-1][2].result.fits:
                break  # nothing to save: keeping everything is fastest

    def key(t: tuple[str, str, Planned]) -> tuple:
        r = t[2].result
        return (0, -r.samples_per_s) if r.fits else (1, r.max_peak_bytes)

    name, partition, best = min(tried, key=key)
    label = f"best ({name}, {partition} partition)"
    plan = best.plan.model_copy(update={"strategy": label})
    result = replace(best.result, strategy=label)
    return Planned(plan, result, sum(t[2].simulations for t in tried))
