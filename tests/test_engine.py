"""The engine on tiny hand-built jobs: exact timelines, memory oracles, out-of-memory point."""

import json

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim import simulate
from mpsim.plans.job import JobSpec
from mpsim.sim import Job, simulate_job

MS = 1e-3


def spans(result):
    return sorted((s.gpu, s.lane, s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in result.spans)


def test_two_stage_1f1b_timeline_is_exact():
    # 1 GB/s link, no latency: a 500 kB activation or gradient takes 0.5 ms.
    topo = tiny_topology(n_gpus=2, nvlink_gbps=1.0)
    trace = tiny_trace([layer("l0", 1.0, 2.0, out=500_000, kind="embedding"),
                        layer("l1", 1.0, 2.0, inp=500_000, out=4)])
    r = simulate_job(Job(JobSpec(topo, trace, "1f1b", 2)))
    assert spans(r) == sorted([
        (0, "compute", "F0", 0.0, 1.0), (0, "compute", "F1", 1.0, 2.0),
        (0, "copy", "activation mb0 -> gpu1", 1.0, 1.5), (0, "copy", "activation mb1 -> gpu1", 2.0, 2.5),
        (1, "compute", "F0", 1.5, 2.5), (1, "compute", "B0", 2.5, 4.5),
        (1, "copy", "gradient mb0 -> gpu0", 4.5, 5.0),
        (1, "compute", "F1", 4.5, 5.5), (1, "compute", "B1", 5.5, 7.5),
        (1, "copy", "gradient mb1 -> gpu0", 7.5, 8.0), (1, "compute", "U1", 7.5, 7.5),
        (0, "compute", "B0", 5.0, 7.0), (0, "compute", "B1", 8.0, 10.0), (0, "compute", "U1", 10.0, 10.0),
    ])
    assert r.iteration_s == pytest.approx(10 * MS)
    assert r.samples_per_s == pytest.approx(2 / (10 * MS))


def test_latency_delays_each_boundary_transfer():
    topo = tiny_topology(n_gpus=2, nvlink_gbps=1.0, latency_us=100.0)
    trace = tiny_trace([layer("l0", 1.0, 2.0, out=500_000, kind="embedding"),
                        layer("l1", 1.0, 2.0, inp=500_000, out=4)])
    r = simulate_job(Job(JobSpec(topo, trace, "gpipe", 1)))
    # F0 [0,1], send [1, 1.6], F0' [1.6, 2.6], B0' [2.6, 4.6], send back [4.6, 5.2], B0 [5.2, 7.2]
    assert r.iteration_s == pytest.approx(7.2 * MS)


def per_stage_trace(p, act, params=0):
    return tiny_trace([layer(f"l{i}", 1.0, 2.0, act=act, params=params) for i in range(p)])


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8)])
def test_1f1b_stage_i_peaks_at_p_minus_i_microbatches_of_activations(p, m):
    A = 1000
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=p), per_stage_trace(p, A), "1f1b", m)))
    assert [g.breakdown["activations"] for g in r.gpus] == [(p - i) * A for i in range(p)]


def test_gpipe_holds_every_microbatch():
    p, m, A = 3, 5, 1000
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=p), per_stage_trace(p, A), "gpipe", m)))
    assert [g.peak_bytes for g in r.gpus] == [m * A] * p


def test_pipedream_keeps_p_minus_i_weight_versions():
    p, P = 4, 1000  # params per stage; working weights are 2 bytes each
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=p), per_stage_trace(p, 0, params=P), "pipedream", 4)))
    for i, g in enumerate(r.gpus):
        assert g.breakdown["params"] == 2 * P
        assert g.breakdown["stash"] == (p - i - 1) * 2 * P


def test_memory_returns_to_static_after_a_synchronous_iteration():
    r = simulate("dgx1-v100", "gpt-5.3b", "1f1b", 2, 16)
    for g in r.gpus:
        static = g.breakdown["params"] + g.breakdown["grads"] + g.breakdown["optimizer"]
        assert g.memory_used_bytes[-1] == static


