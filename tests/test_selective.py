"""Selective activation recomputation (plan action ``selective``, Korthikanti et al.
2022, section 4.2): only the attention core's kept bytes are dropped after the forward,
and the core's forward re-runs just before the layer's backward.

The hand-built cases use one GPU of the tiny server (1 TFLOP/s fp16 at the default 50%
matmul efficiency, 1 GB/s memory at 80%: 0.5e12 FLOP/s and 0.8e9 B/s), roofline times,
GPipe, so every number below is worked out by hand.
"""

from __future__ import annotations

import pytest
from helpers import GB, layer, tiny_topology, tiny_trace

from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import SchemaError
from mpsim.models.trace import Trace
from mpsim.planners.registry import plan_job
from mpsim.plans.job import JobSpec
from mpsim.plans.plan import LayerAction, check_plan, make_plan
from mpsim.sim import simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.sim.program import build_program
from mpsim.timing.costs import attention_core_seconds, cost_model


def _roofline(name: str, fwd_flops: float, fwd_mem: float, bwd_flops: float, **kw: object) -> dict:
    row = layer(name, **kw)  # type: ignore[arg-type]
    row.update(fwd_ms=None, bwd_ms=None, fwd_flops=fwd_flops, fwd_mem_bytes=fwd_mem, bwd_flops=bwd_flops)
    return row


