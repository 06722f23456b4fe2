"""The cost model (mpsim.timing.costs): layer times, the attention core and the optimizer update
from one memory rate, cached by content."""

from __future__ import annotations

import copy

import pytest
from helpers import layer, topology_dict, trace_dict

from mpsim import load_topology, load_trace, simulate
from mpsim.hardware.topology import Topology, parse_topology
from mpsim.models.trace import Trace, parse_trace
from mpsim.plans.plan import LayerAction, make_plan
from mpsim.sim import simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.timing.costs import attention_core_seconds, cost_model


def _topology(memory: float = 0.5) -> Topology:
    """One GPU at 1 TFLOP/s fp16 and 1 GB/s, whose fp16 block runs memory-bound work at
    ``memory`` x bandwidth while the GPU-wide ``memory_efficiency`` stays 0.8."""
    d = topology_dict(n_gpus=1, memory_mib=64 * 1024)
    del d["nvlink"]
    d["gpu"].update(matmul_efficiency=0.5, memory_efficiency=0.8,
                    efficiency={"fp16": {"matmul": 0.5, "attention": 0.25, "memory": memory, "source": "test"}})
    return parse_topology(d, "tiny.yaml")


def _rows() -> list[dict]:
    """Layer a by roofline: forward 4e9 matmul FLOP, 1e9 attention-kernel FLOP, 8e6 bytes;
    backward twice the FLOPs, half the bytes; its attention core 1e9 FLOP and 4e6 bytes.
    Layer b measured: 3 ms and 5 ms."""
    a = layer("a", params=1000, act=1000)
    a.update(fwd_ms=None, bwd_ms=None, fwd_flops=5e9, fwd_attention_flops=1e9, fwd_mem_bytes=8e6,
             bwd_flops=10e9, bwd_attention_flops=2e9, bwd_mem_bytes=4e6, attention_core_bytes=400,
             attention_core_flops=1e9, attention_core_mem_bytes=4e6)
    return [a, layer("b", 3.0, 5.0)]


def _trace() -> Trace:
    return parse_trace(trace_dict(_rows()), "toy.json")


def test_layer_times_by_hand():
    cm = cost_model(_trace(), _topology().spec.gpu)
    # forward: 4e9 / 0.5e12 + 1e9 / 0.25e12 + 8e6 / 0.5e9 = 8 + 4 + 16 ms
    # backward: 8e9 / 0.5e12 + 2e9 / 0.25e12 + 4e6 / 0.5e9 = 16 + 8 + 8 ms
    assert cm.layer_times.fwd_s == pytest.approx([0.028, 0.003], rel=1e-12)
    assert cm.layer_times.bwd_s == pytest.approx([0.032, 0.005], rel=1e-12)
    assert cm.dtype == "fp16" and cm.memory_rate == 0.5e9


def test_attention_core_and_update_by_hand():
    cm = cost_model(_trace(), _topology().spec.gpu)
    # memory part of a's forward 8e6 / 0.5e9 = 16 ms, of which the core's bytes are half;
    # the rest (12 ms) is compute, of which the core's FLOPs are a fifth: 8 + 2.4 ms
    assert cm.attention_core_s == pytest.approx([0.0104, 0.0], rel=1e-12)
    # Adam: 2 + 2 x 12 + 2 bytes per parameter, at the GPU-wide memory_efficiency (0.8)
    assert cm.update_rate == 0.8e9
    assert cm.update_s(_trace().layers[:1]) == pytest.approx(28_000 / 0.8e9, rel=1e-12)


def test_the_engine_re_runs_the_core_at_the_layer_times_memory_rate():
    topo, trace = _topology(), _trace()
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test", {0: [LayerAction(layer=0, action="selective")]})
    r = simulate_job(job_of_plan(topo, trace, plan))
    cm = cost_model(trace, topo.spec.gpu)
    assert r.gpus[0].costs_s["selective_s"] == cm.attention_core_s[0] == pytest.approx(0.0104, rel=1e-12)
    # the GPU-wide memory_efficiency (0.8) would have made it 5 + 3.6 ms
    old = attention_core_seconds(trace.layers, cm.layer_times.fwd_s, 0.8e9)
    assert old[0] == pytest.approx(0.0086, rel=1e-12)


def test_dgx_h100_fp16_uses_its_fp16_memory_efficiency_everywhere():
    topo, trace = load_topology("dgx-h100"), load_trace("gpt-5.3b")
    gpu = topo.spec.gpu
    cm = cost_model(trace, gpu)
    assert cm.dtype == "fp16" and gpu.op_efficiency("fp16").memory != gpu.memory_efficiency
    assert cm.memory_rate == gpu.memory_bandwidth_gbps * 1e9 * gpu.op_efficiency("fp16").memory
    assert list(cm.attention_core_s) == list(attention_core_seconds(trace.layers, cm.layer_times.fwd_s,
                                                                    cm.memory_rate))
    r = simulate(topo, trace, "gpipe", microbatches=2, strategy="selective")
    for g in r.gpus:
        assert g.layers is not None
        a, b = g.layers
        assert g.costs_s["selective_s"] == pytest.approx(2 * cm.attention_core_s[a:b].sum(), rel=1e-12)


def test_equal_contents_give_the_same_model():
    gpu = _topology().spec.gpu
    cm = cost_model(_trace(), gpu)
    assert cost_model(_trace(), _topology().spec.gpu) is cm  # new objects, same contents
    assert cost_model(_trace(), _topology(memory=0.6).spec.gpu) is not cm
    rows = copy.deepcopy(_rows())
    rows[1]["fwd_ms"] = 4.0
    assert cost_model(parse_trace(trace_dict(rows), "toy.json"), gpu) is not cm


def test_cached_arrays_are_read_only():
    cm = cost_model(_trace(), _topology().spec.gpu)
    for arr in (cm.layer_times.fwd_s, cm.layer_times.bwd_s, cm.attention_core_s):
        with pytest.raises(ValueError):
            arr[0] = 1.0
