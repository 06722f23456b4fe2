"""Human-readable tables, Chrome traces and plots from results. No simulation here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mpsim.capacity import FitsReport
from mpsim.plan import PlanFile
from mpsim.sim import SimResult
from mpsim.sim.memory import TECHNIQUES
from mpsim.sim.result import COSTS
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
    technique = techniques_text(r)
    if technique:
        lines += [technique, ""]
    if r.host_peak_bytes:
        lines.append(f"host memory   {_gib(r.host_peak_bytes)} GiB pinned at the peak of "
                     f"{_gib(r.host_capacity_bytes)} GiB")
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


def techniques_text(r: SimResult) -> str:
    """Per GPU and technique: GiB kept off the GPU at its peak, and ms it cost per
    iteration (MPress Table IV). Empty when the plan uses no technique."""
    saved_cols = [t for t in TECHNIQUES if any(g.saved_at_peak.get(t) for g in r.gpus)]
    cost_cols = [c for c in COSTS if any(g.costs_s.get(c, 0.0) > 1e-12 for g in r.gpus)]
    if not saved_cols and not cost_cols:
        return ""
    header = ["gpu"] + [f"saved {t} GiB" for t in saved_cols] + [f"{c[:-2].replace('_', ' ')} ms" for c in cost_cols]
    rows = [[str(g.gpu)] + [_gib(g.saved_at_peak.get(t, 0)) for t in saved_cols]
            + [f"{g.costs_s.get(c, 0.0) * 1e3:.1f}" for c in cost_cols] for g in r.gpus if g.stage is not None
            or any(g.saved_at_peak.values()) or g.breakdown.get("peer_swap")]
    return ("what each technique saved at the GPU's peak, and what it cost per iteration\n"
            + _table(header, rows))


def plan_text(plan: PlanFile) -> str:
    """One line per stage: GPU, layers, how many layers take each action, optimizer, stash."""
    header = ["stage", "gpu", "layers", "keep", "recompute", "host", "peer", "split", "optimizer", "stash"]
    rows = []
    for s, st in enumerate(plan.stages):
        a, b = st.layers
        acts = [x.action for x in st.actions]
        counted = {k: acts.count(k) for k in ("recompute", "host", "peer")}
        keep = (b - a) - sum(counted.values())
        rows.append([str(s), str(st.gpu), f"{a}-{b - 1}", str(keep), str(counted["recompute"]), str(counted["host"]),
                     str(counted["peer"]), str(sum(1 for x in st.actions if x.split > 1)), st.optimizer, st.stash])
    head = (f"plan {plan.strategy} for {plan.model} on {plan.server}: {plan.schedule}, "
            f"microbatch {plan.microbatch} x {plan.microbatches}")
    return head + "\n\n" + _table(header, rows)


def fits_strategies_text(reports: list[FitsReport]) -> str:
    """One column per strategy: samples/s where the size fits, else the highest peak."""
    first = reports[0]
    header = ["model", "params (B)"] + [r.strategy for r in reports]
    rows = []
    for i, fr in enumerate(first.rows):
        cells = [fr.model, f"{fr.params / 1e9:.2f}"]
        for rep in reports:
            res = rep.rows[i].result
            cells.append(f"{res.samples_per_s:.2f}/s" if res.fits else f"OOM {_gib(res.max_peak_bytes)}G")
        rows.append(cells)
    cap = first.rows[0].result.gpus[0].capacity_bytes
    lines = [f"{first.family} on {first.server}: {first.schedule}, microbatch {first.microbatch} x "
             f"{first.microbatches}, {first.partition}-balanced partition, capacity {_gib(cap)} GiB per GPU",
             "(samples/s where it fits; OOM and the highest per-GPU peak in GiB where it does not)", "",
             _table(header, rows), "", "largest that fits, by strategy:"]
    for rep in reports:
        if rep.largest is None:
            lines.append(f"  {rep.strategy:10s} none, even with one transformer layer per GPU")
            continue
        d = rep.largest.to_dict()
        lines.append(f"  {rep.strategy:10s} {d['params'] / 1e9:6.2f}B ({d['transformer_layers']} layers at the shape "
                     f"of {rep.largest_template}), {d['samples_per_s']:.2f} samples/s, max peak "
                     f"{_gib(d['max_peak_bytes'])} GiB")
    return "\n".join(lines)


def transfer_text(d: dict) -> str:
    """The table of ``mpsim topo transfer``."""
    target = f"striped over GPUs {', '.join(str(g) for g in d['stripe'])}" if d["stripe"] else f"to {d['dst']}"
    lines = [f"{d['server']}: copy from {d['src']} {target}, alone on an idle server", ""]
    rows = []
    for c in d["copies"]:
        detail = (", ".join(f"gpu{p['dst']} {p['bytes'] / 1e6:.0f} MB" for p in c["parts"]) if "parts" in c
                  else " > ".join(c["route"]))
        rows.append([f"{c['bytes'] / 1e6:.4g}", f"{c['seconds'] * 1e3:.3f}", f"{c['effective_gbps']:.2f}", detail])
    lines.append(_table(["MB", "ms", "effective GB/s", "parts" if d["stripe"] else "route"], rows))
    return "\n".join(lines)


def topo_text(t: Topology) -> str:
    n = t.n_gpus
    d = t.to_dict()
    g = t.spec.gpu
    lines = [f"{t.name}: {t.spec.description}",
             f"{n} x {g.model}, {g.memory_mib / 1024:.2f} GiB each ({_gib(t.capacity_bytes)} GiB usable after "
             f"{g.reserved_mib:.0f} MiB reserved), "
             f"host {t.spec.host.memory_gib:g} GiB on {t.spec.host.sockets} socket(s)",
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
    lane and one lane per copy engine kind (peer copies, device-to-host, host-to-device),
    a memory counter in GiB, and, when the run recorded them, link rates in GB/s."""
    lanes = {"compute": 1, "copy": 2, "d2h": 3, "h2d": 4}
    names = {"compute": "compute stream", "copy": "peer copy engines", "d2h": "copy engine to host",
             "h2d": "copy engine from host"}
    events: list[dict] = []
    for g in r.gpus:
        label = f"GPU {g.gpu}" + (f" (stage {g.stage})" if g.stage is not None else "")
        events.append({"name": "process_name", "ph": "M", "pid": g.gpu, "args": {"name": label}})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": g.gpu, "tid": tid, "args": {"name": names[lane]}})
        t, u = _downsample(g.memory_times_s, g.memory_used_bytes)
        events += [{"name": "memory GiB", "ph": "C", "pid": g.gpu, "ts": float(ts) * 1e6,
                    "args": {"used": float(v) / GiB}} for ts, v in zip(t, u)]
    for s in r.spans:
        events.append({"name": s.name, "ph": "X", "pid": s.gpu, "tid": lanes[s.lane], "ts": s.start_s * 1e6,
                       "dur": (s.end_s - s.start_s) * 1e6})
    if r.link_rates:
        links_pid = len(r.gpus)
        events.append({"name": "process_name", "ph": "M", "pid": links_pid, "args": {"name": "links (GB/s)"}})
        active: set[str] = set()
        for ts, rates in r.link_rates:
            for name in sorted(active | set(rates)):
                events.append({"name": name, "ph": "C", "pid": links_pid, "ts": ts * 1e6,
                               "args": {"GB/s": rates.get(name, 0.0) / 1e9}})
            active = set(rates)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def plot_memory(r: SimResult, path: Path) -> None:
    """Memory over time per GPU, with each GPU's capacity as a dashed line; below it, the
    swap-outs and swap-ins of each GPU (host and D2D) as bars on the same time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swaps = [s for s in r.spans if s.lane in ("d2h", "h2d") or s.name.startswith("D2D")]
    fig, axes = plt.subplots(2 if swaps else 1, 1, figsize=(10, 7 if swaps else 5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1]} if swaps else None, squeeze=False)
    ax = axes[0][0]
    for g in r.gpus:
        if g.stage is None and not g.breakdown.get("peer_swap"):
            continue
        t, u = _downsample(g.memory_times_s, g.memory_used_bytes)
        label = f"GPU {g.gpu}" + (f" (stage {g.stage})" if g.stage is not None else "")
        ax.step(t * 1e3, u / GiB, where="post", label=label)
    cap = r.gpus[0].capacity_bytes / GiB
    ax.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"capacity {cap:.1f} GiB")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(f"{r.model} on {r.server}, {r.schedule}, microbatch {r.microbatch} x {r.microbatches}, "
                 f"strategy {r.strategy}")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    if swaps:
        lane_ax = axes[1][0]
        for s in swaps:
            out = s.lane == "d2h" or "swap-out" in s.name
            lane_ax.broken_barh([(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3)],
                                (s.gpu - 0.4 + (0 if out else 0.4), 0.4), color="tab:red" if out else "tab:green")
        lane_ax.set_yticks(sorted({s.gpu for s in swaps}))
        lane_ax.set_ylabel("GPU")
        lane_ax.set_title("swap-outs (red, lower half) and swap-ins (green, upper half)", fontsize=8)
        lane_ax.set_xlabel("time (ms)")
    else:
        ax.set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
