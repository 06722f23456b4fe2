"""Trace files, rescaling, the layer-count knob, and FakeTensor tracing against formulas."""

import pytest
from helpers import layer, tiny_trace

from mpsim import load_topology, load_trace
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ZOO, ModelConfig
from mpsim.timing.costs import cost_model


def test_shipped_traces_hit_the_papers_parameter_counts():
    expected = {"bert-0.35b": 0.35, "bert-0.64b": 0.64, "bert-1.67b": 1.67, "bert-4b": 4.0, "bert-6.2b": 6.2,
                "gpt-5.3b": 5.3, "gpt-10.3b": 10.3, "gpt-15.4b": 15.4, "gpt-20.4b": 20.4, "gpt-25.5b": 25.5}
    for name, billions in expected.items():
        t = load_trace(name)
        assert t.spec.params / 1e9 == pytest.approx(billions, rel=0.05), name
        assert t.spec.params == ZOO[name][0].param_count()


def test_trace_loads_as_a_dataframe():
    df = load_trace("gpt-5.3b").to_frame()
    assert list(df["kind"][:2]) == ["embedding", "transformer"] and df["kind"].iloc[-1] == "head"
    assert len(df) == 29 + 2


def test_rescale_is_linear_in_microbatch_except_model_state():
    t = tiny_trace([layer("a", 1.0, 2.0, act=100, out=10, inp=10, params=7, workspace=5)], microbatch=2)
    r = t.rescale(6)
    row = r.layers[0]
    assert (row.act_bytes, row.output_bytes, row.workspace_bytes, row.fwd_ms, row.bwd_ms) == (300, 30, 15, 3.0, 6.0)
    assert (row.param_bytes, row.optimizer_bytes) == (14, 84)
    assert r.microbatch == 6


def test_rescale_keeps_the_traffic_of_parameter_shaped_tensors():
    t = tiny_trace([layer("a", 1.0, 2.0, act=100)], microbatch=2)
    row = t.layers[0].model_copy(update={"fwd_mem_bytes": 50.0, "fwd_fixed_mem_bytes": 10.0,
                                         "bwd_mem_bytes": 400.0, "bwd_fixed_mem_bytes": 300.0})
    from mpsim.models.trace import Trace
    r = Trace(t.spec.model_copy(update={"layers": [row]})).rescale(6).layers[0]
    assert (r.fwd_mem_bytes, r.bwd_mem_bytes) == (10.0 + 3 * 40.0, 300.0 + 3 * 100.0)
    assert (r.fwd_fixed_mem_bytes, r.bwd_fixed_mem_bytes) == (10.0, 300.0)


def test_fixed_traffic_cannot_exceed_the_traffic():
    row = tiny_trace([layer("a", 1.0, 2.0)]).layers[0].model_dump()
    row.update(bwd_mem_bytes=10.0, bwd_fixed_mem_bytes=11.0)
    from mpsim.models.trace import LayerRow
    with pytest.raises(ValueError, match="fixed traffic is part of"):
        LayerRow(**row)


@pytest.mark.parametrize("traced,wanted", [(1, 8), (8, 1)])
def test_a_rescaled_trace_moves_the_bytes_of_one_traced_at_that_batch(traced, wanted):
    """A convolution's backward reads its weight and writes its weight gradient at any
    batch; rescaling keeps that part, so bytes and times match a fresh trace."""
    from mpsim.models.modules import trace_builder

    gpu = load_topology("dgx1-v100").spec.gpu
    small, large = (trace_builder("mpsim.models.cnn:vgg11", b) for b in (traced, wanted))
    rescaled = small.rescale(wanted)
    for a, b in zip(rescaled.layers, large.layers, strict=True):
        assert a.fwd_mem_bytes == pytest.approx(b.fwd_mem_bytes, rel=1e-3), a.name
        assert a.bwd_mem_bytes == pytest.approx(b.bwd_mem_bytes, rel=1e-3), a.name
    conv7 = small.layers[[r.name for r in small.layers].index("conv7")]
    weight_bytes = 512 * 512 * 3 * 3 * 4  # read, and its gradient written (the bias's gradient too)
    assert 2 * weight_bytes < conv7.bwd_fixed_mem_bytes < 2 * conv7.param_bytes
    times, fresh = cost_model(rescaled, gpu).layer_times, cost_model(large, gpu).layer_times
    assert times.bwd_s.sum() == pytest.approx(fresh.bwd_s.sum(), rel=1e-3)