def test_workspace_and_output_count_in_the_peak_of_a_single_layer():
    topo = tiny_topology(n_gpus=1)
    trace = tiny_trace([layer("only", 1.0, 2.0, act=300, out=50, inp=20, saves_input=True, workspace=70,
                              kind="head")])
    r = simulate_job(Job(JobSpec(topo, trace, "gpipe", 1)))
    # input tokens 20 + own activations 280 + output 50 + workspace 70
    assert r.gpus[0].peak_bytes == 20 + 280 + 50 + 70


def test_first_out_of_memory_point_is_named():
    # 1 MiB per GPU; each microbatch keeps 400 kB on each stage; GPipe with 4 microbatches
    # overflows stage 0 when the third forward starts at 2 ms.
    topo = tiny_topology(n_gpus=2, memory_mib=1.0)
    trace = tiny_trace([layer("a", 1.0, 2.0, act=400_000), layer("b", 1.0, 2.0, act=400_000)])
    r = simulate_job(Job(JobSpec(topo, trace, "gpipe", 4)))
    assert not r.fits
    assert r.oom == {"gpu": 0, "time_s": pytest.approx(2 * MS), "need_bytes": 400_000, "free_bytes": 1048576 - 800_000,
                     "task": "forward of microbatch 2 on stage 0: layer 0 (a) saved activations"}
    # the run went on as if memory were unlimited, so the peaks show the demand
    assert [g.peak_bytes for g in r.gpus] == [1_600_000, 1_600_000]


def test_1f1b_fits_where_gpipe_does_not():
    topo = tiny_topology(n_gpus=2, memory_mib=1.0)
    trace = tiny_trace([layer("a", 1.0, 2.0, act=400_000), layer("b", 1.0, 2.0, act=400_000)])
    assert simulate_job(Job(JobSpec(topo, trace, "1f1b", 4))).fits


@pytest.mark.parametrize("schedule,model,mb", [("1f1b", "gpt-5.3b", 2), ("gpipe", "gpt-10.3b", 2),
                                                ("pipedream", "bert-0.35b", 12)])
def test_iteration_never_below_busiest_gpu_compute(schedule, model, mb):
    r = simulate("dgx1-v100", model, schedule, mb, 16)
    assert r.iteration_s >= max(g.compute_s for g in r.gpus) * (1 - 1e-12)


def test_same_inputs_give_identical_json():
    a = simulate("dgx1-v100", "gpt-10.3b", "1f1b", 2, 16).to_dict()
    b = simulate("dgx1-v100", "gpt-10.3b", "1f1b", 2, 16).to_dict()
    assert json.dumps(a) == json.dumps(b)


def test_gpt_5_3b_per_stage_memory_is_close_to_mpress_table_ii():
    # MPress Table II, GPT-5.3B with DAPPLE on the DGX-1: max 28.5 GB, min 12.7 GB per stage.
    # With CUDA's 1-byte dropout masks our stage 0 holds 27.0 GB, 5% under the table (the
    # shape is ours, fitted to the parameter count only; see traces/README.md).
    r = simulate("dgx1-v100", "gpt-5.3b", "1f1b", 2, 16)
    peaks_gb = [g.peak_bytes / 1e9 for g in r.gpus]
    assert max(peaks_gb) == pytest.approx(28.5, rel=0.08)
    assert min(peaks_gb) == pytest.approx(12.7, rel=0.15)
    assert r.fits


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_iteration_is_the_textbook_makespan(schedule):
    # p equal stages, free transfers: (m + p - 1)(f + b), so the bubble is (p - 1)/(m + p - 1).
    p, m = 4, 8
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=p), per_stage_trace(p, 0), schedule, m)))
    assert r.iteration_s == pytest.approx((m + p - 1) * 3 * MS)
    busy = max(g.compute_s for g in r.gpus)
    assert 1 - busy / r.iteration_s == pytest.approx((p - 1) / (m + p - 1))


