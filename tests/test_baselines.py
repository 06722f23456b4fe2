"""The greedy rounds of the swap and recompute baselines stop once no round can make the plan fit."""

from helpers import layer, tiny_trace, topology_dict

from mpsim import load_topology, load_trace
from mpsim.hardware.topology import parse_topology
from mpsim.planners.context import make_context
from mpsim.planners.registry import run_planner
from mpsim.plans.job import JobSpec, pipeline

MB = 1024 * 1024


def _one_gpu(host_gib: float):
    d = topology_dict(n_gpus=1, memory_mib=1024, pcie_gbps=1.0)
    del d["nvlink"]
    d["host"]["memory_gib"] = host_gib
    return parse_topology(d, "tiny.yaml")


def _six_layers():
    return tiny_trace([layer(f"l{i}", act=400 * MB, out=1) for i in range(6)])


def test_host_swap_stops_at_the_first_plan_that_overflows_host_memory():
    """GPT at 301 layers (63B parameters) on the DGX-1: the first round's swaps overflow the
    768 GiB host while stages still overflow their GPUs; swapping more would only add to
    the host, so planning stops there instead of running twelve more rounds."""
    trace = load_trace("gpt-25.5b").with_layers(301)
    job = JobSpec(load_topology("dgx1-v100"), trace, "1f1b", 16, pipeline(8))
    planned = run_planner("host-swap", make_context(job))
    oom = planned.result.oom
    assert oom is not None and oom["gpu"] == "host"
    assert planned.result.max_peak_bytes > planned.result.gpus[0].capacity_bytes
    assert planned.simulations == 2


def test_host_swap_still_swaps_what_a_large_host_takes():
    ctx = make_context(JobSpec(_one_gpu(64), _six_layers(), "1f1b", 1, pipeline(1)))
    planned = run_planner("host-swap", ctx)
    assert planned.result.fits
    assert sum(a.action == "host" for a in planned.plan.stages[0].actions) >= 4
