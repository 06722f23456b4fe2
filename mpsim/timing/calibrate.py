"""``mpsim calibrate``: fit a GPU's per-operation-class efficiencies to a measured trace.

The cost model (``mpsim.timing.costs``) derives a layer's time from three op classes,

    t = F_matmul / (peak x e_matmul) + F_attention / (peak x e_attention) + bytes / (bandwidth x e_memory),

which is linear in the inverse efficiencies u = 1 / e. Each timed row of a measured trace
(a layer's forward or backward, ``fwd_ms``/``bwd_ms``) gives one equation
``x . u = t`` with x = (F_matmul / peak, F_attention / peak, bytes / bandwidth), all in
seconds at peak. Identical equations (the N copies of one transformer layer) count once.
The fit minimises the residuals in seconds, so each row weighs what it weighs in an
iteration, subject to u >= 0. (Relative residuals, tried first, let a 0.2 ms embedding
whose time is mostly kernel launches weigh as much as a 9 ms layer: on an H100 that
pulled the memory efficiency to 0.29 and pushed the matmul one above 1.) Several traces
of one precision on one device (``--trace`` repeated: other shapes, sequence lengths)
add their rows to one fit; differing mixes of matmul, attention and memory work are what
make the three efficiencies separable.

Non-negative least squares is solved exactly by enumeration: with at most three unknowns
there are at most seven supports; the least-squares solution on each support that is
non-negative everywhere is a candidate, and the candidate with the smallest residual is the
NNLS optimum (the problem is convex and its optimum is the unconstrained least-squares
solution on its own support). numpy's ``lstsq`` solves each support; scipy is not needed.

A class the trace gives no work to (no attention-kernel FLOPs with eager attention, say)
cannot be fitted; its efficiency is kept from the topology and the result says so.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mpsim.errors import MpsimError
from mpsim.hardware.ceilings import ceiling_for
from mpsim.hardware.topology import Dtype, GpuSpec, OpEfficiency, Topology, parse_topology
from mpsim.models.trace import Trace, measured_elsewhere
from mpsim.timing.costs import peak_rates

CLASSES = ("matmul", "attention", "memory")
_EXPLAINS = {"matmul": "matmul FLOPs", "attention": "attention-kernel FLOPs", "memory": "bytes moved"}


@dataclass(frozen=True)
class RowFit:
    """One timed row: measured and fitted milliseconds."""

    layer: str
    phase: str
    measured_ms: float
    fitted_ms: float

    @property
    def residual_pct(self) -> float:
        return 100.0 * (self.fitted_ms - self.measured_ms) / self.measured_ms


@dataclass(frozen=True)
class Calibration:
    """Fitted efficiencies for one precision, the rows they explain, and what was kept."""

    trace_name: str
    server: str
    dtype: Dtype
    efficiency: OpEfficiency
    fitted: tuple[str, ...]
    kept: dict[str, float] = field(default_factory=dict)
    rows: tuple[RowFit, ...] = ()

    @property
    def rms_residual_pct(self) -> float:
        return float(np.sqrt(np.mean([r.residual_pct ** 2 for r in self.rows])))

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace_name, "server": self.server, "dtype": self.dtype,
                "efficiency": self.efficiency.model_dump(), "fitted": list(self.fitted), "kept": self.kept,
                "rms_residual_pct": self.rms_residual_pct,
                "rows": [{"layer": r.layer, "phase": r.phase, "measured_ms": r.measured_ms,
                          "fitted_ms": r.fitted_ms, "residual_pct": r.residual_pct} for r in self.rows]}


def timed_rows(trace: Trace, gpu: GpuSpec, dtype: Dtype) -> tuple[np.ndarray, np.ndarray, list[tuple[str, str]]]:
    """The equations of a measured trace: x (seconds at peak per class), t (seconds), labels."""
    peak_flops_per_s, bytes_per_s = peak_rates(gpu, dtype)
    xs: list[list[float]] = []
    ts: list[float] = []
    labels: list[tuple[str, str]] = []
    for r in trace.layers:
        for phase, ms, flops, att, mem in (("fwd", r.fwd_ms, r.fwd_flops, r.fwd_attention_flops, r.fwd_mem_bytes),
                                           ("bwd", r.bwd_ms, r.bwd_flops, r.bwd_attention_flops, r.bwd_mem_bytes)):
            if ms is None:
                continue
            xs.append([(flops - att) / peak_flops_per_s, att / peak_flops_per_s, mem / bytes_per_s])
            ts.append(ms * 1e-3)
            labels.append((r.name, phase))
    return np.array(xs, dtype=float).reshape(-1, len(CLASSES)), np.array(ts, dtype=float), labels


def nnls_small(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a u - b|| subject to u >= 0, exactly, for a few columns (see the module doc)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b ** 2))
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            u = np.zeros(n)
            u[cols] = sol
            res = float(np.sum((a @ u - b) ** 2))
            if res < best_res:
                best, best_res = u, res
    return best


def _check_fittable(trace: Trace, x: np.ndarray, used: list[int], source: str) -> None:
    names = " and ".join(CLASSES[i] for i in used)
    distinct = len(np.unique(np.round(x[:, used], 15), axis=0))
    if distinct < len(used):
        raise MpsimError(f"{source}: {distinct} distinct timed row(s); fitting {names} needs at least {len(used)}")
    scaled = x[:, used] / np.maximum(x[:, used].max(axis=0), 1e-300)
    if np.linalg.matrix_rank(scaled, tol=1e-9) < len(used):
        raise MpsimError(f"{source}: the rows are proportional in {names} (singular fit): every layer has the "
                         "same mix of work, so their times cannot be told apart; measure a trace with differing "
                         "layers (embedding, transformer, head)")


def _check_measured(trace: Trace, topo: Topology, force: bool) -> None:
    source = trace.source or trace.name
    if not any(r.fwd_ms is not None or r.bwd_ms is not None for r in trace.layers):
        raise MpsimError(f"{source}: no measured times (fwd_ms/bwd_ms); calibrate needs a trace made with "
                         "`mpsim trace --measure`")
    elsewhere = measured_elsewhere(trace, topo.spec.gpu.model, topo.name)
    if elsewhere and not force:
        raise MpsimError(f"{elsewhere}; --force fits it anyway")


def _all_rows(traces: list[Trace], gpu: GpuSpec) -> tuple[Dtype, np.ndarray, np.ndarray, list[tuple[str, str]]]:
    """The timed rows of every trace, which must share one rate dtype and one device."""
    first = traces[0]
    dtype = first.rate_dtype(gpu)
    xs, ts, labels = [], [], []
    for tr in traces:
        name = tr.source or tr.name
        if tr.rate_dtype(gpu) != dtype:
            raise MpsimError(f"{name}: runs at {tr.rate_dtype(gpu)}, {first.source or first.name} at {dtype}; "
                             "calibrate one precision at a time")
        if tr.spec.source.device != first.spec.source.device:
            raise MpsimError(f"{name}: measured on {tr.spec.source.device}, {first.source or first.name} on "
                             f"{first.spec.source.device}; calibrate one device at a time")
        x, t, lab = timed_rows(tr, gpu, dtype)
        xs.append(x)
        ts.append(t)
        labels += [(f"{tr.name}:{layer}" if len(traces) > 1 else layer, phase) for layer, phase in lab]
    return dtype, np.vstack(xs), np.concatenate(ts), labels


def calibrate(traces: Trace | list[Trace], topo: Topology, force: bool = False) -> Calibration:
    """Fit the efficiencies of ``topo``'s GPU at the traces' rate dtype; refuse in one line
    (MpsimError) what cannot be fitted."""
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    trace = traces[0]
    source = ", ".join(tr.source or tr.name for tr in traces)
    gpu = topo.spec.gpu
    for tr in traces:
        _check_measured(tr, topo, force)
    dtype, x, t, labels = _all_rows(traces, gpu)
    used = [i for i in range(len(CLASSES)) if x[:, i].any()]
    if not used:
        raise MpsimError(f"{source}: the timed rows have no FLOPs and no bytes moved; nothing to fit")
    _check_fittable(trace, x, used, source)
    distinct = np.unique(np.column_stack([x[:, used], t]), axis=0)  # identical layers count once
    u = nnls_small(distinct[:, :-1], distinct[:, -1])
    before = gpu.op_efficiency(dtype)
    values = before.model_dump()
    for i, inv in zip(used, u, strict=True):
        name = CLASSES[i]
        if inv <= 0:
            raise MpsimError(f"{source}: the fit puts no time on {_EXPLAINS[name]} (efficiency unbounded); the "
                             f"rows cannot pin down {name}")
        _check_physical(name, 1.0 / inv, gpu, dtype, source, topo.name)
        values[name] = float(1.0 / inv)
    fitted = tuple(CLASSES[i] for i in used)
    kept = {c: values[c] for c in CLASSES if c not in fitted}
    when = datetime.date.today().isoformat()
    src = trace.spec.source
    values["source"] = (f"calibrated from {', '.join(Path(tr.source or tr.name).name for tr in traces)} "
                        f"({src.device or 'unknown device'}, "
                        f"torch {src.torch_version or '?'}) on {when}"
                        + (f"; {', '.join(kept)} kept from: {before.source}" if kept else ""))
    eff = OpEfficiency(**values)
    inv_all = np.array([1.0 / eff.matmul, 1.0 / eff.attention, 1.0 / eff.memory])
    rows = tuple(RowFit(name, phase, float(tm * 1e3), float(xi @ inv_all * 1e3))
                 for (name, phase), xi, tm in zip(labels, x, t, strict=True))
    return Calibration(", ".join(tr.name for tr in traces), topo.name, dtype, eff, fitted, kept, rows)


def _check_physical(name: str, fitted: float, gpu: GpuSpec, dtype: Dtype, source: str, server: str) -> None:
    """Refuse a fitted efficiency above 1, or above the best lone kernel of its class on the
    GPU (``mpsim.hardware.ceilings``): the additive model would be handing the class time
    that other kernels overlap, and the figure would rank the GPU too fast elsewhere."""
    if fitted > 1.0:
        raise MpsimError(f"{source}: the fitted {name} efficiency is {fitted:.3g}, above 1: the trace runs "
                         f"faster than {server}'s peak for {dtype}; check its peak_tflops and memory_bandwidth_gbps")
    c = ceiling_for(gpu.model, dtype)
    limit = {"matmul": c.gemm, "attention": c.attention, "memory": c.memory}[name]
    if fitted > limit + 1e-9:
        raise MpsimError(f"{source}: the fitted {name} efficiency is {fitted:.3g}, above {limit:g}, the best lone "
                         f"kernel on {gpu.model}: the additive model is handing {name} time that other kernels "
                         "overlap; fit the kernel table instead (mpsim calibrate --profile)")


def calibrated_topology(topo: Topology, cal: Calibration) -> dict[str, Any]:
    """The topology as a plain dict with the efficiency block for ``cal.dtype`` replaced;
    validated before it is returned."""
    spec = topo.spec.model_dump(by_alias=True, exclude_none=True)
    spec["gpu"].setdefault("efficiency", {})[cal.dtype] = cal.efficiency.model_dump()
    parse_topology(spec, "<calibrated>")  # either schema (1, or 2: tiers)
    return spec


def calibrated_yaml(topo: Topology, cal: Calibration) -> str:
    header = f"# {topo.name} with {cal.dtype} efficiencies calibrated by mpsim calibrate from {cal.trace_name}.\n"
    return header + yaml.safe_dump(calibrated_topology(topo, cal), sort_keys=False)