def test_pipedream_steady_state_has_no_bubble():
    # Asynchronous 1F1B with equal stages keeps every GPU busy once the pipeline is full.
    p, m = 4, 8
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=p), per_stage_trace(p, 0), "pipedream", m)))
    assert r.iteration_s == pytest.approx(m * 3 * MS)


def copy_spans(result, gpu):
    return sorted((s.start_s, s.end_s) for s in result.spans if s.gpu == gpu and s.lane == "copy")


@pytest.mark.parametrize("engines", [1, 2])
def test_peer_copy_engines_bound_concurrent_sends(engines):
    # Stage 1 of 3 sends activations forward and gradients back; with slow links the two
    # overlap when it has two engines and queue when it has one.
    from helpers import topology_dict

    from mpsim.hardware.topology import parse_topology

    d = topology_dict(n_gpus=3, nvlink_gbps=0.0003)
    d["gpu"]["peer_copy_engines"] = engines
    topo = parse_topology(d, "tiny.yaml")
    trace = tiny_trace([layer(f"l{i}", 1.0, 1.0, inp=1000, out=1000) for i in range(3)])
    r = simulate_job(Job(JobSpec(topo, trace, "1f1b", 6)))
    sends = copy_spans(r, 1)
    overlaps = sum(1 for (a0, a1), (b0, b1) in zip(sends, sends[1:]) if b0 < a1 - 1e-12)
    assert (overlaps == 0) if engines == 1 else (overlaps > 0)


def test_progress_reporting_counts_every_task_of_every_run():
    from mpsim.sim.progress import reporting

    topo = tiny_topology(n_gpus=2)
    trace = tiny_trace([layer("l0", 1.0, 2.0, out=10, kind="embedding"), layer("l1", 1.0, 2.0, inp=10)])
    seen = []
    with reporting(lambda: seen.append(1)):
        simulate_job(Job(JobSpec(topo, trace, "1f1b", 3)))
        simulate_job(Job(JobSpec(topo, trace, "gpipe", 2)))
    assert len(seen) == 2 * (3 + 3 + 1) + 2 * (2 + 2 + 1)  # per stage m forwards, m backwards, one update
    simulate_job(Job(JobSpec(topo, trace, "gpipe", 2)))
    assert len(seen) == 24  # outside the block nothing is reported


def test_a_finished_swap_heavy_run_is_freed_by_reference_counting():
    """What a run builds holds no reference cycles (beyond a handful): the engine runs
    with the cyclic collector paused until the run's objects are freed
    (``simpy_fast.gc_paused``), which only pays if they are freed without it."""
    import gc

    from mpsim import load_topology, load_trace
    from mpsim.plans.partition import compute_balanced
    from mpsim.plans.plan import LayerAction, make_plan
    from mpsim.sim.layout import job_of_plan
    from mpsim.timing.costs import cost_model

    topo = load_topology("dgx1-v100")
    trace = load_trace("gpt-25.5b").rescale(2)
    times = cost_model(trace, topo.spec.gpu).layer_times
    stages = compute_balanced(times.fwd_s + times.bwd_s, topo.n_gpus)
    actions = {s: [LayerAction(layer=j, action="host" if k % 2 == 0 else "recompute")
                   for k, j in enumerate(j for j in range(a, b) if trace.layers[j].kind == "transformer")]
               for s, (a, b) in enumerate(stages)}
    plan = make_plan(trace, topo, "1f1b", 8, list(stages), list(range(topo.n_gpus)), "swaps", actions)
    job = job_of_plan(topo, trace, plan)
    simulate_job(job)  # caches filled
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        result = simulate_job(job)
        assert gc.collect() < 50
    finally:
        if was:
            gc.enable()
    assert result.sim_events > 0