def _toy() -> Trace:
    """Layer a: 1 GB saved, 0.1 GB workspace; forward 5e9 FLOP (10 ms) + 8e6 B (10 ms) =
    20 ms, backward 20 ms; its attention core keeps 0.4 GB and costs 1e9 FLOP (2 ms) +
    4e6 B (5 ms) = 7 ms. Layer b: 0.6 GB forward workspace (none in its backward), forward
    50 ms, backward 30 ms."""
    a = _roofline("a", 5e9, 8e6, 10e9, act=GB, workspace=GB // 10)
    a.update(attention_core_bytes=4 * GB // 10, attention_core_flops=1e9, attention_core_mem_bytes=4e6)
    b = _roofline("b", 25e9, 0.0, 15e9, workspace=6 * GB // 10)
    b.update(bwd_workspace_bytes=0)
    return tiny_trace([a, b])


def _run(trace: Trace, action: str | None, microbatches: int = 1):
    topo = tiny_topology(n_gpus=1, memory_mib=64 * 1024)
    acts = [] if action is None else [LayerAction(layer=0, action=action)]  # type: ignore[arg-type]
    plan = make_plan(trace, topo, "gpipe", microbatches, [(0, 2)], [0], "test", {0: acts})
    return simulate_job(job_of_plan(topo, trace, plan))


def _steps(result) -> list[tuple[float, float]]:
    """(time, GB in use) after every change of the GPU's memory."""
    g = result.gpus[0]
    steps, prev = [], 0
    for t, used in zip(g.memory_times_s, g.memory_used_bytes):
        if used != prev:
            steps.append((round(float(t), 9), int(used) / GB))
            prev = used
    return steps


def test_core_time_is_the_roofline_of_its_flops_and_bytes():
    trace = _toy()
    fwd = cost_model(trace, tiny_topology(n_gpus=1).spec.gpu).layer_times.fwd_s
    assert fwd == pytest.approx([0.02, 0.05])
    assert attention_core_seconds(trace.layers, fwd, 0.8e9) == pytest.approx([0.007, 0.0])


def test_exact_timeline_of_one_microbatch():
    r = _run(_toy(), "selective")
    # a's forward: 1 GB + 0.1 GB workspace; at 20 ms the workspace and the core's 0.4 GB go;
    # b's forward (20..70 ms) holds 0.6 GB, its backward (70..100 ms) nothing; the core
    # re-runs 100..107 ms (+0.4 GB), then a's backward (0.1 GB workspace) until 127 ms
    # frees the rest
    assert _steps(r) == [(0.0, 1.0), (0.0, 1.1), (0.02, 1.0), (0.02, 0.6), (0.02, 1.2), (0.07, 0.6),
                         (0.1, 1.0), (0.107, 1.1), (0.127, 1.0), (0.127, 0.0)]
    assert r.max_peak_bytes == 12 * GB // 10
    assert r.iteration_s == pytest.approx(0.127)
    assert r.gpus[0].costs_s["selective_s"] == pytest.approx(0.007)
    assert r.gpus[0].costs_s["recompute_s"] == 0.0


def test_peak_and_time_of_two_microbatches_lie_between_keep_and_recompute():
    trace = _toy()
    keep, sel, full = (_run(trace, a, microbatches=2) for a in (None, "selective", "recompute"))
    d = GB // 10
    # in b's second forward, keep: both microbatches' 1 GB plus b's 0.6 GB workspace;
    # selective: 2 x 0.6 GB + 0.6 GB; recompute: a's 1 GB + 0.1 GB workspace while it runs
    assert (keep.max_peak_bytes, sel.max_peak_bytes, full.max_peak_bytes) == (26 * d, 18 * d, 11 * d)
    # 2 x (70 ms forward + 50 ms backward), plus 2 x 7 ms (core) or 2 x 20 ms (a's forward)
    assert keep.iteration_s == pytest.approx(0.24)
    assert sel.iteration_s == pytest.approx(0.254)
    assert full.iteration_s == pytest.approx(0.28)
    assert sel.gpus[0].saved_at_peak["selective"] == 8 * d  # both cores off the GPU at b's forward


def test_split_runs_the_core_recompute_as_micro_ops():
    trace = _toy()
    rows = [r.model_copy(update={"split_dims": ["batch"]}) for r in trace.layers]
    trace = Trace(trace.spec.model_copy(update={"layers": rows}), trace.source)
    topo = tiny_topology(n_gpus=1, memory_mib=64 * 1024)
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test",
                     {0: [LayerAction(layer=0, action="selective", split=2)]})
    r = simulate_job(job_of_plan(topo, trace, plan))
    assert r.gpus[0].costs_s["selective_s"] == pytest.approx(0.007 * 1.03)
    assert r.iteration_s == pytest.approx(0.07 + 0.05 + (0.02 + 0.007 + 0.02) * 0.03 + 0.007)


def test_refused_in_one_line_where_the_core_keeps_nothing():
    trace, topo = _toy(), tiny_topology(n_gpus=1)
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test", {0: [LayerAction(layer=1, action="selective")]})
    with pytest.raises(SchemaError) as err:
        check_plan(plan, topo, trace, "plan.json")
    assert "layer 1 keeps nothing in its attention core; use recompute or keep" in str(err.value)
    assert "\n" not in str(err.value)


def _kept_after_forward(trace: Trace, j: int, action: str) -> int:
    """Bytes layer ``j``'s forward leaves behind on a middle stage of its own, less its
    output (sent on), plus its input (allocated before it; held or released): what it
    keeps for its backward."""
    row = trace.layers[j]
    fwd = cost_model(trace, load_topology("dgx1-v100").spec.gpu).layer_times.fwd_s[j: j + 1]
    acts = {} if action == "keep" else {j: LayerAction(layer=j, action=action)}  # type: ignore[arg-type]
    prog = build_program([row], fwd, fwd, j, False, False, acts, core_s=fwd * 0.1)
    net = sum(p.template.net_bytes for p in prog.forward)
    return net - row.output_bytes + row.input_bytes


def test_gpt_selective_keeps_34_sbh_per_layer():
    """Korthikanti et al. 2022, section 4.2: eager attention keeps s*b*h*(34 + 5*a*s/h)
    bytes per layer, selective 34*s*b*h."""
    trace = load_trace("gpt-5.3b")
    m, b = trace.spec.model, trace.microbatch
    s, h, a = m["seq_len"], m["hidden"], m["heads"]
    j = next(i for i, r in enumerate(trace.layers) if r.kind == "transformer")
    assert _kept_after_forward(trace, j, "keep") == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.03)
    assert _kept_after_forward(trace, j, "selective") == pytest.approx(34 * s * b * h, rel=0.03)
    row = trace.layers[j]
    assert _kept_after_forward(trace, j, "selective") == row.act_bytes - row.attention_core_bytes


def _three(model: str):
    topo, trace = load_topology("dgx1-v100"), load_trace(model)
    strategies = ("none", "selective", "recompute-all")
    return [plan_job(JobSpec(topo, trace, "1f1b", 16, strategy=st)).result for st in strategies]


def test_gpt_selective_lies_between_keep_and_full_recompute():
    keep, sel, full = _three("gpt-5.3b")
    assert keep.max_peak_bytes > sel.max_peak_bytes > full.max_peak_bytes
    assert keep.samples_per_s > sel.samples_per_s > full.samples_per_s
    # most of the saving of full recompute, for a small part of its time (eager attention)
    assert keep.max_peak_bytes - sel.max_peak_bytes > 0.5 * (keep.max_peak_bytes - full.max_peak_bytes)
    assert sel.samples_per_s > 0.9 * keep.samples_per_s
    assert all(g.costs_s["recompute_s"] == 0 for g in sel.gpus)
    assert all(g.costs_s["selective_s"] > 0 for g in sel.gpus if g.stage is not None)


def test_flash_attention_gains_little():
    keep, sel, full = _three("llama-2-7b")
    assert keep.max_peak_bytes - sel.max_peak_bytes < 0.1 * (keep.max_peak_bytes - full.max_peak_bytes)


def test_selective_strategy_is_listed_and_considered_by_best():
    from mpsim.cli import _STRATEGY_HELP
    from mpsim.planners.best import SINGLE
    from mpsim.planners.registry import STRATEGIES

    assert "selective" in STRATEGIES and "selective" in SINGLE and "selective" in _STRATEGY_HELP
    plan = plan_job(JobSpec(load_topology("dgx1-v100"), load_trace("gpt-5.3b"), "1f1b", 16, strategy="selective")).plan
    acts = [a for st in plan.stages for a in st.actions]
    assert {a.action for a in acts} == {"selective"} and len(acts) == 29


def test_executor_checkpoints_the_attention_core_only():
    """The executor's ``selective`` (``SelfAttention.checkpoint_core``): the layer then keeps
    exactly the trace's act_bytes - attention_core_bytes, with the same gradients."""
    torch = pytest.importorskip("torch")
    from mpsim.executor.stage_actions import selective
    from mpsim.models.tracer import trace_layer
    from mpsim.models.workloads import ModelConfig, TransformerLayer

    cfg = ModelConfig("gpt", 1, 64, 4, 32, 100, dropout=0.1)
    traced, grads = [], []
    for core_only in (False, True):
        torch.manual_seed(0)
        layer = TransformerLayer(cfg)
        if core_only:
            layer = selective(layer)
        x = torch.randn(2, 32, 64, requires_grad=True)
        traced.append(trace_layer(layer, [x], lambda m, t: m(t)))
        grads.append(x.grad)
    keep, sel = traced
    assert keep["attention_core_bytes"] > 0
    assert sel["act_bytes"] == keep["act_bytes"] - keep["attention_core_bytes"]
    assert torch.allclose(grads[0], grads[1])
