"""``offload-activations`` (Megatron-Core's CPU offloading, PyTorch's ``save_on_cpu``): which
layers it offloads, what that saves at the peak, what it costs, and how it says it does not fit.

The hand-built job: one GPU, an embedding (1 MB saved), four transformer layers of 150 MB
saved each and a head that saves nothing, every forward 1 ms and every backward 2 ms, one
microbatch; PCIe at ``pcie_gbps`` GB/s with no latency, so a layer's copy takes
150 MB / rate. The iteration without offloading is 6 ms of forward and 12 ms of backward.
"""

import json

import pytest
import yaml
from helpers import layer, run_cli, tiny_trace, topology_dict, trace_dict

from mpsim import load_trace
from mpsim.errors import MpsimError
from mpsim.hardware.topology import parse_topology
from mpsim.planners.activation_offload import offloaded_layers, plan_offload_activations
from mpsim.planners.context import make_context
from mpsim.planners.registry import run_planner
from mpsim.plans.job import JobSpec, pipeline
from mpsim.plans.strategies import IN_BEST, STRATEGIES, STRATEGY_HELP

MB = 10**6
MS = 1e-3
ACT = 150 * MB
STRATEGY = "offload-activations"


def _rows() -> list[dict]:
    return ([layer("emb", 1.0, 2.0, act=1 * MB, kind="embedding")]
            + [layer(f"l{i}", 1.0, 2.0, act=ACT) for i in range(4)]
            + [layer("head", 1.0, 2.0, kind="head")])


def _server(pcie_gbps: float = 1000.0, host_gib: float = 64, memory_mib: float = 1024, n_gpus: int = 1) -> dict:
    d = topology_dict(n_gpus=n_gpus, memory_mib=memory_mib, pcie_gbps=pcie_gbps)
    if n_gpus == 1:
        del d["nvlink"]
    d["host"]["memory_gib"] = host_gib
    return d


def _job(strategy: str, stages: int = 1, **server: float) -> JobSpec:
    topo = parse_topology(_server(n_gpus=stages, **server), "tiny.yaml")
    return JobSpec(topo, tiny_trace(_rows()), "1f1b", max(1, stages), pipeline(stages), strategy=strategy)


def _run(strategy: str, stages: int = 1, **server: float):
    return run_planner(strategy, make_context(_job(strategy, stages, **server)))


def _offloaded(planned) -> list[list[int]]:
    return [[a.layer for a in st.actions if a.action == "host"] for st in planned.plan.stages]


def test_every_transformer_layer_but_the_last_is_offloaded_and_nothing_else():
    planned = _run(STRATEGY)
    assert _offloaded(planned) == [[1, 2, 3]]  # not the embedding (0), the last layer (4) nor the head (5)
    assert [a.action for a in planned.plan.stages[0].actions] == ["host"] * 3
    assert planned.plan.swap_timing == "prefetch" and planned.plan.strategy == STRATEGY
    assert planned.plan.stages[0].optimizer == "gpu" and planned.simulations == 1


def test_each_stage_keeps_its_own_last_transformer_layer():
    ctx = make_context(_job(STRATEGY, stages=2))
    assert ctx.stages == [(0, 3), (3, 6)]  # emb l0 l1 | l2 l3 head, three ms of compute each
    assert _offloaded(run_planner(STRATEGY, ctx)) == [[1], [3]]


def test_the_number_of_layers_is_a_knob_from_python():
    ctx = make_context(_job(STRATEGY))
    assert _offloaded(plan_offload_activations(ctx, layers=2)) == [[1, 2]]
    assert _offloaded(plan_offload_activations(ctx, layers=0)) == [[]]
    assert _offloaded(plan_offload_activations(ctx, layers=9)) == [[1, 2, 3, 4]]  # all of them, the last included
    rows = _rows()
    rows[2]["act_bytes"] = 0  # a layer that saves nothing has nothing to offload
    assert offloaded_layers(tiny_trace(rows), (0, 6)) == [1, 3]


def test_on_llama_3_8b_it_offloads_layer0_to_layer30():
    trace = load_trace("llama-3-8b")
    chosen = offloaded_layers(trace, (0, trace.n_layers))
    assert chosen == list(range(1, 32))
    assert [trace.layers[j].name for j in (chosen[0], chosen[-1])] == ["layer0", "layer30"]


