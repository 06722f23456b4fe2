"""Memory-saving actions on tiny hand-built traces: exact timelines and memory.

One GPU, PCIe 10 GB/s, no latency unless a test says so, GPipe with one microbatch, so
every time below can be worked out by hand.
"""

from __future__ import annotations

import pytest
from helpers import GB, layer, tiny_topology, tiny_trace

from mpsim.data.catalog import load_topology
from mpsim.errors import SchemaError
from mpsim.plans.plan import LayerAction, Stripe, check_plan, make_plan, stripes_by_bandwidth
from mpsim.sim import simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.sim.transfers import Copy, copy_times


def run(layers: list[dict], actions: list[LayerAction], n_gpus: int = 1, pcie_gbps: float = 10.0,
        latency_us: float = 0.0, nvlink_gbps: float = 10.0, optimizer: str = "gpu",
        optimizer_layers: list[int] | None = None):
    topo = tiny_topology(n_gpus=n_gpus, pcie_gbps=pcie_gbps, latency_us=latency_us, nvlink_gbps=nvlink_gbps,
                         memory_mib=64 * 1024)
    trace = tiny_trace(layers)
    plan = make_plan(trace, topo, "gpipe", 1, [(0, trace.n_layers)], [0], "test", {0: actions},
                     optimizer={0: optimizer}, optimizer_layers={0: optimizer_layers} if optimizer_layers else None)
    return simulate_job(job_of_plan(topo, trace, plan))


def steps(result, gpu: int = 0) -> list[tuple[float, int]]:
    """(time, bytes in use) after each change of this GPU's memory, zero-byte events and
    ledger entries left out, and simultaneous allocations at one instant merged."""
    g = result.gpus[gpu]
    out: list[tuple[float, int]] = []
    prev = 0
    for t, used in zip(g.memory_times_s, g.memory_used_bytes):
        t, used = round(float(t), 9), int(used)
        if used == prev:
            continue
        if out and out[-1][0] == t and (used - prev > 0) == (out[-1][1] - (out[-2][1] if len(out) > 1 else 0) > 0):
            out[-1] = (t, used)
        else:
            out.append((t, used))
        prev = used
    return out


def spans(result, lane: str) -> list[tuple[str, float, float]]:
    return [(s.name, round(s.start_s, 9), round(s.end_s, 9)) for s in result.spans if s.lane == lane]


def test_swap_out_frees_memory_when_the_copy_lands():
    """1 GB over a 10 GB/s route: freed 0.1 s (+ latency) after the forward."""
    for latency_us in (0.0, 50.0):
        r = run([layer(fwd_ms=10, bwd_ms=20, act=GB)], [LayerAction(layer=0, action="host")], latency_us=latency_us)
        lat = latency_us * 1e-6
        out_end = 0.01 + lat + 0.1
        assert spans(r, "d2h") == [("swap-out L0 mb0", 0.01, round(out_end, 9))]
        in_end = round(out_end + lat + 0.1, 9)
        assert steps(r) == [(0.0, GB), (round(out_end, 9), 0), (round(out_end, 9), GB), (round(in_end + 0.02, 9), 0)]
        # the swap-in cannot start before the swap-out lands; the backward waits for it
        assert spans(r, "h2d") == [("swap-in L0 mb0", round(out_end, 9), round(out_end + lat + 0.1, 9))]
        assert r.gpus[0].costs_s["swap_wait_s"] == pytest.approx(out_end + lat + 0.1 - 0.01)
        assert r.host_peak_bytes == GB  # pinned host memory counted


