"""Writes reports/kernel_time.md: the kernel-shape time model (mpsim.timing.kernel_time) against
public kernel benchmarks and against the H100 layer times we measured
(validate/results/h100/trace_*.json), per kernel class.

    python benchmarks/kernel_time_report.py > reports/kernel_time.md

The H100 layer rows are re-traced from their model shapes (FakeTensor, no GPU) so that the
kernels are recorded; the measured times are those of the record.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.gpu_tables import shipped_table
from mpsim.hardware.kernel_records import AttentionKernel
from mpsim.models.trace import read_trace_file
from mpsim.timing.calibrate_kernels import KERNEL_CLASSES, TimedPass, class_seconds, fit_kernel_table
from mpsim.timing.costs import kernel_rates
from mpsim.timing.kernel_time import KernelRates, attention_seconds, gemm_seconds

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "validate" / "results" / "h100"
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_H100_FWD = (309, 350, 362, 368, 370, 370)
FA2_H100_BWD = (214, 260, 291, 310, 318, 322)
"""FlashAttention-3 paper (arXiv 2407.08608), Fig. 5 and 6: FlashAttention-2 on H100 SXM5,
head dim 128, no causal mask, batch x sequence = 16k tokens, 2048 hidden (16 heads), TFLOP/s."""


def _h100_rates() -> KernelRates:
    table = shipped_table("H100-SXM5-80GB")
    assert table is not None
    return KernelRates(table, "bf16", 989e12, 3350e9, 2)


def attention_rows() -> list[str]:
    rates = _h100_rates()
    lines = ["| seq | fwd published | fwd predicted | error | bwd published | bwd predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for s, fwd, bwd in zip(SEQS, FA2_H100_FWD, FA2_H100_BWD, strict=True):
        cells = [str(s)]
        for backward, published in ((False, fwd), (True, bwd)):
            k = AttentionKernel(backward=backward, batch=16384 // s, heads=16, kv_heads=16, s_q=s, s_k=s,
                                head_dim=128)
            predicted = k.flops / attention_seconds(k, rates) / 1e12
            cells += [str(published), f"{predicted:.0f}", f"{100 * (predicted - published) / published:+.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def gemm_rows() -> list[str]:
    """The H100 bf16 GEMM's rate at the probe's size and at sizes one tile past a full wave."""
    rates = _h100_rates()
    lines = ["| m x n x k | predicted TFLOP/s | waves of 128x256 tiles |", "|---|---|---|"]
    for m, n, k in ((8192, 8192, 8192), (4096, 4096, 4096), (16896, 256, 8192), (16897, 256, 8192),
                    (8192, 1024, 4096), (1024, 1024, 1024), (256, 256, 256)):
        tiles = -(-m // 128) * -(-n // 256)
        lines.append(f"| {m} x {n} x {k} | {2 * m * n * k / gemm_seconds(m, n, k, 1, rates) / 1e12:.0f} | "
                     f"{tiles / 132:.2f} |")
    return lines


def _passes(gpu) -> dict[str, tuple[list[TimedPass], KernelRates]]:
    """Per dtype, every measured shape's passes together, and the rates they were timed at."""
    out: dict[str, tuple[list[TimedPass], KernelRates]] = {}
    for dtype, shapes in _measured_shapes(gpu).items():
        out[dtype] = ([p for shape in shapes for p in shape[1]], shapes[0][4])
    return out


def layer_rows() -> list[str]:
    gpu = load_topology("h100-x1").spec.gpu.model_copy(update={"time_model": "kernels"})
    lines = []
    for dtype, (passes, rates) in _passes(gpu).items():
        fit = fit_kernel_table(passes, rates, "the H100 layer records")
        lines += ["", f"### {dtype}: {len(fit.rows)} distinct measured passes", "",
                  "| pass | measured ms | predicted ms | error | GEMM share | attention share | memory share |",
                  "|---|---|---|---|---|---|---|"]
        errors = []
        for p in passes:
            by_class = class_seconds(p.kernels, rates)
            predicted = float(by_class.sum())
            if any(r[0] == p.label for r in fit.rows):
                share = by_class / predicted
                err = 100 * (predicted - p.measured_s) / p.measured_s
                errors.append((p.label, err))
                lines.append(f"| {p.label} | {p.measured_s * 1e3:.3f} | {predicted * 1e3:.3f} | {err:+.1f}% | "
                             + " | ".join(f"{x:.0%}" for x in share) + " |")
        layers = [e for label, e in errors if "embedding" not in label]
        mult = ", ".join(f"{c} x{fit.multipliers[c]:.3f}" for c in KERNEL_CLASSES)
        lines += ["", f"Unfitted table: rms error {np.sqrt(np.mean(np.square(layers))):.1f}% over the "
                      f"{len(layers)} transformer-layer and head passes (embeddings apart: their backward is a "
                      "scatter-add the model times as streaming). "
                      f"Per-class fit to these passes (in-sample; `mpsim.timing.calibrate_kernels`): {mult}, rms "
                      f"{fit.rms_residual_pct:.1f}% over all {len(fit.rows)} passes."]
    return lines


