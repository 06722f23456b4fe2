"""Human-readable tables, Chrome traces and plots from results. No simulation here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mpsim.capacity import FitsReport
from mpsim.plan import PlanFile, optimizer_label
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


def layer_range(layers: tuple[int, int] | list[int] | None) -> str:
    """A stage's layers as in plan and JSON files, half-open: ``[0, 5)`` is layers 0 to 4."""
    if not layers:
        return "-"
    return f"[{layers[0]}, {layers[1]})"


#: The legend under tables with memory and layer columns.
UNITS_LEGEND = "memory in GiB = 2^30 bytes; layers [a, b) = a to b - 1, as in plan and JSON files"


def simulate_text(r: SimResult) -> str:
    """The verdict first (fits, or where it ran out), then the per-GPU table, the
    techniques, iteration time and throughput."""
    cats = ["params", "grads", "optimizer", "activations", "stash", "buffers", "workspace"]
    header = ["gpu", "stage", "layers", "peak GiB", "capacity GiB", "fits"] + [c for c in cats]
    rows = []
    for g in r.gpus:
        rows.append([str(g.gpu), "-" if g.stage is None else str(g.stage), layer_range(g.layers), _gib(g.peak_bytes),
                     _gib(g.capacity_bytes), "yes" if g.fits else "NO"] + [_gib(g.breakdown[c]) for c in cats])
    job = (f"{r.model} on {r.server}: {r.schedule}, microbatch {r.microbatch} x {r.microbatches}, "
           f"strategy {r.strategy}")
    if r.oom:
        o = r.oom
        lines = [f"DOES NOT FIT: {job}",
                 f"  GPU {o['gpu']} ran out at {o['time_s'] * 1e3:.1f} ms during {o['task']}: "
                 f"needed {_gib(o['need_bytes'])} GiB with {_gib(o['free_bytes'])} GiB free"]
    else:
        lines = [f"FITS on every GPU: {job}"]
    lines += ["", _table(header, rows), f"(breakdown at each GPU's peak; {UNITS_LEGEND})", ""]
    technique = techniques_text(r)
    if technique:
        lines += [technique, ""]
    if r.host_peak_bytes:
        lines.append(f"host memory   {_gib(r.host_peak_bytes)} GiB pinned at the peak of "
                     f"{_gib(r.host_capacity_bytes)} GiB")
    if r.oom:
        lines.append("(time and throughput of the whole demand, as if the GPUs had the memory)")
    lines.append(f"iteration     {r.iteration_s * 1e3:.1f} ms")
    lines.append(f"throughput    {r.samples_per_s:.2f} samples/s, {r.model_tflops:.1f} model TFLOP/s")
    utilization = {k: u for k, u in r.link_utilization().items() if r.links[k]["bytes"]}
    if utilization:
        name = max(utilization, key=lambda k: (utilization[k], k))
        lines.append(f"busiest link  {name}: busy {100 * utilization[name]:.1f}% of the run, "
                     f"{r.links[name]['bytes'] / 1e9:.2f} GB (10^9 bytes) carried")
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
    header = ["stage", "gpu", "layers", "keep", "recompute", "selective", "host", "peer", "split", "optimizer", "stash"]
    rows = []
    for s, st in enumerate(plan.stages):
        a, b = st.layers
        acts = [x.action for x in st.actions]
        counted = {k: acts.count(k) for k in ("recompute", "selective", "host", "peer")}
        keep = (b - a) - sum(counted.values())
        rows.append([str(s), str(st.gpu), layer_range(st.layers), str(keep), *map(str, counted.values()),
                     str(sum(1 for x in st.actions if x.split > 1)), optimizer_label(st), st.stash])
    head = (f"plan {plan.strategy} for {plan.model} on {plan.server}: {plan.schedule}, "
            f"microbatch {plan.microbatch} x {plan.microbatches}")
    return head + "\n\n" + _table(header, rows) + "\n(layers [a, b) are a to b - 1, half-open as in the plan file)"


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
    lines.append("(decimal units: MB = 10^6 bytes, GB/s = 10^9 bytes/s)")
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
    lines += ["", "route bandwidth in GB/s = 10^9 bytes/s (row sends to column; host = pinned memory on the "
                  "local socket)"]
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


