"""The cost model: the one place that turns a trace's per-layer FLOPs and bytes and a GPU
spec into seconds.

``cost_model(trace, gpu)`` gives a ``CostModel`` with, for every layer of the trace on that
GPU: its forward and backward seconds (``layer_times``), the forward seconds of its
attention core when selective recompute re-runs it (``attention_core_s``), and the
optimizer update seconds of any set of layers (``update_s``). Every memory-bound term of
the layer times and of the attention core runs at one rate, ``memory_rate``: the memory
bandwidth at the GPU's memory efficiency for the trace's rate datatype
(``GpuSpec.op_efficiency``). The optimizer update runs at ``update_rate`` (the GPU-wide
``memory_efficiency``; see there).

Models are cached by content: the trace's ``content_hash`` and the GPU spec's fields, so
equal contents give the same object however many traces or topologies were loaded
(``COST_MODELS`` are remembered per process). The arrays are read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpsim.caches import Lru
from mpsim.errors import MpsimError
from mpsim.hardware.gpu_tables import H100_LAYER_RMS_PCT, shipped_table
from mpsim.hardware.topology import Dtype, GpuSpec, OpEfficiency
from mpsim.timing.kernel_time import (
    ITEMSIZE,
    KernelRates,
    attention_pass_seconds,
    can_time,
    gemm_pass_seconds,
    launches,
    low_precision_flops,
    pass_seconds,
)

if TYPE_CHECKING:
    from mpsim.models.trace import LayerRow, Trace

__all__ = ["COST_MODELS", "ESTIMATE_TIME_BAND_PCT", "UNCHECKED_TIME_BAND_PCT", "CostModel", "LayerTimes",
           "attention_core_seconds", "cost_model", "peak_rates"]

UNCHECKED_TIME_BAND_PCT = H100_LAYER_RMS_PCT
"""The band of a time prediction on a GPU whose time model rests on kernel-level data of
that GPU but has not been checked against measured layers of it: the rms error of the
unfitted H100 kernel table on our measured H100 transformer-layer and head passes (bf16,
``reports/kernel_time.md``)."""
ESTIMATE_TIME_BAND_PCT = 2 * UNCHECKED_TIME_BAND_PCT
"""The band on a GPU with no kernel-level data of its own (its table transferred from
another GPU, or none): twice the measured band, a stated guess until kernel data of that
GPU checks it."""

COST_MODELS = 64
"""Cost models remembered per process (``cost_model``)."""
_MODELS: Lru[tuple[str, str], CostModel] = Lru(COST_MODELS)


@dataclass(frozen=True)
class LayerTimes:
    """Per-layer forward and backward seconds on one GPU model, and of each pass the seconds
    its GEMMs take and the kernels it launches (what a runtime profile's overlap and host
    dispatch act on, ``mpsim.timing.runtime``)."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    gemm_fwd_s: np.ndarray
    gemm_bwd_s: np.ndarray
    launches_fwd: np.ndarray
    launches_bwd: np.ndarray
    attention_fwd_s: np.ndarray
    """Per layer, the forward's seconds in fused attention kernels (what a context-parallel
    ring's sends hide behind, ``mpsim.sim.context_group``)."""
    attention_bwd_s: np.ndarray
    """The backward's likewise."""


def peak_rates(gpu: GpuSpec, dtype: Dtype) -> tuple[float, float]:
    """The GPU's peak FLOP/s at ``dtype`` (datasheet ``peak_tflops``) and its peak memory
    bytes/s (``memory_bandwidth_gbps``): the rates every efficiency is a fraction of."""
    return gpu.peak_tflops[dtype] * 1e12, gpu.memory_bandwidth_gbps * 1e9


