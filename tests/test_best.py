"""The combined planner is never worse than a single one on the same job."""

import pytest

from mpsim.data.catalog import load_topology, load_trace
from mpsim.planners import plan_job
from mpsim.plans.job import JobSpec

SINGLE = ("none", "recompute", "cpu-swap", "d2d", "mpress", "tsplit")


@pytest.mark.parametrize("server,model,schedule,mb", [
    ("dgx1-v100", "gpt-15.4b", "1f1b", 2),
    ("a100-40gb-nvswitch", "bert-1.67b", "pipedream", 12),
])
def test_best_fits_what_any_single_fits_and_is_at_least_as_fast(server, model, schedule, mb):
    topo = load_topology(server)
    trace = load_trace(model).rescale(mb)
    best = plan_job(JobSpec(topo, trace, schedule, 16, strategy="best"))
    assert best.result.strategy.startswith("best (") and best.plan.strategy == best.result.strategy
    for partition in ("compute", "memory"):
        for s in SINGLE:
            single = plan_job(JobSpec(topo, trace, schedule, 16, partition=partition, strategy=s)).result
            if single.fits:
                assert best.result.fits
                assert best.result.samples_per_s >= single.samples_per_s, (s, partition)
    assert best.result.fits and all(g.peak_bytes <= g.capacity_bytes for g in best.result.gpus)


def test_planner_runs_counts_the_parts_best_tries():
    """The page's work bound counts best's planner runs from the registry: every part
    ``best`` may run under both partitions, one run for a single strategy."""
    from mpsim.planners.best import parts
    from mpsim.plans.strategies import planner_runs

    assert planner_runs("best") == len(parts()) == 20  # 16, and the two offload systems as a last resort
    assert planner_runs("mpress") == planner_runs("none") == 1
