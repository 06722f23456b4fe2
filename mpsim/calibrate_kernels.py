"""Fit a GPU's kernel table (``mpsim.gpu_tables``) to measured layer times.

The kernel-shape model (``mpsim.kernel_time``) times a layer's pass as the sum of its
kernels, which split into three classes: GEMMs and convolutions, fused attention, and
memory-bound kernels (their launch floors included). Scaling a class's rate by 1 / u
scales its seconds by u, so a measured pass gives one equation linear in the three
multipliers,

    t_measured = u_gemm t_gemm + u_attention t_attention + u_memory t_memory,

with each t the class's seconds under the table being fitted. Identical equations count
once; the residuals are in seconds, so each row weighs what it weighs in an iteration; the
multipliers are non-negative (``calibrate.nnls_small``). The fitted table divides the
GEMM fractions by u_gemm, the attention fractions by u_attention, the memory fraction by
u_memory and multiplies the launch floor by u_memory. A class the rows give no time to is
kept. This is the per-class fit of ``mpsim.calibrate`` with the kernel model's seconds in
place of FLOPs at peak: what it adds is the shapes (waves, sequence lengths, launches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpsim.calibrate import nnls_small
from mpsim.gpu_tables import GemmRate, KernelTable
from mpsim.kernel_records import AttentionKernel, Kernel, MemoryKernel
from mpsim.kernel_time import KernelRates, kernel_seconds

KERNEL_CLASSES = ("gemm", "attention", "memory")


def class_seconds(kernels: list[Kernel], rates: KernelRates) -> np.ndarray:
    """Seconds of a pass's kernels per class (``KERNEL_CLASSES``)."""
    out = np.zeros(len(KERNEL_CLASSES))
    for k in kernels:
        cls = 2 if isinstance(k, MemoryKernel) else 1 if isinstance(k, AttentionKernel) else 0
        out[cls] += kernel_seconds(k, rates) * k.count
    return out


@dataclass(frozen=True)
class TimedPass:
    """One measured pass: its label, measured seconds and kernels."""

    label: str
    measured_s: float
    kernels: list[Kernel]


@dataclass(frozen=True)
class KernelFit:
    table: KernelTable
    multipliers: dict[str, float]
    """Per class, the factor its seconds were scaled by (1 where kept)."""
    kept: tuple[str, ...]
    rows: tuple[tuple[str, float, float], ...]
    """(label, measured s, fitted s) per distinct pass."""

    @property
    def rms_residual_pct(self) -> float:
        return float(np.sqrt(np.mean([(100 * (f - m) / m) ** 2 for _, m, f in self.rows])))


def fit_kernel_table(passes: list[TimedPass], rates: KernelRates, checked: str) -> KernelFit:
    """The table of ``rates`` fitted to ``passes`` (module doc); ``checked`` names them."""
    seen: dict[tuple, TimedPass] = {}
    for p in passes:
        seen.setdefault((round(p.measured_s, 9), tuple(class_seconds(p.kernels, rates).round(12))), p)
    distinct = list(seen.values())
    x = np.array([class_seconds(p.kernels, rates) for p in distinct])
    t = np.array([p.measured_s for p in distinct])
    active = [c for c in range(len(KERNEL_CLASSES)) if x[:, c].any()]
    u = np.ones(len(KERNEL_CLASSES))
    u[active] = nnls_small(x[:, active], t)
    u = np.where(u > 0, u, 1.0)
    table = scaled_table(rates.table, dict(zip(KERNEL_CLASSES, u, strict=True)), checked)
    fitted = x @ u
    kept = tuple(KERNEL_CLASSES[c] for c in range(len(KERNEL_CLASSES)) if c not in active)
    return KernelFit(table, dict(zip(KERNEL_CLASSES, u.tolist(), strict=True)), kept,
                     tuple((p.label, p.measured_s, float(f)) for p, f in zip(distinct, fitted, strict=True)))


def scaled_table(table: KernelTable, multipliers: dict[str, float], checked: str) -> KernelTable:
    """``table`` with each class's rate divided by its multiplier (module doc)."""
    ug, ua, um = (multipliers[c] for c in KERNEL_CLASSES)
    gemm = {d: GemmRate(fraction=min(1.0, r.fraction / ug), tiles=r.tiles) for d, r in table.gemm.items()}
    attention = {d: r.model_copy(update={"fwd_fraction": min(1.0, r.fwd_fraction / ua),
                                         "bwd_fraction": min(1.0, r.bwd_fraction / ua)})
                 for d, r in table.attention.items()}
    note = f"; scaled by the fit to {checked}"
    sources = {k: v + note for k, v in table.sources.items()}
    return table.model_copy(update={
        "gemm": gemm, "attention": attention, "memory_fraction": min(1.0, table.memory_fraction / um),
        "launch_floor_us": table.launch_floor_us * um, "sources": sources, "checked": checked})
