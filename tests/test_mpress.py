"""MPress planner: Table III's rule, the device-mapping search, and its plans simulated."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from mpsim.data.catalog import load_topology, load_trace
from mpsim.planners import plan_job
from mpsim.planners.mapping import is_symmetric, nvlink_bandwidth, search_mapping
from mpsim.planners.mpress import choose
from mpsim.plans.job import JobSpec, pipeline
from mpsim.timing.costs import cost_model

GiB = 2**30


@pytest.mark.parametrize("tensor,interval,recompute,host,d2d,expected", [
    ("t1", 78, 4, 42, 6, "host"),       # the interval hides the GPU-CPU swap
    ("t2", 16, 3, 22, 3, "peer"),       # D2D hides, recompute costs 3 ms, host swap 6 ms
    ("t3", 2, 4, 42, 6, "recompute"),   # recompute and D2D both cost 4 ms: keep the spare memory
    ("t4", 214, 8, 74, 9, "host"),
    ("t5", 50, 8, 74, 9, "peer"),
    ("t6", 12, 14, 222, 27, "recompute"),  # 14 ms against D2D's 15 ms
])
def test_table_iii_choices(tensor, interval, recompute, host, d2d, expected):
    """MPress Table III (ms) and the choices IV-D gives for each tensor."""
    assert choose(interval / 1e3, recompute / 1e3, host / 1e3, d2d / 1e3) == expected


def test_no_spare_memory_means_no_d2d():
    assert choose(0.016, 0.003, 0.022, None) == "recompute"
    assert choose(0.016, 0.009, 0.022, None) == "host"  # host's 6 ms beat recompute's 9 ms


def test_mapping_puts_the_heaviest_stage_next_to_spare_memory_over_double_links():
    """DGX-1: stage 0 must shed 20 GiB, stages 1-3 have none to spare, 4-7 have 8 GiB each.

    The best map puts stage 0 where its NVLink neighbours carry the spare stages and keeps
    every pair of consecutive stages on NVLink (stage i on GPU i crosses PCIe from 3 to 4)."""
    topo = load_topology("dgx1-v100")
    bw = nvlink_bandwidth(topo)
    demand = [20 * GiB, 0, 0, 0, 0, 0, 0, 0]
    spare = [0, 0, 0, 0, 8 * GiB, 8 * GiB, 8 * GiB, 8 * GiB]
    m = search_mapping(topo, demand, spare)
    assert m.searched == 40320
    assert m.pcie_boundaries == 0 and bw[3, 4] == 0
    assert m.uncovered_bytes == 0
    to_spare = sum(bw[m.gpus[0], g] for g in m.gpus[4:])
    # stage 0 on GPU 0 would reach the spare stages over GPU 4's two links only (45 GB/s);
    # the best map gives them three of its four neighbours (stage 1 needs one), leaving
    # stage 1 the single-link one: 2 + 2 + 1 links of 22.5 GB/s
    assert sum(bw[0, g] for g in range(4, 8)) == 45e9
    assert to_spare == 112.5e9
    assert m.d2d_s == pytest.approx(20 * GiB / to_spare, rel=1e-6)


def test_mapping_is_skipped_on_symmetric_servers():
    topo = load_topology("a100-40gb-nvswitch")
    assert is_symmetric(topo) and not is_symmetric(load_topology("dgx1-v100"))
    m = search_mapping(topo, [10 * GiB] + [0] * 7, [0] + [5 * GiB] * 7)
    assert m.gpus == tuple(range(8)) and m.searched == 1


def test_local_search_on_a_server_too_large_to_enumerate():
    """Ten GPUs in an NVLink chain (10! maps): pairwise swaps from the identity, which
    already keeps every pair of consecutive stages on NVLink and cannot be bettered here."""
    from helpers import tiny_topology

    topo = tiny_topology(n_gpus=10)
    assert not is_symmetric(topo)
    m = search_mapping(topo, [0] * 10, [GiB] * 10)
    assert m.gpus == tuple(range(10)) and m.pcie_boundaries == 0
    assert m.searched == 1 + 45  # the identity and its 45 pairwise swaps, once


@pytest.fixture(scope="module")
def gpt_15b():
    topo = load_topology("dgx1-v100")
    trace = load_trace("gpt-15.4b").rescale(2)
    strategies = ("recompute", "cpu-swap", "mpress", "mpress-no-striping")
    return {s: plan_job(JobSpec(topo, trace, "1f1b", 16, strategy=s)) for s in strategies}


def test_mpress_plan_fits_where_recompute_does_not_and_beats_cpu_swap(gpt_15b):
    mp = gpt_15b["mpress"].result
    assert not gpt_15b["recompute"].result.fits
    assert mp.fits and all(g.peak_bytes <= g.capacity_bytes for g in mp.gpus)
    assert mp.samples_per_s > gpt_15b["cpu-swap"].result.samples_per_s
    used = {x.action for st in gpt_15b["mpress"].plan.stages for x in st.actions}
    assert {"recompute", "host", "peer"} <= used  # all three techniques combined


def test_striping_follows_link_bandwidth_and_its_ablation_uses_one_peer(gpt_15b):
    topo = load_topology("dgx1-v100")
    for st in gpt_15b["mpress"].plan.stages:
        for x in st.actions:
            if x.action == "peer":
                bws = [topo.route(st.gpu, p.gpu).bandwidth for p in x.peers]
                for p, b in zip(x.peers, bws):
                    assert p.fraction == pytest.approx(b / sum(bws))
    peers = [x for st in gpt_15b["mpress-no-striping"].plan.stages for x in st.actions if x.action == "peer"]
    assert peers and all(len(x.peers) == 1 for x in peers)


def test_mpress_fits_gpt_25b_on_the_dgx1_faster_than_host_swap_where_recompute_does_not_fit():
    topo = load_topology("dgx1-v100")
    trace = load_trace("gpt-25.5b").rescale(2)
    mpress = plan_job(JobSpec(topo, trace, "1f1b", 16, strategy="mpress")).result
    swap = plan_job(JobSpec(topo, trace, "1f1b", 16, strategy="cpu-swap")).result
    assert mpress.fits and swap.fits  # host swap fits once a swap-in's room is reserved when granted
    assert mpress.samples_per_s > swap.samples_per_s
    assert not plan_job(JobSpec(topo, trace, "1f1b", 16, strategy="recompute")).result.fits


def test_end_slack_grows_by_one_stage_backward_per_stage_under_a_flush():
    """1F1B: stage s finishes its last backward one stage-backward after stage s+1, so
    stage s's wait for stage 0 is s stage-backwards; PipeDream has no flush and no wait."""
    from mpsim.planners.context import keep_first, make_context
    from mpsim.planners.liveness import end_slack

    topo, trace = load_topology("dgx1-v100"), load_trace("gpt-15.4b").rescale(2)
    ctx = make_context(JobSpec(topo, trace, "1f1b", 16, pipeline(None)))
    keep, _ = keep_first(ctx, "keep")
    slack = end_slack(keep.result, "1f1b")
    times = cost_model(trace, topo.spec.gpu).layer_times
    assert slack[0] == 0.0
    for s in range(1, 8):
        a, b = ctx.stages[s - 1]
        assert slack[s] - slack[s - 1] == pytest.approx(float(times.bwd_s[a:b].sum()), rel=0.05)
    assert end_slack(keep.result, "pipedream") == [0.0] * 8


