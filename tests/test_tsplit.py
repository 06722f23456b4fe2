"""TSPLIT planner: its cost models (eq. 3, 5) and Algorithm 2's plans, simulated."""

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.data.catalog import load_topology, load_trace
from mpsim.planners import plan_job
from mpsim.planners.context import make_context
from mpsim.planners.tsplit import _StageSplits, split_saving, swap_cost_s
from mpsim.plans.job import JobSpec, pipeline

MB = 10**6


def test_swap_cost_is_the_transfer_not_hidden_by_either_window():
    # 1 GB over 10 GB/s = 0.1 s each way; half the PCIe already taken halves both windows
    assert swap_cost_s(1e9, 10e9, 0.06, 0.2, 0.5) == pytest.approx(0.07)
    assert swap_cost_s(1e9, 10e9, 0.3, 0.3, 0.0) == 0.0
    assert swap_cost_s(1e9, 10e9, 0.3, 0.3, 1.0) == pytest.approx(0.2)


@pytest.mark.parametrize("p,expected", [(2, 150), (3, 200), (4, 225)])
def test_split_saves_p_minus_1_over_p_of_the_smaller_tensor(p, expected):
    assert split_saving(300, 600, p) == pytest.approx(expected)


def test_algorithm_2_takes_the_least_time_per_byte_first():
    """One GPU, two layers of 400 MB saved activations: recomputing layer 0 costs 1 ms, layer
    1 costs 10 ms, and swapping either costs 80 ms of PCIe (1 GB/s, no window to hide it):
    a 300 MB shortfall is covered by recomputing layer 0 alone."""
    topo = tiny_topology(n_gpus=1, memory_mib=1024, pcie_gbps=1.0)
    trace = tiny_trace([layer("a", fwd_ms=1, bwd_ms=1, act=400 * MB, out=1),
                        layer("b", fwd_ms=10, bwd_ms=1, act=400 * MB, out=1)])
    st = _StageSplits(make_context(JobSpec(topo, trace, "1f1b", 1, pipeline(1))), 0)
    best = min(st.candidates(), key=lambda c: c.ratio)
    assert (best.layer, best.action) == (0, "recompute")
    assert st.reduce(300 * MB)
    assert {j: a.action for j, a in st.actions.items()} == {0: "recompute"}


_SHORT_OF_RECOMPUTE = ("TSPLIT's greedy host swaps (eq. 3 prices each against the forward and backward windows) "
                       "end up slower than recomputing every layer once the backward moves no copied weight "
                       "gradients and so hides less of their PCIe time")


@pytest.mark.parametrize("model,schedule,mb", [
    pytest.param("gpt-10.3b", "1f1b", 2, marks=pytest.mark.xfail(
        strict=True, reason=f"{_SHORT_OF_RECOMPUTE}: 2.839 against 2.893 samples/s on the Table II-fitted GPT-10.3B")),
    pytest.param("bert-1.67b", "pipedream", 12, marks=pytest.mark.xfail(
        strict=True, reason=f"{_SHORT_OF_RECOMPUTE}: 9.576 against 9.778 samples/s"))])
def test_tsplit_plans_fit_and_beat_recompute_everything(model, schedule, mb):
    topo = load_topology("dgx1-v100")
    trace = load_trace(model).rescale(mb)
    ts = plan_job(JobSpec(topo, trace, schedule, 16, strategy="tsplit"))
    assert ts.result.fits and all(g.peak_bytes <= g.capacity_bytes for g in ts.result.gpus)
    recompute_all = plan_job(JobSpec(topo, trace, schedule, 16, strategy="recompute-all")).result
    assert ts.result.samples_per_s > recompute_all.samples_per_s