def test_a_weight_gradient_is_not_copied_into_place():
    """On a GPU autograd takes a fresh weight gradient as the parameter's .grad; tracing
    must not add a copy of it (VGG-11's fc1 at batch 1 would move its 411 MB weight
    gradient three times, 1.2 GB, in a backward that moves well under 1 MB)."""
    from mpsim.models.modules import trace_builder

    fc1 = next(r for r in trace_builder("mpsim.models.cnn:vgg11", 1).layers if r.name == "fc1")
    assert fc1.bwd_mem_bytes < 1e6 < fc1.param_bytes


@pytest.mark.parametrize("traced,wanted", [(2, 8), (8, 2)])
def test_a_rescaled_transformer_trace_moves_the_bytes_of_one_traced_at_that_batch(traced, wanted):
    """From two samples up a layer's traffic is affine in the batch (at one, PyTorch's
    attention skips some copies, so a batch-1 trace rescales a few percent high)."""
    cfg = ModelConfig("gpt", 2, 256, 4, 128, 1000)
    rescaled, fresh = trace_model(cfg, traced).rescale(wanted), trace_model(cfg, wanted)
    for a, b in zip(rescaled.layers, fresh.layers, strict=True):
        assert a.fwd_mem_bytes == pytest.approx(b.fwd_mem_bytes, rel=1e-3), a.name
        assert a.bwd_mem_bytes == pytest.approx(b.bwd_mem_bytes, rel=1e-3), a.name
    assert fresh.layers[1].bwd_fixed_mem_bytes > 0


def test_with_layers_adds_identical_transformer_layers():
    t = load_trace("gpt-5.3b")
    t57 = t.with_layers(57)
    assert t57.n_layers == 59
    assert t57.spec.params == load_trace("gpt-10.3b").spec.params


def test_tracer_counts_exact_parameters_and_matmul_flops():
    # Forward FLOPs of a transformer layer: 24 b s h^2 + 4 b s^2 h (QKV, projection, MLP, scores, weighted sum).
    cfg = ModelConfig("gpt", 2, 256, 4, 128, 1000)
    b, s, h = 3, 128, 256
    t = trace_model(cfg, b)
    block = t.layers[1]
    assert block.params == cfg.layer_params()
    assert t.spec.params == cfg.param_count()
    assert block.fwd_flops == 24 * b * s * h * h + 4 * b * s * s * h
    assert block.bwd_flops == 2 * block.fwd_flops
    assert block.param_bytes == 2 * block.params and block.optimizer_bytes == 12 * block.params
    assert block.output_bytes == b * s * h * 2 and block.saves_input


def test_tracer_saved_activations_near_the_megatron_formula():
    # Korthikanti et al.: s b h (34 + 5 a s / h) bytes per layer in fp16 without recomputation,
    # with CUDA's 1-byte dropout masks; the written-out causal mask (s^2 bytes) and the
    # LayerNorm statistics come on top.
    cfg = ModelConfig("gpt", 1, 512, 8, 256, 1000)
    b, s, h, a = 2, 256, 512, 8
    saved = trace_model(cfg, b).layers[1].act_bytes
    formula = s * b * h * (34 + 5 * a * s / h)
    assert formula <= saved <= 1.03 * formula


def test_roofline_times_follow_flops_and_bytes():
    gpu = load_topology("dgx1-v100").spec.gpu
    t = tiny_trace([layer("a", flops=1e12)])
    spec = t.spec.model_copy(update={"layers": [t.layers[0].model_copy(update={"fwd_ms": None, "bwd_ms": None,
                                                                              "fwd_mem_bytes": 7.2e8})]})
    from mpsim.models.trace import Trace
    times = cost_model(Trace(spec), gpu).layer_times
    eff = gpu.op_efficiency("fp16")
    rate = 125e12 * eff.matmul
    assert times.fwd_s[0] == pytest.approx(1e12 / rate + 7.2e8 / (900e9 * eff.memory))
    assert times.bwd_s[0] == pytest.approx(2e12 / rate)


def test_shipped_trace_is_what_the_tracer_makes_today(tmp_path):
    from mpsim.cli import main

    out = tmp_path / "gpt.json"
    assert main(["trace", "--preset", "gpt-5.3b", "-o", str(out)]) == 0
    fresh = load_trace(str(out)).spec.model_dump()
    shipped = load_trace("gpt-5.3b").spec.model_dump()
    fresh["source"].pop("torch_version"), shipped["source"].pop("torch_version")
    assert fresh == shipped


def test_tracing_is_deterministic():
    cfg = ModelConfig("bert", 1, 256, 4, 128, 1000)
    assert trace_model(cfg, 2).to_json() == trace_model(cfg, 2).to_json()