def test_free_optimizer_streaming_makes_the_last_stage_an_importer(gpt_15b):
    """Table IV's pattern: GPU-CPU swap on the last stage costs nothing (it waits for
    stage 0 anyway), and the memory it frees takes D2D swaps of earlier stages."""
    stages = gpt_15b["mpress"].plan.stages
    last = stages[-1]
    assert last.optimizer == "host-stream"
    into_last = [x for st in stages[:-1] for x in st.actions if x.action == "peer"
                 and any(p.gpu == last.gpu for p in x.peers)]
    assert into_last


def test_mapping_and_striping_never_make_the_plan_slower(gpt_15b):
    """Each variant keeps the fastest plan it may make (Fig. 5's emulator feedback), so
    allowing the mapping search and striping cannot lose against the default."""
    topo = load_topology("dgx1-v100")
    trace = load_trace("gpt-15.4b").rescale(2)
    default = plan_job(JobSpec(topo, trace, "1f1b", 16, strategy="mpress-no-mapping-no-striping")).result
    mapped, striped = gpt_15b["mpress-no-striping"].result, gpt_15b["mpress"].result
    assert default.fits and mapped.fits and striped.fits
    assert default.iteration_s >= mapped.iteration_s >= striped.iteration_s


def test_fig9_default_plan_gains_at_most_a_few_percent_from_faster_peer_links():
    """Why our Fig. 9 shows no mapping or striping gain: the default plan, simulated on a
    DGX-1 whose NVLinks are 100x faster, is under 2% faster, and that bounds what any
    stage-to-GPU map or striping of its D2D swaps could give."""
    from mpsim.studies.reproduce import _peer_link_headroom

    planned, fast = _peer_link_headroom("dgx1-v100")
    default = planned.result
    assert any(x.action == "peer" for st in planned.plan.stages for x in st.actions)
    assert default.fits and fast.fits
    assert 1.0 <= default.iteration_s / fast.iteration_s < 1.02