def test_swap_in_with_slack_adds_no_wait_and_without_adds_exactly_the_shortfall():
    # slack: layer 1's forward (0.5 s) and backward (0.3 s) hide the 0.1 s copies
    slow = [layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=500, bwd_ms=300)]
    r = run(slow, [LayerAction(layer=0, action="host")])
    assert r.gpus[0].costs_s["swap_wait_s"] == 0.0
    # the swap-in is timed to land exactly when the backward reaches layer 0 (0.51 + 0.3)
    assert spans(r, "h2d") == [("swap-in L0 mb0", 0.71, 0.81)]
    assert r.iteration_s == pytest.approx(0.81 + 0.02)
    # no slack: needed at 0.06 + 0.03 = 0.09, but it can only land at 0.11 + 0.1
    fast = [layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=50, bwd_ms=30)]
    r = run(fast, [LayerAction(layer=0, action="host")])
    assert r.gpus[0].costs_s["swap_wait_s"] == pytest.approx(0.21 - 0.09)
    assert r.iteration_s == pytest.approx(0.21 + 0.02)


def test_on_demand_swaps_put_both_copies_on_the_critical_path():
    """The GPU-CPU swap baseline (plan swap_timing on-demand): the forward of layer b waits
    for layer a's 0.1 s swap-out, and the swap-in starts only when the backward reaches a,
    so the slack that hid both copies under prefetching (0.83 s) no longer helps."""
    topo = tiny_topology(n_gpus=1, pcie_gbps=10.0, latency_us=0.0, memory_mib=64 * 1024)
    trace = tiny_trace([layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=500, bwd_ms=300)])
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test", {0: [LayerAction(layer=0, action="host")]},
                     swap_timing="on-demand")
    r = simulate_job(job_of_plan(topo, trace, plan))
    assert spans(r, "d2h") == [("swap-out L0 mb0", 0.01, 0.11)]
    assert spans(r, "h2d") == [("swap-in L0 mb0", 0.91, 1.01)]  # 0.11 + 0.5 + 0.3: the backward reaches a
    assert r.gpus[0].costs_s["swap_wait_s"] == pytest.approx(0.2)
    assert r.iteration_s == pytest.approx(1.01 + 0.02)


def test_on_demand_swaps_of_split_layers_are_refused():
    topo = tiny_topology(n_gpus=1, memory_mib=64 * 1024)
    trace = tiny_trace([dict(layer("a", fwd_ms=10, bwd_ms=20, act=GB), split_dims=["batch"]),
                        layer("b", fwd_ms=10, bwd_ms=20)])
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test",
                     {0: [LayerAction(layer=0, action="host", split=2)]}, swap_timing="on-demand")
    with pytest.raises(SchemaError, match="on-demand swaps move whole layers"):
        check_plan(plan, topo, trace)


def test_recompute_adds_the_forward_on_the_compute_stream_and_nothing_on_copy_engines():
    layers = [layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=50, bwd_ms=30)]
    keep = run(layers, [])
    r = run(layers, [LayerAction(layer=0, action="recompute")])
    assert r.iteration_s == pytest.approx(keep.iteration_s + 0.01)
    assert r.gpus[0].costs_s["recompute_s"] == pytest.approx(0.01)
    assert not [s for s in r.spans if s.lane != "compute"]
    # own activations: dropped after layer a's forward, back for the recompute 0.09..0.10
    assert steps(r) == [(0.0, GB), (0.01, 0), (0.09, GB), (0.12, 0)]
    assert steps(keep) == [(0.0, GB), (0.11, 0)]