@dataclass(frozen=True, eq=False)
class CostModel:
    """Seconds for one trace on one GPU model (build with ``cost_model``)."""

    dtype: Dtype
    """The datatype whose peak and efficiencies apply (``Trace.rate_dtype``)."""
    efficiency: OpEfficiency
    """The GPU's efficiencies at ``dtype`` (``GpuSpec.op_efficiency``)."""
    memory_rate: float
    """Bytes/s of memory-bound work in a layer: bandwidth x ``efficiency.memory``."""
    update_rate: float
    """Bytes/s of the optimizer update: bandwidth x the GPU-wide ``memory_efficiency``
    (``GpuSpec.memory_efficiency`` names the update as its use): Adam reads and writes
    fp32 master weights and moments whatever the layers' compute datatype, so the
    compute datatype's efficiency block does not apply to it."""
    layer_times: LayerTimes
    """Per-layer forward and backward seconds (``_layer_times``)."""
    kernel_rates: KernelRates | None
    """What timed the layers kernel by kernel (``mpsim.timing.kernel_time``); None: the roofline."""
    attention_core_s: np.ndarray
    """Per layer, the attention core's forward seconds (``attention_core_seconds`` at
    ``memory_rate``); 0 where the layer has no attention core."""

    gpu_model: str = ""
    """The GPU's model name (which shipped kernel data stands behind its figures)."""
    estimated: str = ""
    """Why the times are an estimate though the GPU has kernel data (a recipe's GEMM dtype its
    table has no rate for); empty otherwise."""

    def time_band(self) -> tuple[float, str]:
        """The relative error band of times made with this model, % (either side), and why:
        a checked kernel table's own residual; where the figures rest on kernel data of the
        GPU, its table's residual against them, at least ``UNCHECKED_TIME_BAND_PCT`` (kernels
        compose into layers with more error than each has alone); else
        ``ESTIMATE_TIME_BAND_PCT``."""
        if self.estimated:
            return ESTIMATE_TIME_BAND_PCT, f"time model an estimate: {self.estimated}; twice the band measured on H100"
        table = self.kernel_rates.table if self.kernel_rates else None
        if table is not None and table.checked and table.residual_pct is not None:
            return table.residual_pct, f"rms error of its kernel table against {table.checked}"
        shipped = table or shipped_table(self.gpu_model)
        if shipped is not None and shipped.basis == "kernel data":
            own = shipped.kernel_residual_pct
            kernels = (f"its kernel table is within {own:g}% rms of published kernel figures of this GPU, and "
                       if own is not None else "")
            return max(UNCHECKED_TIME_BAND_PCT, own or 0.0), (
                f"time model from kernel data of this GPU: {kernels}layers add more: the rms error of the unfitted "
                "H100 kernel table on measured H100 layers, a floor until this GPU's layers are measured")
        return ESTIMATE_TIME_BAND_PCT, ("time model an estimate: no kernel-level data of this GPU; twice the band "
                                        "measured on H100")

    def update_s(self, rows: list[LayerRow]) -> float:
        """Adam step of ``rows``, memory bound: read gradients, read and write master
        weights and moments, write the trained working weights (a frozen weight is not
        touched), at ``update_rate``."""
        n_bytes = sum(r.grad_bytes + 2 * r.optimizer_bytes + r.trained_param_bytes for r in rows)
        return n_bytes / self.update_rate


def cost_model(trace: Trace, gpu: GpuSpec) -> CostModel:
    """The cost model of ``trace`` on ``gpu``: the one made before for equal contents, else
    a new one (remembered, the least recently used forgotten past ``COST_MODELS``)."""
    return _MODELS.remember((trace.content_hash, gpu.model_dump_json()), lambda: _build(trace, gpu))


def kernel_rates(trace: Trace, gpu: GpuSpec) -> KernelRates | None:
    """What times ``trace``'s kernels on ``gpu``: None where the trace records no kernels or
    the GPU has no table for its rate dtype (``GpuSpec.kernel_table``)."""
    dtype = trace.rate_dtype(gpu)
    table = gpu.kernel_table()
    if table is None or not can_time(table, dtype) or not any(r.fwd_kernels for r in trace.layers):
        return None
    peak_flops_per_s, peak_bytes_per_s = peak_rates(gpu, dtype)
    low = trace.spec.precision.gemm_dtype
    if low is not None and not can_time(table, low):
        return None  # the table has no rate for the recipe's GEMMs: the roofline times them (_build)
    low_rates = None if low is None else KernelRates(table, low, peak_rates(gpu, low)[0], peak_bytes_per_s,
                                                     ITEMSIZE[low])
    return KernelRates(table, dtype, peak_flops_per_s, peak_bytes_per_s,
                       ITEMSIZE[trace.spec.precision.compute_dtype], low_rates)