def test_fig9_links_bound_the_gains_below_the_papers_even_with_unbounded_peer_memory():
    """Fig. 9's second bound: with memory enough on every GPU and every saving of the
    default plan moved to D2D swap, the fastest single neighbour is no slower than the
    slowest, stripes over all neighbours no slower than the fastest, and the whole chain
    gains less than half the paper's 33.3% (the reason our Fig. 9 cannot show it)."""
    from mpsim.studies.reproduce import _peer_link_headroom, _unbounded_d2d_bound

    planned, _ = _peer_link_headroom("dgx1-v100")
    bound = _unbounded_d2d_bound("dgx1-v100", planned)
    assert all(r.fits for r in bound.values())
    slowest, fastest, striped = (bound[k].iteration_s for k in
                                 ("slowest neighbour", "fastest neighbour", "striped over all neighbours"))
    assert slowest > fastest > striped
    assert 1.0 < slowest / striped < 1 + 0.333 / 2
    assert bound["as planned"].iteration_s > slowest  # D2D instead of recompute: faster where memory allows


def test_optimizer_states_leave_layer_by_layer_only_as_far_as_needed(gpt_15b):
    """GPT-15.4B on the DGX-1: the plan streams the optimizer states of some layers of a
    stage, not all or nothing; stage 0, which has no end slack, keeps most of its own."""
    from mpsim.plans.plan import host_optimizer_layers

    stages = gpt_15b["mpress"].plan.stages
    partial = [st for st in stages if 0 < len(host_optimizer_layers(st)) < st.layers[1] - st.layers[0]]
    assert partial
    first = host_optimizer_layers(stages[0])
    assert len(first) < (stages[0].layers[1] - stages[0].layers[0]) / 2


def test_host_swaps_the_simulation_shows_waiting_are_recomputed_instead(monkeypatch):
    """GPT-20.4B on the DGX-1: step 4 counts its GPU-CPU swaps as hidden, but in the
    simulated iteration the stages wait on them and on the memory they hold (1-2 s a
    stage); recomputing those layers instead, with a layer's optimizer states more on the
    host where a GPU then overflows, is faster, and the plan keeps it."""
    from mpsim.planners.context import make_context
    from mpsim.planners.mpress import Options, _Planner, plan_mpress

    ctx = make_context(JobSpec(load_topology("dgx1-v100"), load_trace("gpt-20.4b").rescale(2), "1f1b", 16, pipeline(8)))
    kept = plan_mpress(ctx, Options(), "mpress")
    monkeypatch.setattr(_Planner, "host_swaps_to_recompute", lambda self, result, plan: (result, plan))
    swapping = plan_mpress(ctx, Options(), "mpress")
    assert kept.result.fits and swapping.result.fits
    assert kept.result.iteration_s < 0.95 * swapping.result.iteration_s
    count = [sum(a.action == "host" for st in p.plan.stages for a in st.actions) for p in (kept, swapping)]
    assert count[0] < count[1]