#: Swap lanes of the memory plot: (colour, hatch, label) by target and direction.
SWAP_STYLES = {("host", "out"): ("tab:red", "", "to host"), ("host", "in"): ("tab:green", "", "from host"),
               ("peer", "out"): ("tab:purple", "////", "to peer GPU (D2D)"),
               ("peer", "in"): ("tab:blue", "////", "from peer GPU (D2D)")}


def memory_figure(r: SimResult):
    """The figure of ``plot_memory`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    swaps = [s for s in r.spans if s.lane in ("d2h", "h2d") or s.name.startswith("D2D")]
    fig, axes = plt.subplots(2 if swaps else 1, 1, figsize=(12, 7 if swaps else 5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1]} if swaps else None, squeeze=False)
    ax = axes[0][0]
    for g in r.gpus:
        if g.stage is None and not g.breakdown.get("peer_swap") and not (r.oom and r.oom["gpu"] == g.gpu):
            continue
        t, u = _downsample(g.memory_times_s, g.memory_used_bytes)
        label = f"GPU {g.gpu}" + (f" (stage {g.stage})" if g.stage is not None else "")
        ax.step(t * 1e3, u / GiB, where="post", label=label)
    caps = sorted({g.capacity_bytes for g in r.gpus})
    for cap_bytes in caps:
        cap = cap_bytes / GiB
        ax.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"capacity {cap:.2f} GiB")
    if r.oom:
        o = r.oom
        g = r.gpus[o["gpu"]]
        used = (g.capacity_bytes - o["free_bytes"]) / GiB
        x = o["time_s"] * 1e3
        ax.plot([x, x], [used, used + o["need_bytes"] / GiB], color="tab:red", linewidth=2)
        ax.plot([x], [used], marker="X", markersize=11, color="tab:red", linestyle="none",
                label=f"out of memory: GPU {o['gpu']} at {x:.1f} ms")
        ax.annotate(f"out of memory on GPU {o['gpu']} at {x:.1f} ms:\nneeded {_gib(o['need_bytes'])} GiB, "
                    f"{_gib(o['free_bytes'])} GiB free", xy=(x, used), xytext=(14, 14), textcoords="offset points",
                    fontsize=8, color="tab:red", bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "tab:red"})
    ax.set_ylabel("allocated (GiB)")
    verdict = "DOES NOT FIT" if r.oom else "fits"
    ax.set_title(f"{verdict}: {r.model} on {r.server}, {r.schedule}, microbatch {r.microbatch} x "
                 f"{r.microbatches}, strategy {r.strategy}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if swaps:
        lane_ax = axes[1][0]
        used_styles: dict[tuple[str, str], None] = {}
        for s in swaps:
            target = "peer" if s.name.startswith("D2D") else "host"
            way = "out" if s.lane == "d2h" or "swap-out" in s.name else "in"
            colour, hatch, _ = SWAP_STYLES[target, way]
            used_styles[target, way] = None
            lane_ax.broken_barh([(s.start_s * 1e3, (s.end_s - s.start_s) * 1e3)],
                                (s.gpu - 0.4 + (0 if way == "out" else 0.4), 0.4), facecolor=colour, hatch=hatch,
                                edgecolor="white" if hatch else colour, linewidth=0)
        lane_ax.set_yticks(sorted({s.gpu for s in swaps}))
        lane_ax.set_ylabel("GPU")
        lane_ax.legend(handles=[Patch(facecolor=SWAP_STYLES[k][0], hatch=SWAP_STYLES[k][1], edgecolor="white",
                                      label=SWAP_STYLES[k][2]) for k in SWAP_STYLES if k in used_styles],
                       fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       title="swaps (out: lower half\nof a GPU's row, in: upper)", title_fontsize=7)
        lane_ax.set_xlabel("time (ms)")
    else:
        ax.set_xlabel("time (ms)")
    fig.tight_layout()
    return fig


def plot_memory(r: SimResult, path: Path) -> None:
    """Memory over time per GPU with each capacity as a dashed line and, when the run does
    not fit, the out-of-memory marked (GPU, time, the demand above what was free); below,
    the swap-outs and swap-ins of each GPU, to host and to peer GPUs in their own colours."""
    import matplotlib.pyplot as plt

    fig = memory_figure(r)
    fig.savefig(path, dpi=110)
    plt.close(fig)