def test_a_recompute_segment_keeps_one_checkpoint_and_re_runs_together():
    """Three layers of 1 GB saved activations, each passing 0.25 GB on, all recomputed.
    Every layer keeping its input (``layer``): the peak is one layer's activations beside
    the checkpoints. One segment (``segment``, Chen et al. 2016): after the forward
    nothing is held; at 0.03 the three forwards re-run in order (0.03-0.06), each output
    kept as the next one's input, so the backward starts with all three layers' 3 GB and
    the two 0.25 GB outputs (3.75 GB with c's recomputed output, freed at 0.06), and each
    backward frees its layer. Same time either way: each forward once more."""
    q = GB // 4
    layers = [layer("a", fwd_ms=10, bwd_ms=20, act=GB, out=q), layer("b", fwd_ms=10, bwd_ms=20, act=GB, inp=q, out=q),
              layer("c", fwd_ms=10, bwd_ms=20, act=GB, inp=q, out=q)]
    topo = tiny_topology(n_gpus=1, memory_mib=64 * 1024)
    trace = tiny_trace(layers)
    runs = {}
    for mode in ("layer", "segment"):
        plan = make_plan(trace, topo, "gpipe", 1, [(0, 3)], [0], "test",
                         {0: [LayerAction(layer=j, action="recompute") for j in range(3)]}, recompute_checkpoints=mode)
        runs[mode] = simulate_job(job_of_plan(topo, trace, plan))
    seg = runs["segment"]
    assert steps(seg) == [(0.0, GB + q), (0.01, q), (0.01, GB + 2 * q), (0.02, q), (0.02, GB + 2 * q), (0.03, 0),
                          (0.03, GB + q), (0.04, 2 * GB + 2 * q), (0.05, 3 * GB + 3 * q), (0.06, 3 * GB + 2 * q),
                          (0.06, 3 * GB + 3 * q), (0.08, 2 * GB + 2 * q), (0.08, 2 * GB + 3 * q), (0.1, GB + q),
                          (0.12, 0)]
    assert seg.gpus[0].peak_bytes == 3 * GB + 3 * q and runs["layer"].gpus[0].peak_bytes == GB + 3 * q
    # at the peak the segment holds the two outputs a kept run would have freed
    assert seg.gpus[0].saved_at_peak["recompute"] == -2 * q
    for r in runs.values():
        assert r.iteration_s == pytest.approx(0.12) and r.gpus[0].costs_s["recompute_s"] == pytest.approx(0.03)


def test_layers_recomputed_apart_are_segments_of_their_own():
    """a and c recomputed, b kept: no two consecutive recomputed layers, so segments change nothing."""
    q = GB // 4
    layers = [layer("a", fwd_ms=10, bwd_ms=20, act=GB, out=q), layer("b", fwd_ms=10, bwd_ms=20, act=GB, inp=q, out=q),
              layer("c", fwd_ms=10, bwd_ms=20, act=GB, inp=q, out=q)]
    topo = tiny_topology(n_gpus=1, memory_mib=64 * 1024)
    trace = tiny_trace(layers)
    acts = {0: [LayerAction(layer=0, action="recompute"), LayerAction(layer=2, action="recompute")]}
    got = [steps(simulate_job(job_of_plan(topo, trace, make_plan(trace, topo, "gpipe", 1, [(0, 3)], [0], "test", acts,
                                                              recompute_checkpoints=mode))))
           for mode in ("layer", "segment")]
    assert got[0] == got[1]


def test_two_gpus_behind_one_switch_swapping_together_take_twice_as_long():
    topo = tiny_topology(n_gpus=2, pcie_gbps=10.0)
    alone = copy_times(topo, [Copy(0, "host", GB)]).landed_s
    both = copy_times(topo, [Copy(0, "host", GB), Copy(1, "host", GB)]).landed_s
    assert alone == [pytest.approx(0.1)]
    assert both == [pytest.approx(0.2), pytest.approx(0.2)]


def test_striped_copy_on_dgx1_gives_gpu3_twice_the_bytes_of_gpu1():
    topo = load_topology("dgx1-v100")
    stripes = stripes_by_bandwidth(topo, 0, [1, 3])
    assert [x.gpu for x in stripes] == [1, 3]
    assert stripes[1].fraction == pytest.approx(2 * stripes[0].fraction)
    n = 3 * 10**8
    times = copy_times(topo, [Copy(0, x.gpu, round(n * x.fraction)) for x in stripes])
    assert times.bytes_by_link["nvlink:0->3"] == 2 * times.bytes_by_link["nvlink:0->1"]
    assert times.landed_s[0] == pytest.approx(times.landed_s[1])  # parts land together


