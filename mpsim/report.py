"""Human-readable tables, Chrome traces and plots from results. No simulation here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mpsim.capacity import FitsReport
from mpsim.sim import SimResult
from mpsim.topology import HOST, Topology
from mpsim.units import GiB


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def simulate_text(r: SimResult) -> str:
    cats = ["params", "grads", "optimizer", "activations", "stash", "buffers", "workspace"]
    header = ["gpu", "stage", "layers", "peak GiB", "capacity GiB", "fits"] + [c for c in cats]
    rows = []
    for g in r.gpus:
        layers = f"{g.layers[0]}-{g.layers[1] - 1}" if g.layers else "-"
        rows.append([str(g.gpu), "-" if g.stage is None else str(g.stage), layers, _gib(g.peak_bytes),
                     _gib(g.capacity_bytes), "yes" if g.fits else "NO"] + [_gib(g.breakdown[c]) for c in cats])
    head = (f"{r.model} on {r.server}: {r.schedule}, microbatch {r.microbatch} x {r.microbatches}, "
            f"strategy {r.strategy}")
    lines = [head, "", _table(header, rows), "(breakdown columns in GiB at each GPU's peak)", ""]
    lines.append(f"iteration     {r.iteration_s * 1e3:.1f} ms")
    lines.append(f"throughput    {r.samples_per_s:.2f} samples/s, {r.model_tflops:.1f} model TFLOP/s")
    utilization = {k: u for k, u in r.link_utilization().items() if r.links[k]["bytes"]}
    if utilization:
        name = max(utilization, key=lambda k: (utilization[k], k))
        lines.append(f"busiest link  {name}: busy {100 * utilization[name]:.1f}% of the run, "
                     f"{r.links[name]['bytes'] / 1e9:.2f} GB carried")
    if r.oom:
        o = r.oom
        lines.append(f"DOES NOT FIT: GPU {o['gpu']} ran out at {o['time_s'] * 1e3:.1f} ms during {o['task']}: "
                     f"needed {_gib(o['need_bytes'])} GiB with {_gib(o['free_bytes'])} GiB free")
    else:
        lines.append("fits on every GPU")
    return "\n".join(lines)


def fits_text(rep: FitsReport) -> str:
    header = ["model", "params (B)", "layers", "fits", "max peak GiB", "on gpu", "samples/s", "TFLOP/s"]
    def row(fr) -> list[str]:  # type: ignore[no-untyped-def]
        d = fr.to_dict()
        return [d["model"], f"{d['params'] / 1e9:.2f}", str(d["transformer_layers"]), "yes" if d["fits"] else "no",
                _gib(d["max_peak_bytes"]), str(d["max_peak_gpu"]), f"{d['samples_per_s']:.2f}",
                f"{d['model_tflops']:.1f}"]
    cap = rep.rows[0].result.gpus[0].capacity_bytes
    lines = [f"{rep.family} on {rep.server}: {rep.schedule}, microbatch {rep.microbatch} x {rep.microbatches}, "
             f"strategy {rep.strategy}, capacity {_gib(cap)} GiB per GPU", "",
             _table(header, [row(r) for r in rep.rows]), ""]
    if rep.largest is None:
        lines.append(f"no {rep.family} model fits, even with one transformer layer per GPU")
    else:
        d = rep.largest.to_dict()
        lines.append(f"largest that fits: {d['transformer_layers']} transformer layers at the shape of {rep.largest_template} "
                     f"= {d['params'] / 1e9:.2f}B parameters, max peak {_gib(d['max_peak_bytes'])} GiB, "
                     f"{d['samples_per_s']:.2f} samples/s, {d['model_tflops']:.1f} TFLOP/s")
    return "\n".join(lines)


def topo_text(t: Topology) -> str:
    n = t.n_gpus
    d = t.to_dict()
    g = t.spec.gpu
    lines = [f"{t.name}: {t.spec.description}",
             f"{n} x {g.model}, {g.memory_mib / 1024:.2f} GiB each ({_gib(t.capacity_bytes)} GiB usable after "
             f"{g.reserved_mib:.0f} MiB reserved), host {t.spec.host.memory_gib:g} GiB on {t.spec.host.sockets} socket(s)",
             "", "connections (nvidia-smi topo -m style)"]
    names = [f"GPU{i}" for i in range(n)]
    lines.append(_table([""] + names + ["socket"], [[names[a]] + d["connection"][a] + [str(t.socket_of(a))]
                                                    for a in range(n)]))
    lines += ["", "route bandwidth GB/s (row sends to column; host = pinned memory on the local socket)"]
    rows = []
    for a in range(n):
        cells = ["X" if b == a else f"{t.route(a, b).bandwidth / 1e9:.1f}" for b in range(n)]
        rows.append([names[a]] + cells + [f"{t.route(a, HOST).bandwidth / 1e9:.1f}"])
    lines.append(_table([""] + names + ["host"], rows))
    return "\n".join(lines)


def _downsample(times: np.ndarray, used: np.ndarray, max_points: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Keep the last value at each time, then thin evenly while keeping the peak."""
    if len(times) == 0:
        return times, used
    keep = np.append(times[1:] != times[:-1], True)
    t, u = times[keep], used[keep]
    if len(t) > max_points:
        idx = np.unique(np.concatenate([np.linspace(0, len(t) - 1, max_points).astype(int), [int(np.argmax(u))]]))
        t, u = t[idx], u[idx]
    return t, u


def write_chrome_trace(r: SimResult, path: Path) -> None:
    """Chrome trace event format (opens in Perfetto and chrome://tracing): per GPU a compute
    and a copy lane, and a memory counter in GiB."""
    lanes = {"compute": 1, "copy": 2}
    events: list[dict] = []
    for g in r.gpus:
        label = f"GPU {g.gpu}" + (f" (stage {g.stage})" if g.stage is not None else "")
        events.append({"name": "process_name", "ph": "M", "pid": g.gpu, "args": {"name": label}})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": g.gpu, "tid": tid, "args": {"name": lane}})
        t, u = _downsample(g.memory_times_s, g.memory_used_bytes)
        events += [{"name": "memory GiB", "ph": "C", "pid": g.gpu, "ts": float(ts) * 1e6,
                    "args": {"used": float(v) / GiB}} for ts, v in zip(t, u)]
    for s in r.spans:
        events.append({"name": s.name, "ph": "X", "pid": s.gpu, "tid": lanes[s.lane], "ts": s.start_s * 1e6,
                       "dur": (s.end_s - s.start_s) * 1e6})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def plot_memory(r: SimResult, path: Path) -> None:
    """Memory over time per GPU, with each GPU's capacity as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for g in r.gpus:
        if g.stage is None:
            continue
        t, u = _downsample(g.memory_times_s, g.memory_used_bytes)
        line, = ax.step(t * 1e3, u / GiB, where="post", label=f"GPU {g.gpu} (stage {g.stage})")
    cap = r.gpus[0].capacity_bytes / GiB
    ax.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"capacity {cap:.1f} GiB")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(f"{r.model} on {r.server}, {r.schedule}, microbatch {r.microbatch} x {r.microbatches}")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