def test_striping_is_not_tried_where_no_gpu_can_take_a_swap():
    """FSDP over all eight GPUs: every GPU runs a replica, so no plan has spare memory for a
    D2D swap (``Ctx.spare``) and striping cannot change the plan. MPress tries it only where
    some GPU may lend (``Ctx.may_lend``): the same plan as without striping, in as many
    simulations; on the pipeline over the same GPUs both options are tried."""
    from mpsim.planners.context import make_context
    from mpsim.plans.layouts import on_layout, parse_layout
    from mpsim.plans.strategies import strategy_named

    base = JobSpec(load_topology("dgx1-v100"), load_trace("gpt-15.4b").rescale(2), "1f1b", 16, strategy="mpress")
    fsdp = on_layout(base, parse_layout("fsdp8"), 16)
    assert not make_context(fsdp, strategy_named("mpress").keeps).may_lend
    assert make_context(base, strategy_named("mpress").keeps).may_lend
    assert make_context(on_layout(base, parse_layout("fsdp4"), 16), strategy_named("mpress").keeps).may_lend
    striped, single = plan_job(fsdp), plan_job(fsdp.but(strategy="mpress-no-striping"))
    assert not striped.result.fits or striped.result.iteration_s == single.result.iteration_s
    assert striped.plan.stages == single.plan.stages and striped.simulations == single.simulations


@pytest.mark.parametrize("layout,shards", [("ddp8", 1), ("zero1x8", 8), ("zero2x8", 8), ("fsdp8", 8)])
def test_planners_count_the_optimizer_shard_the_engine_allocates(layout, shards):
    """Under ZeRO-1 and up a GPU holds 1/N of the optimizer states (ZeRO 5.1): what MPress
    and the host-swap planners count per layer (``Ctx.optimizer_bytes``) is the engine's
    shard of it (``Sharding.shard``), so that the bytes a host stream saves are not
    overestimated N times."""
    from mpsim.planners.context import make_context
    from mpsim.plans.layouts import on_layout, parse_layout
    from mpsim.sim.engine import sharding_of
    from mpsim.sim.layout import Job, resolve

    base = JobSpec(load_topology("dgx1-v100"), load_trace("gpt-15.4b").rescale(2), "1f1b", 16, strategy="mpress")
    job = on_layout(base, parse_layout(layout), 16)
    ctx = make_context(job)
    sharding = sharding_of(resolve(Job(job)))
    assert sharding is not None and job.parallelism.optimizer_shards() == shards
    for row in ctx.trace.layers:
        on_gpu = sharding.shard(row.optimizer_bytes) if job.parallelism.zero_stage else row.optimizer_bytes
        assert ctx.optimizer_bytes(row) == on_gpu


def test_mpress_on_sharded_states_covers_the_shortfall_in_few_rounds():
    """FSDP x8 at twice GPT-15.4B's layers does not fit by far; with each layer's optimizer
    shard counted as what it saves, step 4's first round covers nearly all of the
    shortfall: the whole plan takes 8 simulations, where the unsharded figure, 8 times too
    large, took 32 (rounds of a few more streams each)."""
    from mpsim.plans.layouts import on_layout, parse_layout

    trace = load_trace("gpt-15.4b")
    blocks = sum(row.kind == "transformer" for row in trace.layers)
    base = JobSpec(load_topology("dgx1-v100"), trace.with_layers(2 * blocks).rescale(2), "1f1b", 16,
                   strategy="mpress")
    planned = plan_job(on_layout(base, parse_layout("fsdp8"), 16))
    assert planned.result.fits and planned.simulations <= 10


@given(n=hs.integers(min_value=1, max_value=64), data=hs.data())
def test_free_offload_count_is_the_one_at_a_time_search_s_in_log_n_trials(n, data):
    """Step 3's count of streaming stages (``_most_free``): where taking a stage more never
    makes the iteration faster, the largest count below n that is no slower, as dropping
    one stage at a time from n finds it, in at most 2 log2(n) + 1 trials."""
    from mpsim.planners.mpress import _most_free

    largest = data.draw(hs.integers(min_value=0, max_value=n - 1))
    asked: list[int] = []

    def no_slower(k: int) -> bool:
        asked.append(k)
        return k <= largest

    assert _most_free(no_slower, n) == largest
    assert all(0 < k < n for k in asked) and len(asked) == len(set(asked))
    assert len(asked) <= 2 * math.ceil(math.log2(n)) + 1 if n > 1 else not asked