def test_d2d_swap_reserves_memory_on_the_peer_until_the_swap_in_lands():
    layers = [layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=500, bwd_ms=300)]
    r = run(layers, [LayerAction(layer=0, action="peer", peers=[Stripe(gpu=1, fraction=1.0)])], n_gpus=2)
    assert steps(r, gpu=1) == [(0.01, GB), (0.81, 0)]  # held from swap-out start to swap-in landing
    assert r.gpus[1].breakdown["peer_swap"] == GB
    assert steps(r)[:2] == [(0.0, GB), (0.11, 0)]
    assert r.gpus[0].saved_at_peak == {"recompute": 0, "selective": 0, "host": 0, "peer": 0, "split": 0,
                                       "optimizer": 0, "stash": 0}
    assert r.gpus[0].costs_s["peer_wait_s"] == 0.0
    assert spans(r, "copy") == [("D2D swap-out L0 mb0", 0.01, 0.11), ("D2D swap-in L0 mb0", 0.71, 0.81)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_split_lowers_the_transient_peak_by_tsplit_equation_5(p):
    inp, out = 4 * GB, 2 * GB
    row = layer(fwd_ms=10, bwd_ms=20, inp=inp, out=out)
    row["split_dims"] = ["batch"]
    whole = run([row], [])
    split = run([row], [LayerAction(layer=0, split=p)])
    assert whole.max_peak_bytes == inp + out
    # (p - 1) / p x min(in, out), to the byte that integer micro-tensor sizes allow
    assert whole.max_peak_bytes - split.max_peak_bytes == pytest.approx((p - 1) * min(inp, out) / p, abs=p)
    assert split.gpus[0].costs_s["split_s"] == pytest.approx(0.03 * (p - 1) * 0.03)
    assert split.gpus[0].saved_at_peak["split"] == whole.max_peak_bytes - split.max_peak_bytes


def test_memory_saved_at_the_peak_is_credited_to_the_technique():
    layers = [layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=10, bwd_ms=20, act=2 * GB)]
    r = run(layers, [LayerAction(layer=0, action="recompute")])
    assert r.max_peak_bytes == 2 * GB
    assert r.gpus[0].saved_at_peak["recompute"] == GB


def test_optimizer_on_the_host_leaves_the_gpu_and_costs_pcie_time():
    layers = [layer("a", fwd_ms=10, bwd_ms=20, params=10**8)]  # 0.2 GB weights and grads, 1.2 GB states
    on_gpu = run(layers, [])
    streamed = run(layers, [], optimizer="host-stream")
    assert on_gpu.gpus[0].breakdown["optimizer"] == 12 * 10**8
    assert streamed.host_peak_bytes == 12 * 10**8
    assert streamed.gpus[0].costs_s["optimizer_s"] == pytest.approx(0.12)  # 1.2 GB in at 10 GB/s
    offloaded = run(layers, [], optimizer="host-update")
    assert offloaded.max_peak_bytes == 4 * 10**8
    # gradients out (0.02 s) + CPU Adam at 1e9 params/s (0.1 s) + weights in (0.02 s), instead of the GPU step
    assert offloaded.gpus[0].costs_s["optimizer_s"] == pytest.approx(0.14 - on_gpu.gpus[0].compute_s + 0.03)


