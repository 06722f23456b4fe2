"""The kernel-shape time model (mpsim.timing.kernel_time) on hand-built shapes and tables."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mpsim.hardware.gpu_tables import AttentionRate, GemmRate, GemmTile, KernelTable, family_of, shipped_table
from mpsim.hardware.kernel_records import AttentionKernel, ConvKernel, GemmKernel, MemoryKernel, rescale_kernel
from mpsim.timing.kernel_time import (
    KernelRates,
    attention_seconds,
    conv_seconds,
    gemm_seconds,
    kernel_seconds,
    pass_seconds,
)

SOURCES = {"sms": "test", "launch_floor_us": "test", "memory_fraction": "test", "gemm.fp16": "test",
           "gemm.fp32": "test", "attention.fp16": "test"}


def table(**changes) -> KernelTable:
    """10 SMs, one 100 x 100 tile at full rate, 5 us floor, half the bandwidth streamed."""
    fields = dict(sms=10, launch_floor_us=5.0, memory_fraction=0.5,
                  gemm={"fp16": GemmRate(fraction=0.5, tiles=[GemmTile(rows=100, cols=100, relative=1.0)]),
                        "fp32": GemmRate(fraction=1.0, tiles=[GemmTile(rows=100, cols=100, relative=1.0)])},
                  attention={"fp16": AttentionRate(fwd_fraction=0.5, bwd_fraction=0.25, fwd_half_seq=0,
                                                   bwd_half_seq=100, block_rows=100)},
                  winograd={"fp32": 2.25}, sources=SOURCES)
    fields.update(changes)
    return KernelTable.model_validate(fields)


def rates(dtype: str = "fp16", **changes) -> KernelRates:
    """1e12 FLOP/s peak (1e11 per SM), 1e12 B/s bandwidth, 2-byte elements."""
    return KernelRates(table(**changes), dtype, 1e12, 1e12, 2)  # type: ignore[arg-type]


def test_a_gemm_takes_whole_waves_of_tiles():
    """Per SM 1e11 x 0.5 FLOP/s; one 100 x 100 x k tile takes 2e4 k / 5e10 s. 10 tiles
    fill one wave; 11 take two; 20 still two."""
    one_tile_s = 2 * 100 * 100 * 1000 / 5e10
    assert gemm_seconds(1000, 100, 1000, 1, rates()) == pytest.approx(one_tile_s)
    assert gemm_seconds(1100, 100, 1000, 1, rates()) == pytest.approx(2 * one_tile_s)
    assert gemm_seconds(2000, 100, 1000, 1, rates()) == pytest.approx(2 * one_tile_s)
    assert gemm_seconds(1001, 100, 1000, 1, rates()) == pytest.approx(2 * one_tile_s)  # a partial tile is a tile


def test_the_batch_multiplies_the_tiles():
    assert gemm_seconds(100, 100, 1000, 11, rates()) == pytest.approx(gemm_seconds(1100, 100, 1000, 1, rates()))


def test_the_fastest_tile_wins():
    """With a 50 x 100 tile at 0.8 of the rate, 11 big tiles (2 waves) lose to 22 small
    ones (3 waves of half the work at 0.8: 3 x 0.5 / 0.8 = 1.875 < 2 big-tile times)."""
    tiles = [GemmTile(rows=100, cols=100, relative=1.0), GemmTile(rows=50, cols=100, relative=0.8)]
    r = rates(gemm={"fp16": GemmRate(fraction=0.5, tiles=tiles)})
    one_tile_s = 2 * 100 * 100 * 1000 / 5e10
    assert gemm_seconds(1100, 100, 1000, 1, r) == pytest.approx(1.875 * one_tile_s)
    assert gemm_seconds(1000, 100, 1000, 1, r) == pytest.approx(one_tile_s)


def test_a_small_kernel_costs_the_launch_floor():
    assert gemm_seconds(8, 8, 8, 1, rates()) == pytest.approx(5e-6)
    assert kernel_seconds(MemoryKernel(bytes=10), rates()) == pytest.approx(5e-6)


def test_a_gemv_is_memory_bound():
    """A 1 x 1 tile at 1e14 FLOP/s (5e12 per SM): m = 1000, n = 1, k = 1e6 is 100 waves of
    2e6 FLOPs, 4e-5 s; reading A (1e9 two-byte elements) takes 4e-3 s at 5e11 B/s."""
    r = KernelRates(table(gemm={"fp16": GemmRate(fraction=0.5, tiles=[GemmTile(rows=1, cols=1, relative=1.0)])}),
                    "fp16", 1e14, 1e12, 2)
    assert gemm_seconds(1000, 1, 10**6, 1, r) == pytest.approx((10**9 + 10**6 + 1000) * 2 / 5e11)


def test_memory_kernels_stream_at_the_table_share():
    assert kernel_seconds(MemoryKernel(bytes=10**9), rates()) == pytest.approx(10**9 / 5e11)
    assert pass_seconds([MemoryKernel(bytes=10**9, count=3), MemoryKernel(bytes=1, count=2)], rates()) == \
        pytest.approx(3 * 10**9 / 5e11 + 2 * 5e-6)


def test_attention_rises_with_the_key_length():
    """Backward: e(s) = 0.25 s / (s + 100); at s = 100 half of 0.25. 10 x 1 x 100-row blocks
    fill the 10 SMs exactly."""
    k = AttentionKernel(backward=True, batch=10, heads=1, kv_heads=1, s_q=100, s_k=100, head_dim=64)
    assert k.flops == 2 * 5 * 10 * 100 * 100 * 64
    assert attention_seconds(k, rates()) == pytest.approx(k.flops / (1e12 * 0.125))
    fwd = AttentionKernel(batch=10, heads=1, kv_heads=1, s_q=100, s_k=100, head_dim=64, causal=True)
    assert fwd.flops == pytest.approx(2 * 2 * 10 * 100 * 100 * 64 * (100 * 101 / 2) / 100**2)
    assert attention_seconds(fwd, rates()) == pytest.approx(fwd.flops / 5e11)


def test_attention_blocks_quantize_into_waves():
    """11 blocks over 10 SMs take two waves: 20/11 of the unquantized time."""
    k = AttentionKernel(batch=11, heads=1, kv_heads=1, s_q=100, s_k=100, head_dim=64)
    assert attention_seconds(k, rates()) == pytest.approx(k.flops / 5e11 * 20 / 11)


def test_winograd_divides_a_3x3_convolution_by_its_reduction():
    """fp32 on the table runs Winograd F(2x2,3x3): 2.25x fewer FLOPs than the implicit GEMM."""
    conv = ConvKernel.model_validate({"pass": "fwd", "n": 10, "c_in": 100, "h": 10, "w": 10, "c_out": 100, "r": 3,
                                      "s": 3, "p": 10, "q": 10})
    assert conv.gemm_shape() == (1000, 100, 900)
    r32 = rates("fp32")
    implicit = gemm_seconds(1000, 100, 900, 1, r32)
    assert conv_seconds(conv, r32) == pytest.approx(implicit / 2.25)
    strided = conv.model_copy(update={"stride": 2, "p": 5, "q": 5})
    assert conv_seconds(strided, r32) == pytest.approx(gemm_seconds(250, 100, 900, 1, r32))
    assert conv_seconds(conv, rates("fp16")) == pytest.approx(gemm_seconds(1000, 100, 900, 1, rates("fp16")))
    wgrad = conv.model_copy(update={"pass_": "wgrad"})
    assert wgrad.gemm_shape() == (100, 900, 1000)
    assert conv_seconds(wgrad, r32) == pytest.approx(gemm_seconds(100, 900, 1000, 1, r32))


def test_rescaling_grows_the_batch_dimension_only():
    g = GemmKernel(m=4096, n=1024, k=512, grows="m")
    assert rescale_kernel(g, 2.0) == g.model_copy(update={"m": 8192})
    wgrad = GemmKernel(m=1024, n=512, k=4096, grows="k")
    assert rescale_kernel(wgrad, 0.5).k == 2048
    mem = MemoryKernel(bytes=1000, fixed_bytes=200)
    assert rescale_kernel(mem, 3.0).bytes_ == 200 + 3 * 800
    att = AttentionKernel(batch=2, heads=8, kv_heads=8, s_q=64, s_k=64, head_dim=64)
    assert rescale_kernel(att, 2.0).batch == 4


def test_every_shipped_table_names_its_sources():
    for model, family in [("H100-SXM5-80GB", "hopper-sxm"), ("NVIDIA H100 80GB HBM3", "hopper-sxm"),
                          ("H100-PCIe-80GB", "hopper-pcie"), ("H200-SXM-141GB", "hopper-sxm"),
                          ("A100-SXM4-40GB", "ampere"), ("V100-SXM2-32GB", "volta"), ("TITAN-RTX", "turing"),
                          ("GTX-1080-Ti", "pascal"), ("B200-GB200-186GB", "blackwell"),
                          ("MI300X-OAM-192GB", "cdna3")]:
        assert family_of(model) == family
        t = shipped_table(model)
        assert t is not None and all(t.sources[k] for k in ("sms", "launch_floor_us", "memory_fraction"))
    assert family_of("Gaudi3") is None


def test_a_table_without_a_source_is_refused():
    with pytest.raises(ValueError, match="sources.gemm.fp16"):
        table(sources={k: v for k, v in SOURCES.items() if k != "gemm.fp16"})


def test_the_h100_table_reproduces_the_probe_it_came_from():
    """validate/results/h100/probe.yaml: an 8192^3 bf16 matmul ran at 769.0 TFLOP/s."""
    t = shipped_table("H100-SXM5-80GB")
    assert t is not None
    r = KernelRates(t, "bf16", 989e12, 3350e9, 2)
    assert 2 * 8192**3 / gemm_seconds(8192, 8192, 8192, 1, r) / 1e12 == pytest.approx(769.0, rel=2e-3)
    assert not math.isnan(t.gemm["bf16"].fraction)


def test_calibrate_fits_a_kernel_table_to_a_profiler_trace(tmp_path):
    """tests/data/kineto/h100_train_step.json: 8 bf16 kernels with shapes (GEMMs, attention,
    element-wise); the fitted table's classes are scaled by the printed multipliers and the
    written topology times its kernels with it."""
    import json

    from helpers import run_cli

    from mpsim.hardware.topology import read_topology_file

    profile = Path(__file__).parent / "data" / "kineto" / "h100_train_step.json"
    out, fit_json = tmp_path / "h100-fitted.yaml", tmp_path / "fit.json"
    code, text, _ = run_cli(120, "calibrate", "--profile", str(profile), "--server", "dgx-h100", "-o", str(out),
                            "--json", str(fit_json))
    assert code == 0 and "kernel table fitted to 8 profiled bf16 kernels" in text
    fit = json.loads(fit_json.read_text())
    gpu = read_topology_file(out).spec.gpu
    base = shipped_table("H100-SXM5-80GB")
    assert gpu.time_model == "kernels" and gpu.kernels is not None and base is not None
    assert gpu.kernels.gemm["bf16"].fraction == pytest.approx(base.gemm["bf16"].fraction / fit["multipliers"]["gemm"])
    assert gpu.kernels.checked == profile.name
    code, _, err = run_cli(60, "calibrate", "--server", "dgx-h100")
    assert code == 2 and "either --trace" in err


def test_the_a100_tables_kernel_residual_is_the_reports():
    """The A100 table's residual against published kernel figures, which its band names, is
    the one reports/kernel_time.md computes (benchmarks/kernel_time_report.py)."""
    import re

    from mpsim.hardware.gpu_tables import A100_KERNEL_RMS_PCT, SHIPPED

    text = (Path(__file__).resolve().parent.parent / "reports" / "kernel_time.md").read_text()
    found = re.search(r"A100-SXM4-80GB ([\d.]+)% \(\d+ rows\)", text)
    assert found is not None and float(found[1]) == A100_KERNEL_RMS_PCT == SHIPPED["ampere"].kernel_residual_pct