def _build(trace: Trace, gpu: GpuSpec) -> CostModel:
    dtype = trace.rate_dtype(gpu)
    eff = gpu.op_efficiency(dtype)
    peak_flops_per_s, peak_bytes_per_s = peak_rates(gpu, dtype)
    rates = kernel_rates(trace, gpu)
    memory_rate = rates.stream_bytes_per_s if rates else peak_bytes_per_s * eff.memory
    times = _layer_times(trace, gpu, peak_flops_per_s * eff.matmul, peak_flops_per_s * eff.attention, memory_rate,
                         rates, _low_precision_rate(trace, gpu))
    core_s = attention_core_seconds(trace.layers, times.fwd_s, memory_rate)
    core_s.setflags(write=False)
    update_rate = rates.stream_bytes_per_s if rates else peak_bytes_per_s * gpu.memory_efficiency
    low = trace.spec.precision.gemm_dtype
    table = gpu.kernel_table()
    estimated = (f"its kernel table has no {low} GEMM rate, so the {trace.spec.precision.recipe} recipe runs on the "
                 "roofline's efficiencies" if low is not None and rates is None and table is not None else "")
    return CostModel(dtype, eff, memory_rate, update_rate, times, rates, core_s, gpu.model, estimated)


def _low_precision_rate(trace: Trace, gpu: GpuSpec) -> float | None:
    """A low-precision recipe's GEMM rate on ``gpu`` for the roofline (its dtype's peak times
    its matmul efficiency); None for the other recipes. One line when the GPU has no tensor
    cores of that dtype (no ``peak_tflops`` entry)."""
    low = trace.spec.precision.gemm_dtype
    if low is None:
        return None
    if low not in gpu.peak_tflops:
        raise MpsimError(f"{trace.name}: recipe {trace.spec.precision.recipe} runs its GEMMs in {low}, which the "
                         f"{gpu.model} has no tensor cores for (its peak_tflops: {', '.join(gpu.peak_tflops)}); "
                         "trace it with --recipe mixed-bf16 or mixed-fp16")
    return peak_rates(gpu, low)[0] * gpu.op_efficiency(low).matmul


