"""The closed-form tier (``mpsim.studies.bounds``): its floors are on the right side of the
simulator's answer, its static figure is the engine's, and the searches that use it give
the same answers as simulating every candidate."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from mpsim.errors import MpsimError
from mpsim.planners.registry import plan_job
from mpsim.plans.job import JobSpec
from mpsim.plans.layouts import candidate_layouts, on_layout, parse_layout
from mpsim.plans.strategies import STRATEGIES as STRATEGIES_BY_NAME
from mpsim.studies import bounds
from mpsim.studies.bounds import floors
from mpsim.studies.capacity import family_job, family_traces, fits_job
from mpsim.studies.choose import choose

STRATEGIES = ("none", "recompute", "selective", "cpu-swap", "d2d", "mpress", "tsplit", "zero-offload", "best")
SETTINGS = (("dgx1-v100", "gpt", "1f1b"), ("a100-40gb-nvswitch", "bert", "gpipe"), ("dgx-h100", "gpt", "1f1b"),
            ("titanrtx-x4-pcie", "gpt", "gpipe"))


def _random_jobs(seed: int, n: int) -> list[JobSpec]:
    """``n`` jobs drawn from the shipped families at one, two and three times their
    depth, over the layouts ``choose`` searches, every strategy and both partitions."""
    rng = random.Random(seed)
    jobs: list[JobSpec] = []
    while len(jobs) < n:
        server, family, schedule = rng.choice(SETTINGS)
        traces = family_traces(family)
        base = family_job(server, traces, schedule, 2, 16, "none", "compute")
        layout = rng.choice(candidate_layouts(base.topology, "pipeline,data,3d", schedule, base.trace))
        trace = rng.choice(traces)
        depth = rng.choice((1, 2, 3))
        if depth > 1:
            trace = trace.with_layers(depth * sum(1 for r in trace.layers if r.kind == "transformer"))
        try:
            job = on_layout(base, layout, 16).but(trace=trace.rescale(2), strategy=rng.choice(STRATEGIES),
                                                 partition=rng.choice(("compute", "memory")))
        except MpsimError:  # heads that do not split over the layout's tensor degree
            continue
        jobs.append(job)
    return jobs


@pytest.mark.parametrize("job", _random_jobs(7, 24), ids=lambda j: f"{j.topology.name}-{j.layout_name}-{j.strategy}")
def test_the_floors_are_never_above_the_simulated_answer(job):
    f = floors(job)
    r = plan_job(job).result
    if f.cannot_fit():
        assert not r.fits
    assert f.iteration_floor_s is not None and f.iteration_floor_s <= r.iteration_s * (1 + 1e-12)
    assert f.max_samples_per_s(job.samples_per_iteration) >= r.samples_per_s * (1 - 1e-12)


def test_the_static_figure_is_adams_model_states_plus_pipedreams_stashed_weights():
    """1F1B: each stage's weights, gradients and optimizer states; PipeDream adds p - s - 1
    stashed weight versions on stage s of p (PipeDream section 3.3, weight stashing)."""
    traces = family_traces("gpt")
    job = family_job("dgx1-v100", traces, "1f1b", 2, 16, "none", "compute").but(trace=traces[1].rescale(2))
    rows = job.trace.layers
    stages = plan_job(job).result.stages
    one_f_one_b = floors(job).static_bytes
    assert one_f_one_b == tuple(sum(r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in rows[a:b])
                                for a, b in stages)
    pipedream = floors(job.but(schedule="pipedream")).static_bytes
    p = len(stages)
    assert pipedream == tuple(one_f_one_b[s] + (p - s - 1) * sum(r.param_bytes for r in rows[a:b])
                              for s, (a, b) in enumerate(stages))


def test_a_model_whose_weights_and_gradients_exceed_the_gpus_is_decided_without_simulating():
    traces = family_traces("gpt")
    job = family_job("dgx1-v100", traces, "1f1b", 2, 16, "mpress", "compute")
    big = job.but(trace=traces[-1].with_layers(580).rescale(2))
    # 580 layers of GPT-25.5B's shape: 102 B parameters, 4 bytes each of weights and gradients over 8 GPUs
    assert floors(big).cannot_fit() == "weights and gradients alone need 47.99 GiB per GPU of 31.46"
    assert not plan_job(big).result.fits
    offloaded = floors(big.but(strategy="zero-offload"))  # ZeRO-Offload may keep gradients off the GPU
    assert offloaded.resident_floor_bytes == 0
    assert offloaded.cannot_fit() == ""  # 1,536 GiB of model states, room for 2,820 with the NVMe drives
    assert replace(offloaded, room_bytes=offloaded.states_bytes - 1).cannot_fit() == (
        "model states of 1536 GiB exceed all GPU, host and NVMe memory (1536 GiB)")


def test_the_time_floor_of_one_stage_is_the_microbatches_times_forward_and_backward():
    traces = family_traces("gpt")
    job = family_job("h100-x1", traces, "gpipe", 1, 4, "none", "compute")
    from mpsim.timing.costs import cost_model

    times = cost_model(job.trace, job.topology.spec.gpu).layer_times
    assert floors(job).iteration_floor_s == pytest.approx(4 * (sum(times.fwd_s) + sum(times.bwd_s)), rel=1e-12)
    assert floors(job.but(schedule="pipedream")).iteration_floor_s is None


def _standing(report) -> list[tuple]:
    return [(r.server, r.rank, r.result.strategy, r.result.layout, r.result.fits, r.result.samples_per_s,
             r.result.max_peak_bytes, None if r.faster_at_risk is None else
             (r.faster_at_risk.strategy, r.faster_at_risk.layout, r.faster_at_risk.samples_per_s)) for r in report.rows]


def test_choose_with_the_floors_gives_the_same_answer_as_simulating_every_plan():
    servers = ["dgx-h100", "dgx-a100-80gb", "titanrtx-x4-pcie"]
    with bounds.without_floors():
        every = choose("llama-3-8b", servers)
    tiered = choose("llama-3-8b", servers)
    assert _standing(tiered) == _standing(every)
    decided = {r.server: r.decided_by_floors for r in tiered.rows}
    assert sum(decided.values()) > 0 and all(r.decided_by_floors == 0 for r in every.rows)
    for a, b in zip(tiered.rows, every.rows):
        assert len(a.tried) + a.decided_by_floors == len(b.tried)


@pytest.mark.parametrize("strategy", ["none", "recompute", "cpu-swap", "best"])
def test_the_largest_size_search_with_the_floors_finds_what_simulating_every_size_finds(strategy):
    traces = family_traces("gpt")[:2]
    job = family_job("titanrtx-x4-pcie", traces, "gpipe", 2, 8, strategy, "compute")
    with bounds.without_floors():
        every = fits_job(job, "gpt", traces)
    tiered = fits_job(job, "gpt", traces)
    assert tiered.largest is not None and every.largest is not None
    assert (tiered.largest.layers, tiered.largest.result.samples_per_s) == \
        (every.largest.layers, every.largest.result.samples_per_s)
    assert every.probes_decided == 0
    assert tiered.probes_simulated <= every.probes_simulated


@pytest.mark.parametrize("strategy", ["mpress", "mpress-no-mapping", "mpress-d2d-only"])
@pytest.mark.parametrize("layers", [290, 305])
def test_mpress_by_existence_gives_its_plans_verdict(strategy, layers):
    """Around the largest MPress fits on the DGX-1 (304 layers of GPT-25.5B's shape): the
    check that stops at the first plan that fits says what the whole planner says."""
    from mpsim.planners.registry import plan_fits

    traces = family_traces("gpt")
    job = family_job("dgx1-v100", traces, "1f1b", 2, 16, strategy, "compute")
    job = job.but(trace=traces[-1].with_layers(layers).rescale(2))
    assert plan_fits(job) == plan_job(job).result.fits


@pytest.mark.parametrize("name", [n for n, s in STRATEGIES_BY_NAME.items() if s.optimizer_on_gpu])
def test_a_strategy_said_to_keep_the_optimizer_states_on_the_gpu_never_moves_them(name):
    """``Strategy.optimizer_on_gpu`` lets the memory floor count the optimizer states: its
    plans must keep them on the GPU even where the job must save memory to fit (GPT-10.3B,
    15.4B and 25.5B on the DGX-1's pipeline and GPT-25.5B sharded by FSDP)."""
    traces = family_traces("gpt")
    base = family_job("dgx1-v100", traces, "1f1b", 2, 16, name, "compute")
    jobs = [base.but(trace=t.rescale(2)) for t in traces[1:]]
    jobs.append(on_layout(base, parse_layout("fsdp8"), 16).but(trace=traces[-1].rescale(2)))
    for job in jobs:
        plan = plan_job(job).plan
        assert all(st.optimizer == "gpu" for st in plan.stages), (job.layout_name, job.trace.name)
