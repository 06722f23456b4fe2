"""Per-op-class efficiencies in layer_times, and `mpsim calibrate` fitting them back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from helpers import layer, topology_dict, trace_dict
from pydantic import ValidationError

from mpsim.cli import main
from mpsim.data.catalog import load_topology, shipped_topologies
from mpsim.errors import MpsimError
from mpsim.hardware.topology import OpEfficiency, parse_topology
from mpsim.models.trace import Trace, parse_trace
from mpsim.timing.calibrate import calibrate, calibrated_topology, nnls_small
from mpsim.timing.costs import cost_model

PEAK = 1e12  # the tiny server: 1 TFLOP/s fp16, 1 GB/s
BW = 1e9
TRUE = {"matmul": 0.6, "attention": 0.4, "memory": 0.75}


def server(efficiency: dict | None = None, **gpu: object):
    d = topology_dict(n_gpus=1)
    del d["nvlink"]
    d["gpu"].update(gpu)
    if efficiency is not None:
        d["gpu"]["efficiency"] = efficiency
    return parse_topology(d, "tiny.yaml")


def row(name: str, flops: float, att: float, mem: float, bwd_factor: float = 2.0, timed: dict | None = None) -> dict:
    r = layer(name, fwd_ms=None, bwd_ms=None, flops=flops)  # type: ignore[arg-type]
    r.update(bwd_flops=bwd_factor * flops, fwd_attention_flops=att, bwd_attention_flops=2.5 * att,
             fwd_mem_bytes=mem, bwd_mem_bytes=1.5 * mem)
    if timed:
        r.update(timed)
    return r


def model_s(flops: float, att: float, mem: float, eff: dict) -> float:
    return (flops - att) / (PEAK * eff["matmul"]) + att / (PEAK * eff["attention"]) + mem / (BW * eff["memory"])


def model_ms(flops: float, att: float, mem: float, eff: dict) -> float:
    return 1e3 * model_s(flops, att, mem, eff)


def measured(rows: list[dict], eff: dict, noise: np.ndarray | None = None, device: str = "toy") -> Trace:
    """Rows timed by the model itself at efficiencies ``eff`` (times noise factors)."""
    out = []
    for i, r in enumerate(rows):
        f = model_ms(r["fwd_flops"], r["fwd_attention_flops"], r["fwd_mem_bytes"], eff)
        b = model_ms(r["bwd_flops"], r["bwd_attention_flops"], r["bwd_mem_bytes"], eff)
        if noise is not None:
            f, b = f * noise[2 * i], b * noise[2 * i + 1]
        out.append(dict(r, fwd_ms=f, bwd_ms=b))
    d = trace_dict(out)
    d["source"] = {"kind": "measured", "device": device, "torch_version": "2.13.0"}
    return parse_trace(d, "measured.json")


# Times of the order of a real layer's: memory-bound embedding, matmul-bound head, layers in between.
ROWS = [row("embedding", 1e9, 0.0, 4e7), row("layer0", 8e10, 1e10, 2e7), row("layer1", 8e10, 1e10, 2e7),
        row("long", 8e10, 5e10, 2e7), row("head", 3e10, 0.0, 5e6, bwd_factor=2.2)]


# -- layer_times -------------------------------------------------------------------------

@pytest.mark.parametrize("flops, att, mem", [(1e12, 0.0, 0.0), (1e12, 8e11, 0.0), (0.0, 0.0, 3e9),
                                             (2e12, 5e11, 7e8)])
def test_layer_times_is_the_formula_for_each_class(flops, att, mem):
    topo = server(efficiency={"fp16": dict(TRUE, source="test")})
    t = parse_trace(trace_dict([row("a", flops, att, mem)]), "t.json")
    times = cost_model(t, topo.spec.gpu).layer_times
    assert times.fwd_s[0] == model_s(flops, att, mem, TRUE)
    assert times.bwd_s[0] == model_s(2 * flops, 2.5 * att, 1.5 * mem, TRUE)


def test_measured_times_win_over_the_formula():
    topo = server(efficiency={"fp16": dict(TRUE, source="test")})
    t = parse_trace(trace_dict([row("a", 1e12, 0.0, 0.0, timed={"fwd_ms": 3.0, "bwd_ms": 4.0})]), "t.json")
    times = cost_model(t, topo.spec.gpu).layer_times
    assert (times.fwd_s[0], times.bwd_s[0]) == (3e-3, 4e-3)


def test_without_the_block_times_are_todays():
    topo = server(matmul_efficiency=0.5, memory_efficiency=0.8)
    t = parse_trace(trace_dict([row("a", 2e12, 5e11, 7e8)]), "t.json")
    times = cost_model(t, topo.spec.gpu).layer_times
    assert times.fwd_s[0] == pytest.approx(2e12 / (PEAK * 0.5) + 7e8 / (BW * 0.8), rel=1e-12)
    assert times.bwd_s[0] == pytest.approx(4e12 / (PEAK * 0.5) + 1.05e9 / (BW * 0.8), rel=1e-12)


def test_a_precision_the_block_lacks_falls_back():
    topo = server(efficiency={"fp32": dict(TRUE, source="test")}, peak_tflops={"fp16": 1.0, "fp32": 1.0},
                  matmul_efficiency=0.5, memory_efficiency=0.8)
    eff = topo.spec.gpu.op_efficiency("fp16")
    assert (eff.matmul, eff.attention, eff.memory) == (0.5, 0.5, 0.8)


@pytest.mark.parametrize("bad", [{"matmul": 0.0}, {"matmul": 1.2}, {"memory": -0.1}, {"source": ""},
                                 {"source": "   "}, {"extra": 1}])
def test_efficiency_block_is_strict(bad):
    with pytest.raises(ValidationError):
        OpEfficiency(**{**TRUE, "source": "x", **bad})


def test_efficiency_needs_a_peak_for_its_dtype():
    with pytest.raises(Exception, match="no peak_tflops.bf16"):
        server(efficiency={"bf16": dict(TRUE, source="x")})


def test_shipped_files_validate_and_every_efficiency_has_a_source():
    for name in shipped_topologies():
        gpu = load_topology(name).spec.gpu
        assert gpu.efficiency, f"{name} has no efficiency block"
        for dtype, eff in gpu.efficiency.items():
            assert dtype in gpu.peak_tflops
            assert eff.source.strip(), f"{name}.{dtype}"
            assert 0 < min(eff.matmul, eff.attention, eff.memory) <= max(eff.matmul, eff.attention, eff.memory) <= 1


# -- calibrate -----------------------------------------------------------------------------

def test_nnls_small_matches_a_known_nonnegative_solution():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert np.allclose(nnls_small(a, np.array([1.0, 2.0, 3.0])), [1.0, 2.0])
    # unconstrained least squares would give a negative second coefficient; NNLS clamps it to 0
    u = nnls_small(a, np.array([1.0, -1.0, 0.0]))
    assert u[1] == 0 and u[0] == pytest.approx(0.5)


def test_synthetic_trace_is_fitted_back_exactly():
    topo = server()
    cal = calibrate(measured(ROWS, TRUE), topo)
    assert cal.fitted == ("matmul", "attention", "memory")
    for k, v in TRUE.items():
        assert getattr(cal.efficiency, k) == pytest.approx(v, abs=1e-6)
    assert max(abs(r.residual_pct) for r in cal.rows) < 1e-6
    assert cal.efficiency.source.startswith("calibrated from measured.json (toy, torch 2.13.0) on ")


def test_noise_keeps_the_fit_close():
    noise = 1 + 0.01 * np.random.default_rng(0).standard_normal(2 * len(ROWS))
    cal = calibrate(measured(ROWS, TRUE, noise), server())
    for k, v in TRUE.items():
        assert getattr(cal.efficiency, k) == pytest.approx(v, rel=0.05)


def test_a_launch_bound_row_does_not_pull_the_fit():
    """A tiny embedding whose time is mostly kernel launches (5x the model's) moves the
    fitted efficiencies by what it weighs in the iteration, not as much as a layer."""
    rows = [row("embedding", 0.0, 0.0, 2e5), row("layer0", 8e10, 1e10, 2e7), row("long", 8e10, 5e10, 2e7),
            row("head", 3e10, 0.0, 5e6, bwd_factor=2.2), row("mlp", 4e10, 0.0, 4e7)]
    noise = np.ones(2 * len(rows))
    noise[:2] = 5.0
    cal = calibrate(measured(rows, TRUE, noise), server())
    for k, v in TRUE.items():
        assert getattr(cal.efficiency, k) == pytest.approx(v, rel=0.02)


def test_two_traces_fit_together_what_neither_can_alone():
    """Each trace has one timed shape (its rows proportional: singular alone); together
    the differing mixes pin all three efficiencies."""
    a = measured([row("layer0", 8e10, 1e10, 2e7)], TRUE)
    b = measured([row("layer0", 8e10, 5e10, 4e7)], TRUE)
    with pytest.raises(MpsimError, match="distinct timed row"):
        calibrate(a, server())
    cal = calibrate([a, b], server())
    for k, v in TRUE.items():
        assert getattr(cal.efficiency, k) == pytest.approx(v, abs=1e-6)
    assert len(cal.rows) == 4 and max(abs(r.residual_pct) for r in cal.rows) < 1e-6


def test_traces_of_two_precisions_or_devices_are_refused():
    a = measured(ROWS, TRUE)
    with pytest.raises(MpsimError, match="one device at a time"):
        calibrate([a, measured(ROWS, TRUE, device="other")], server())


def test_no_attention_flops_fits_matmul_and_memory_and_keeps_attention():
    rows = [row("embedding", 1e9, 0.0, 4e8), row("layer0", 8e10, 0.0, 2e9), row("head", 3e10, 0.0, 5e8)]
    topo = server(efficiency={"fp16": {"matmul": 0.3, "attention": 0.33, "memory": 0.5, "source": "old"}})
    cal = calibrate(measured(rows, TRUE), topo)
    assert cal.fitted == ("matmul", "memory") and cal.kept == {"attention": 0.33}
    assert cal.efficiency.matmul == pytest.approx(0.6, abs=1e-6)
    assert "attention kept from: old" in cal.efficiency.source


def test_calibrated_topology_replaces_only_that_precision(tmp_path):
    topo = server(efficiency={"fp16": {"matmul": 0.3, "attention": 0.3, "memory": 0.5, "source": "old"}},
                  peak_tflops={"fp16": 1.0, "fp32": 0.5})
    spec = calibrated_topology(topo, calibrate(measured(ROWS, TRUE), topo))
    assert spec["gpu"]["efficiency"]["fp16"]["matmul"] == pytest.approx(0.6)
    assert spec["gpu"]["peak_tflops"] == {"fp16": 1.0, "fp32": 0.5}


def _cli(tmp_path, trace: Trace, *args: str) -> int:
    path = tmp_path / "m.json"
    path.write_text(trace.to_json())
    spec = topology_dict(n_gpus=1)
    del spec["nvlink"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    return main(["calibrate", "--trace", str(path), "--server", str(tmp_path / "s.yaml"), *args])


def test_cli_writes_json_and_a_topology_that_loads(tmp_path, capsys):
    out = tmp_path / "cal.yaml"
    assert _cli(tmp_path, measured(ROWS, TRUE), "-o", str(out), "--json", "-") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["efficiency"]["attention"] == pytest.approx(0.4, abs=1e-6)
    assert len(result["rows"]) == 2 * len(ROWS)
    gpu = load_topology(str(out)).spec.gpu
    assert gpu.efficiency is not None and gpu.efficiency["fp16"].memory == pytest.approx(0.75, abs=1e-6)


def _one_line_error(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def test_refuses_a_derived_trace(tmp_path, capsys):
    t = parse_trace(trace_dict([row("a", 1e12, 0.0, 1e9)]), "t.json")
    _one_line_error(capsys, _cli(tmp_path, t), "no measured times")


def test_refuses_a_trace_measured_on_another_device_unless_forced():
    t = measured(ROWS, TRUE, device="cpu (x86_64, 1 thread)")
    v100 = server(model="V100-SXM2-32GB")
    with pytest.raises(MpsimError, match="--force") as err:
        calibrate(t, v100)
    assert "\n" not in str(err.value)
    assert calibrate(t, v100, force=True).efficiency.matmul == pytest.approx(0.6, abs=1e-6)


def test_refuses_too_few_distinct_rows(tmp_path, capsys):
    _one_line_error(capsys, _cli(tmp_path, measured([row("layer0", 8e10, 1e10, 2e9)], TRUE)),
                    "2 distinct timed row(s)", "needs at least 3")


def test_refuses_a_singular_fit(tmp_path, capsys):
    rows = [row("a", 1e10, 0.0, 1e9, bwd_factor=1.5), row("b", 2e10, 0.0, 2e9, bwd_factor=1.5)]
    _one_line_error(capsys, _cli(tmp_path, measured(rows, TRUE)), "singular")


def test_refuses_efficiencies_above_one(tmp_path, capsys):
    fast = dict(TRUE, matmul=2.0)
    _one_line_error(capsys, _cli(tmp_path, measured(ROWS, fast)), "above 1", "peak_tflops")


def test_a_tiered_server_is_calibrated_like_any_other():
    """``calibrated_topology`` validated the result as a schema-1 file: a schema-2 (tiers)
    server such as the MI300X failed with a raw pydantic error."""
    from mpsim.data.catalog import load_topology
    from mpsim.hardware.topology import parse_topology

    topo = load_topology("mi300x-x8")
    cal = calibrate(measured(ROWS, TRUE), topo)
    spec = calibrated_topology(topo, cal)
    assert spec["schema"] == 2 and spec["gpu"]["efficiency"][cal.dtype]["matmul"] == cal.efficiency.matmul
    assert parse_topology(spec, "again").n_gpus == 8