def test_with_ample_pcie_the_peak_drops_by_the_offloaded_bytes_less_the_one_in_flight_and_time_is_unchanged():
    """At 1000 GB/s a copy takes 0.15 ms. Kept, the peak is everything at the end of the forward:
    1 + 4 x 150 MB. Offloaded, layers 1-3 (450 MB) leave as their forwards end, and each comes
    back 0.15 ms before its backward: layer 3's lands at 10 ms, while layer 4's activations
    are still held (its backward ends then), so one layer is in flight at the peak (as it is
    at the forward's end, layer 3's copy leaving beside layer 4). Every copy hides behind
    the compute: the iteration is the kept one's to the last bit."""
    kept, offloaded = _run("none").result, _run(STRATEGY).result
    assert kept.gpus[0].peak_bytes == 1 * MB + 4 * ACT
    assert offloaded.gpus[0].peak_bytes == kept.gpus[0].peak_bytes - (3 * ACT - ACT)
    assert offloaded.host_peak_bytes == 3 * ACT
    assert kept.iteration_s == offloaded.iteration_s == pytest.approx(18 * MS, rel=1e-12)
    copies = sorted((s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9))
                    for s in offloaded.spans if s.lane in ("d2h", "h2d"))
    assert copies == [("swap-in L1 mb0", 13.85, 14.0), ("swap-in L2 mb0", 11.85, 12.0), ("swap-in L3 mb0", 9.85, 10.0),
                      ("swap-out L1 mb0", 2.0, 2.15), ("swap-out L2 mb0", 3.0, 3.15), ("swap-out L3 mb0", 4.0, 4.15)]


def test_it_fits_a_gpu_that_keeping_everything_does_not():
    kept, offloaded = _run("none", memory_mib=400).result, _run(STRATEGY, memory_mib=400).result
    assert not kept.fits and offloaded.fits
    assert offloaded.gpus[0].peak_bytes == 1 * MB + 2 * ACT
    assert offloaded.iteration_s == pytest.approx(18 * MS, rel=1e-12)


def test_a_copy_longer_than_a_forward_hides_but_saves_less_at_the_peak():
    """At 100 GB/s a copy takes 1.5 ms, longer than a layer's forward (1 ms), shorter than
    its backward (2 ms): the swap-outs queue on the copy engine (2-3.5, 3.5-5, 5-6.5 ms), so
    when layer 4 starts at 4 ms layer 2's copy is still leaving and layer 3's has not begun:
    the peak saves one layer only. Each swap-in still lands as its backward starts."""
    kept, offloaded = _run("none", pcie_gbps=100).result, _run(STRATEGY, pcie_gbps=100).result
    assert offloaded.gpus[0].peak_bytes == kept.gpus[0].peak_bytes - ACT
    assert offloaded.iteration_s == kept.iteration_s


def test_copies_longer_than_the_compute_make_the_iteration_longer():
    """At 0.05 GB/s a copy takes 3 s, longer than the whole iteration kept (18 ms). The three
    swap-outs queue on the device-to-host engine from 2 ms: layer 3's lands at 2 ms + 3 x 3 s;
    its swap-in can start only then and takes 3 s, and the backward, which reached layer 3
    at 10 ms, waits for it; layers 3, 2, 1 and the embedding take 8 ms more. Nothing has
    left the GPU by the end of the forward, so the peak is the kept one."""
    kept, offloaded = _run("none", pcie_gbps=0.05).result, _run(STRATEGY, pcie_gbps=0.05).result
    assert offloaded.iteration_s == pytest.approx(2 * MS + 3 * 3.0 + 3.0 + 8 * MS, rel=1e-12)
    assert offloaded.iteration_s > 600 * kept.iteration_s
    assert offloaded.gpus[0].peak_bytes == kept.gpus[0].peak_bytes


def test_host_memory_too_small_is_reported_as_the_host_running_out():
    planned = _run(STRATEGY, host_gib=0.25)  # 268 MB of pinned host memory for 450 MB
    oom = planned.result.oom
    assert not planned.result.fits and oom is not None and oom["gpu"] == "host"
    assert oom["task"] == "swap-out of layer 2 microbatch 0 from GPU 0"
    assert planned.result.gpus[0].peak_bytes <= planned.result.gpus[0].capacity_bytes  # the GPU itself fits


def test_the_command_line_says_the_host_ran_out_in_one_line(tmp_path):
    server, model = tmp_path / "tiny.yaml", tmp_path / "toy.json"
    server.write_text(yaml.safe_dump(_server(host_gib=0.25)))
    model.write_text(json.dumps(trace_dict(_rows())))
    code, out, _ = run_cli(120, "simulate", "--server", str(server), "--model", str(model), "--microbatches", "1",
                           "--strategy", STRATEGY)
    assert code == 1
    first, why = out.splitlines()[:2]
    assert first.startswith("DOES NOT FIT: toy on tiny1") and first.endswith(f"strategy {STRATEGY}")
    assert "host ran out" in why and "swap-out of layer 2 microbatch 0" in why


@pytest.mark.parametrize("layers", [-1, 1.5, True])
def test_a_bad_number_of_layers_is_refused_in_one_line(layers):
    with pytest.raises(MpsimError, match=r"^layers to offload must be a whole number >= 0, got ") as caught:
        plan_offload_activations(make_context(_job(STRATEGY)), layers=layers)
    assert "\n" not in str(caught.value)


def test_it_is_registered_with_its_help_and_is_not_one_best_tries():
    strategy = STRATEGIES[STRATEGY]
    assert strategy.help and f"{STRATEGY} ({strategy.help})" in STRATEGY_HELP
    assert strategy.word and strategy.keeps == "keep" and strategy.optimizer_on_gpu
    assert STRATEGY not in IN_BEST and not strategy.best_fallback
    assert list(STRATEGIES).index(STRATEGY) == list(STRATEGIES).index("host-swap") + 1