def _layer_times(trace: Trace, gpu: GpuSpec, matmul_rate: float, attention_rate: float,
                 mem_rate: float, rates: KernelRates | None = None, low_rate: float | None = None) -> LayerTimes:
    """Seconds per layer: measured times where the trace has them, else the layer's kernels
    each timed from its shape (``mpsim.timing.kernel_time``, with ``rates``), else a roofline by op
    class, summed because a layer's ops run one after another:
    t = (FLOPs - attention FLOPs) / (peak x e_matmul) + attention FLOPs / (peak x e_attention)
    + bytes / (bandwidth x e_memory), with peak the rate datatype's (``Trace.rate_dtype``)
    and the efficiencies the GPU's for that datatype (``GpuSpec.op_efficiency``); backward
    likewise with the backward FLOPs (about twice the forward) and bytes."""

    def roofline_gemm_s(flops: float, attention_flops: float, kernels: list) -> float:
        """The pass's matmul FLOPs outside fused attention at the matmul rate, a low-precision
        recipe's FP8/FP4 GEMMs at theirs."""
        low = low_precision_flops(kernels) if low_rate else 0.0
        return (flops - attention_flops - low) / matmul_rate + (low / low_rate if low_rate else 0.0)

    def derived_s(flops: float, attention_flops: float, mem_bytes: float, kernels: list) -> float:
        if rates is not None and kernels:
            return pass_seconds(kernels, rates)
        gemms_s = roofline_gemm_s(flops, attention_flops, kernels)
        return gemms_s + attention_flops / attention_rate + mem_bytes / mem_rate

    def gemm_s(flops: float, attention_flops: float, kernels: list, whole_s: float) -> float:
        if rates is not None and kernels:
            return min(whole_s, gemm_pass_seconds(kernels, rates))
        return min(whole_s, roofline_gemm_s(flops, attention_flops, kernels))

    def attention_s(attention_flops: float, kernels: list, whole_s: float) -> float:
        """The pass's fused-attention seconds: its attention kernels timed, else its attention
        FLOPs at the attention rate, at most the pass's own (measured or derived) time."""
        if not attention_flops:
            return 0.0
        if rates is not None and kernels:
            return min(whole_s, attention_pass_seconds(kernels, rates))
        return min(whole_s, attention_flops / attention_rate)

    rows = trace.layers
    fwd = np.array([r.fwd_ms * 1e-3 if r.fwd_ms is not None
                    else derived_s(r.fwd_flops, r.fwd_attention_flops, r.fwd_mem_bytes, r.fwd_kernels) for r in rows])
    bwd = np.array([r.bwd_ms * 1e-3 if r.bwd_ms is not None
                    else derived_s(r.bwd_flops, r.bwd_attention_flops, r.bwd_mem_bytes, r.bwd_kernels) for r in rows])
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()):
        raise MpsimError(f"{trace.name}: layer times on a {gpu.model} are not finite numbers")
    gemm_fwd = np.array([gemm_s(r.fwd_flops, r.fwd_attention_flops, r.fwd_kernels, t) for r, t in zip(rows, fwd)])
    gemm_bwd = np.array([gemm_s(r.bwd_flops, r.bwd_attention_flops, r.bwd_kernels, t) for r, t in zip(rows, bwd)])
    launches_fwd = np.array([launches(r.fwd_kernels) for r in rows], dtype=np.int64)
    launches_bwd = np.array([launches(r.bwd_kernels) for r in rows], dtype=np.int64)
    attention_fwd = np.array([attention_s(r.fwd_attention_flops, r.fwd_kernels, t) for r, t in zip(rows, fwd)])
    attention_bwd = np.array([attention_s(r.bwd_attention_flops, r.bwd_kernels, t) for r, t in zip(rows, bwd)])
    arrays = (fwd, bwd, gemm_fwd, gemm_bwd, launches_fwd, launches_bwd, attention_fwd, attention_bwd)
    for a in arrays:
        a.setflags(write=False)
    return LayerTimes(*arrays)


def attention_core_seconds(rows: list[LayerRow], fwd_s: np.ndarray, memory_rate: float) -> np.ndarray:
    """Per layer, seconds the attention core's forward takes when selective recompute
    re-runs it (Korthikanti et al. 2022, section 4.2), as a share of the layer's own
    forward time ``fwd_s`` so that it follows however that time was made (roofline or
    measured). The layer's time splits into a memory part, its non-matmul bytes at
    ``memory_rate`` (the cost model's ``memory_rate``, the one its layer times use; at
    most the whole time), and a compute part, the rest; the core takes its bytes' share of
    the first and its FLOPs' share of the second. On a roofline time this is exactly
    attention_core_flops / flop rate + attention_core_mem_bytes / memory_rate; with
    per-op-class efficiencies the core's FLOPs run at the layer's blended rate."""
    out = np.zeros(len(rows))
    for k, r in enumerate(rows):
        if not r.attention_core_bytes:
            continue
        t = float(fwd_s[k])
        mem_s = min(t, r.fwd_mem_bytes / memory_rate)
        out[k] = (_share(r.attention_core_mem_bytes, r.fwd_mem_bytes) * mem_s
                  + _share(r.attention_core_flops, r.fwd_flops) * (t - mem_s))
    return out


def _share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0