def test_optimizer_layers_put_only_those_layers_states_on_the_host():
    """Two layers of 1e8 parameters (1.2 GB of states each); only layer 1's live on the
    host: the GPU keeps layer 0's, the host holds layer 1's, and only its copies cost time."""
    layers = [layer("a", fwd_ms=10, bwd_ms=20, params=10**8), layer("b", fwd_ms=10, bwd_ms=20, params=10**8)]
    on_gpu = run(layers, [])
    streamed = run(layers, [], optimizer="host-stream", optimizer_layers=[1])
    # before the first task: weights and gradients (0.8 GB) and layer 0's states only
    assert steps(on_gpu)[0] == (0.0, 32 * 10**8)
    assert steps(streamed)[0] == (0.0, 20 * 10**8)
    assert streamed.host_peak_bytes == 12 * 10**8
    assert streamed.gpus[0].costs_s["optimizer_s"] == pytest.approx(0.12)  # layer 1's 1.2 GB in at 10 GB/s
    updated = run(layers, [], optimizer="host-update", optimizer_layers=[1])
    gpu_update_s = on_gpu.gpus[0].compute_s - 0.06  # both layers' Adam step on the GPU
    # layer 1: gradients out (0.02 s) + CPU Adam (0.1 s) + weights in (0.02 s), instead of its GPU step
    assert updated.gpus[0].costs_s["optimizer_s"] == pytest.approx(0.14 - gpu_update_s / 2)
    assert updated.host_peak_bytes == 12 * 10**8


def test_an_allocation_that_does_not_fit_waits_for_a_swap_out_in_flight():
    """Capacity 1.5 GB: layer b's 1 GB cannot join layer a's 1 GB until a's swap-out lands
    (0.01 + 0.1 s); the forward waits exactly that long, and the job fits."""
    topo = tiny_topology(n_gpus=1, pcie_gbps=10.0, memory_mib=1.5 * GB / 2**20)
    trace = tiny_trace([layer("a", fwd_ms=10, bwd_ms=20, act=GB), layer("b", fwd_ms=10, bwd_ms=20, act=GB)])
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test", {0: [LayerAction(layer=0, action="host")]})
    r = simulate_job(job_of_plan(topo, trace, plan))
    assert r.fits
    assert r.gpus[0].costs_s["memory_wait_s"] == pytest.approx(0.1)
    assert steps(r)[:3] == [(0.0, GB), (0.11, 0), (0.11, GB)]
    # without the swap nothing is under way: no wait, and the result names the point
    keep = simulate_job(job_of_plan(topo, trace, make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "keep")))
    assert not keep.fits and keep.gpus[0].costs_s["memory_wait_s"] == 0.0
    assert keep.oom is not None
    assert keep.oom["task"].startswith("forward of microbatch 0 on stage 0: layer 1 (b) saved activations")


def test_pipedream_stash_on_host_moves_weight_versions_over_pcie():
    """Stage 0 of three keeps two stashed versions; on the host they leave the GPU and each
    backward first brings its own version back (0.2 GB at 10 GB/s), so the peak drops by
    one version."""
    topo = tiny_topology(n_gpus=3, pcie_gbps=10.0, memory_mib=64 * 1024)
    trace = tiny_trace([layer("a", fwd_ms=10, bwd_ms=20, params=10**8), layer("b", fwd_ms=10, bwd_ms=20),
                        layer("c", fwd_ms=10, bwd_ms=20)])
    stages, gpus = [(0, 1), (1, 2), (2, 3)], [0, 1, 2]
    on_gpu = simulate_job(job_of_plan(topo, trace, make_plan(trace, topo, "pipedream", 3, stages, gpus, "gpu")))
    on_host = simulate_job(job_of_plan(topo, trace, make_plan(trace, topo, "pipedream", 3, stages, gpus, "host",
                                                          stash={0: "host"})))
    assert on_gpu.gpus[0].breakdown["stash"] == 4 * 10**8
    assert on_host.gpus[0].peak_bytes == on_gpu.gpus[0].peak_bytes - 2 * 10**8
    assert on_host.host_peak_bytes >= 2 * 10**8
    ins = [s for s in on_host.spans if s.lane == "h2d"]
    assert len(ins) == 3 * 4  # one per microbatch of the four simulated iterations
    assert all(s.end_s - s.start_s == pytest.approx(0.02) for s in ins)