def _measured_shapes(gpu) -> dict[str, list[tuple[str, list[TimedPass], object, object, KernelRates]]]:
    """Per dtype, each measured H100 shape: its stem, its passes (kernel model, labelled
    "stem layer phase"), its measured trace, its FakeTensor trace (the roofline, which must
    not see measured times) and the rates its kernels are timed at on ``gpu``."""
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import ModelConfig

    out: dict[str, list] = {}
    for path in sorted(RECORDS.glob("trace_*.json")):
        measured = read_trace_file(path)
        shape = {k: v for k, v in measured.spec.model.items() if k in ModelConfig.__dataclass_fields__}
        traced = trace_model(ModelConfig(**shape), measured.microbatch, measured.spec.precision.recipe)
        rates = kernel_rates(traced, gpu)
        assert rates is not None
        passes = [TimedPass(f"{path.stem} {m.name} {phase}", ms * 1e-3, kernels)
                  for m, t in zip(measured.layers, traced.layers, strict=True)
                  for phase, ms, kernels in (("fwd", m.fwd_ms, t.fwd_kernels), ("bwd", m.bwd_ms, t.bwd_kernels))
                  if ms is not None]
        out.setdefault(rates.dtype, []).append((path.stem, passes, measured, traced, rates))
    return out


def _rms(errors: list[float]) -> float:
    return float(np.sqrt(np.mean(np.square(errors))))


def held_out_rows() -> list[str]:
    """Each time model fitted to all measured shapes of a precision but one, and judged on
    that one (transformer-layer and head passes; embeddings apart, as above): how far each
    is off away from its calibration points."""
    from mpsim.timing.calibrate import calibrate
    from mpsim.timing.costs import cost_model

    topo = load_topology("h100-x1")
    lines = ["| precision | held-out shape | roofline, efficiencies fitted to the others | kernel table, fitted to "
             "the others | kernel table, unfitted |", "|---|---|---|---|---|"]
    pooled: dict[str, list[float]] = {"roofline": [], "kernels": []}
    gpu = topo.spec.gpu.model_copy(update={"time_model": "kernels"})
    for dtype, shapes in _measured_shapes(gpu).items():
        if len(shapes) < 3:
            continue  # two shapes: one left to fit three efficiencies from, which is singular
        for i, (stem, passes, _measured, traced, rates) in enumerate(shapes):
            others = [s for j, s in enumerate(shapes) if j != i]
            try:
                cal = calibrate([s[2] for s in others], topo, force=True)
            except MpsimError as exc:  # the additive fit can leave the physical range
                cal, refused = None, str(exc).split(": ", 1)[1]
            times = None
            if cal is not None:
                gpu = topo.spec.gpu.model_copy(update={"time_model": "roofline",
                                                       "efficiency": {**(topo.spec.gpu.efficiency or {}),
                                                                      dtype: cal.efficiency}})
                times = cost_model(traced, gpu).layer_times
            fit = fit_kernel_table([p for s in others for p in s[1]], rates, "the other shapes")
            fitted = dataclasses.replace(rates, table=fit.table)
            roof, kern, raw = [], [], []
            for p in passes:
                if "embedding" in p.label:
                    continue
                if times is not None:
                    row = next(k for k, r in enumerate(traced.layers) if p.label.split()[1] == r.name)
                    predicted = (times.bwd_s if p.label.endswith("bwd") else times.fwd_s)[row]
                    roof.append(100 * (predicted - p.measured_s) / p.measured_s)
                kern.append(100 * (float(class_seconds(p.kernels, fitted).sum()) - p.measured_s) / p.measured_s)
                raw.append(100 * (float(class_seconds(p.kernels, rates).sum()) - p.measured_s) / p.measured_s)
            pooled["roofline"] += roof
            pooled["kernels"] += kern
            roofline = f"{_rms(roof):.1f}%" if roof else f"no fit ({refused})"
            lines.append(f"| {dtype} | {stem} | {roofline} | {_rms(kern):.1f}% | {_rms(raw):.1f}% |")
    lines += ["", f"Pooled over the held-out passes: roofline {_rms(pooled['roofline']):.1f}% rms where its fit stays "
                  f"physical ({len(pooled['roofline'])} passes), kernel table {_rms(pooled['kernels']):.1f}% "
                  f"({len(pooled['kernels'])} passes). Neither is checked on other GPUs; the default stays the "
                  "roofline until the kernel tables are checked against profiles (`validate/gpu_checks.sh`)."]
    return lines


def main() -> None:
    lines = ["# Kernel-shape time against kernel benchmarks and measured layers", "",
             "Made by `python benchmarks/kernel_time_report.py`; the model is `mpsim/timing/kernel_time.py`, the "
             "tables `mpsim/hardware/gpu_tables.py`. Kernel tables are opt-in (`gpu.time_model: kernels` in a "
             "topology file); under the default `auto` no shipped table is used yet, since none has been checked "
             "against kernel-level profiles of its GPU.", "",
             "## Attention: FlashAttention-2 on H100 (bf16, head dim 128), TFLOP/s", "",
             "Published: FlashAttention-3 paper Fig. 5/6. The table's long-sequence fractions come from the 16k "
             "points and its half-length from the 512 points; 1k to 8k are out of sample.", ""]
    lines += attention_rows()
    lines += ["", "## GEMM: H100 bf16, predicted rate by shape", "",
              "The fraction comes from our probe's 8192^3 matmul (769.0 TFLOP/s, validate/results/h100/probe.yaml)."
              " One tile past a full wave (16897 rows) costs a whole extra wave.", ""]
    lines += gemm_rows()
    lines += ["", "## Layers: H100 records, per pass", "",
              "Measured: `mpsim trace --measure` on an H100 80GB HBM3 (torch 2.11.0+cu130). Predicted: the shipped "
              "H100 table, not fitted to these rows; shares are each kernel class's part of the predicted time."]
    lines += layer_rows()
    lines += ["", "## Away from the calibration points: fit on the other shapes, judge on one", "",
              "rms error over the held-out shape's transformer-layer and head passes. The roofline is mpsim's "
              "default time model (per-class efficiencies, `mpsim calibrate --trace`); the kernel table is "
              "`mpsim.timing.kernel_time` (`mpsim calibrate --profile` fits its per-class factors).", ""]
    lines += held_out_rows()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
