"""Fit a GPU's kernel table (``mpsim.hardware.gpu_tables``) to measured layer times.

The kernel-shape model (``mpsim.timing.kernel_time``) times a layer's pass as the sum of its
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
kept. This is the per-class fit of ``mpsim.timing.calibrate`` with the kernel model's seconds in
place of FLOPs at peak: what it adds is the shapes (waves, sequence lengths, launches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpsim.hardware.gpu_tables import GemmRate, KernelTable
from mpsim.hardware.kernel_records import AttentionKernel, ConvKernel, GemmKernel, Kernel, MemoryKernel
from mpsim.models.profile_import import ConvShape, KernelSample, Profile
from mpsim.timing.calibrate import nnls_small
from mpsim.timing.kernel_time import KernelRates, kernel_seconds

if TYPE_CHECKING:
    from mpsim.hardware.topology import Topology

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
    fitted = x @ u
    rms_pct = float(np.sqrt(np.mean(np.square(100 * (fitted - t) / t))))
    table = scaled_table(rates.table, dict(zip(KERNEL_CLASSES, u, strict=True)), checked).model_copy(
        update={"residual_pct": round(rms_pct, 2)})
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


# --- from a profiler trace ----------------------------------------------------------------


def sample_kernel(sample: KernelSample) -> Kernel | None:
    """The kernel record of one profiled kernel whose shape the trace gives (its launching
    op's ``Input Dims``), else None. A convolution's backward op launches its data and
    weight gradients as separate kernels the op's shape cannot tell apart: left out."""
    if sample.kernel_class == "gemm" and sample.gemm:
        m, n, k, batch = sample.gemm
        return GemmKernel(m=m, n=n, k=k, batch=batch)
    if sample.kernel_class == "attention" and sample.attention and not sample.attention["varlen"]:
        a = sample.attention
        return AttentionKernel(backward=a["backward"], batch=a["batch"], heads=a["heads"], kv_heads=a["kv_heads"],
                               s_q=a["s_q"], s_k=a["s_k"], head_dim=a["head_dim"], causal=bool(a["causal"]))
    if sample.kernel_class == "conv" and sample.conv and not sample.conv["backward"]:
        return _conv(sample.conv)
    if sample.kernel_class == "memory" and sample.bytes_moved:
        return MemoryKernel(bytes=sample.bytes_moved)
    return None


def _conv(c: ConvShape) -> ConvKernel | None:
    stride: tuple[int, ...] = c["stride"] or (1, 1)
    padding: tuple[int, ...] = c["padding"] or (0, 0)
    dilation: tuple[int, ...] = c.get("dilation") or (1, 1)
    if c["d"] != 1 or c["t"] != 1 or len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return None
    p = (c["h"] + 2 * padding[0] - dilation[0] * (c["r"] - 1) - 1) // stride[0] + 1
    q = (c["w"] + 2 * padding[1] - dilation[1] * (c["s"] - 1) - 1) // stride[1] + 1
    return ConvKernel.model_validate({"pass": "fwd", "n": c["n"], "c_in": c["c_in"], "h": c["h"], "w": c["w"],
                                      "c_out": c["c_out"], "r": c["r"], "s": c["s"], "p": max(1, p), "q": max(1, q),
                                      "stride": stride[0], "groups": c.get("groups") or 1})


def profile_passes(profile: Profile, dtype: str) -> tuple[list[TimedPass], int]:
    """One pass per profiled kernel of ``dtype`` with a known shape, labelled by its class
    and op; and how many kernels of other classes or without shapes were left out."""
    passes: list[TimedPass] = []
    left_out = 0
    for s in profile.samples:
        kernel = sample_kernel(s) if s.dtype == dtype or (s.dtype is None and s.kernel_class == "memory") else None
        if kernel is None:
            left_out += 1
            continue
        passes.append(TimedPass(f"{_class_of(kernel)} {s.op or s.kernel[:40]}", s.duration_s, [kernel]))
    return passes, left_out


def _class_of(kernel: Kernel) -> str:
    return "memory" if isinstance(kernel, MemoryKernel) else "attention" if isinstance(kernel, AttentionKernel) \
        else "gemm"


def residuals_by_class(fit: KernelFit) -> dict[str, tuple[int, float]]:
    """Per kernel class: distinct kernels and their rms relative residual, %."""
    out: dict[str, list[float]] = {}
    for label, measured, fitted in fit.rows:
        out.setdefault(label.split(" ", 1)[0], []).append(100 * (fitted - measured) / measured)
    return {c: (len(v), float(np.sqrt(np.mean(np.square(v))))) for c, v in out.items()}


@dataclass(frozen=True)
class ProfileCalibration:
    """``mpsim calibrate --profile``: the fit and what it was made from."""

    fit: KernelFit
    dtype: str
    device: str | None
    kernels_used: int
    kernels_left_out: int

    def text(self) -> str:
        lines = [f"kernel table fitted to {self.kernels_used} profiled {self.dtype} kernels "
                 f"({self.kernels_left_out} left out: other precisions, communication, copies, or no shapes) "
                 f"on {self.device or 'an unnamed device'}",
                 "class       multiplier  kernels  rms residual"]
        by_class = residuals_by_class(self.fit)
        for c in KERNEL_CLASSES:
            n, rms = by_class.get(c, (0, float("nan")))
            kept = " (kept: no kernels)" if c in self.fit.kept else ""
            lines.append(f"{c:<11} {self.fit.multipliers[c]:>10.3f}  {n:>7}  {rms:>11.1f}%{kept}")
        lines.append("(multiplier: the class's seconds under the old table x this = measured; its rates are divided "
                     "by it)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "kernels_used": self.kernels_used,
                "kernels_left_out": self.kernels_left_out, "multipliers": self.fit.multipliers,
                "residuals_by_class": {c: {"kernels": n, "rms_pct": r}
                                       for c, (n, r) in residuals_by_class(self.fit).items()},
                "table": self.fit.table.model_dump(mode="json")}


def calibrate_profile(profile: Profile, rates: KernelRates, source: str) -> ProfileCalibration:
    """Fit ``rates.table`` to ``profile``'s kernels of ``rates.dtype`` (module doc)."""
    from mpsim.errors import MpsimError

    passes, left_out = profile_passes(profile, rates.dtype)
    if not passes:
        raise MpsimError(f"{source}: no {rates.dtype} kernel with a shape to fit; profile with "
                         "record_shapes=True and the model's precision")
    fit = fit_kernel_table(passes, rates, source)
    return ProfileCalibration(fit, rates.dtype, profile.device_name, len(passes), left_out)


def calibrate_profile_file(topo: Topology, path: Path, dtype: str) -> ProfileCalibration:
    """``mpsim calibrate --profile``: fit ``topo``'s GPU kernel table (its own, else the
    shipped one for its model) to the ``dtype`` kernels of the profiler trace at ``path``."""
    from mpsim.errors import MpsimError
    from mpsim.hardware.gpu_tables import shipped_table
    from mpsim.models.profile_import import read_profile
    from mpsim.timing.kernel_time import ITEMSIZE

    gpu = topo.spec.gpu
    table = gpu.kernels or shipped_table(gpu.model)
    peak_tflops = gpu.peak_tflops.get(dtype)  # type: ignore[call-overload]
    if table is None or peak_tflops is None or dtype not in table.gemm:
        raise MpsimError(f"{topo.name}: its GPU ({gpu.model}) has no kernel table or no {dtype} rate to start the "
                         "fit from")
    rates = KernelRates(table, dtype, peak_tflops * 1e12, gpu.memory_bandwidth_gbps * 1e9,
                        ITEMSIZE[dtype])
    return calibrate_profile(read_profile(path), rates, path.name)


def kernel_table_yaml(topo: Topology, cal: ProfileCalibration, source: str) -> str:
    """``topo`` as a topology file whose GPU carries the fitted table and times kernels by it."""
    import yaml

    spec = topo.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec["gpu"]["kernels"] = cal.fit.table.model_dump(mode="json")
    spec["gpu"]["time_model"] = "kernels"
    return (f"# {topo.name} with a kernel table fitted by mpsim calibrate --profile {source}\n"
            + yaml.safe_dump(spec, sort_keys=False))
