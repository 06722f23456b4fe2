"""Figures (matplotlib, Agg) of one job and of the studies; each ``plot_*`` writes its
figure to a file (PNG, or SVG by the suffix). matplotlib is imported when a figure is drawn."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpsim.units import GiB
from mpsim.views.text import gib

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from mpsim.sim import SimResult
    from mpsim.studies.choose import ChooseReport
    from mpsim.studies.scale import ScaleReport


def downsample(times: np.ndarray, used: np.ndarray, max_points: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Keep the last value at each time, then thin evenly while keeping the peak."""
    if len(times) == 0:
        return times, used
    keep = np.append(times[1:] != times[:-1], True)
    t, u = times[keep], used[keep]
    if len(t) > max_points:
        idx = np.unique(np.concatenate([np.linspace(0, len(t) - 1, max_points).astype(int), [int(np.argmax(u))]]))
        t, u = t[idx], u[idx]
    return t, u



def figure_bytes(fig: Figure, fmt: str, dpi: int = 110) -> bytes:
    """``fig`` as a ``fmt`` file's bytes (``svg``, ``png``), the figure closed."""
    import matplotlib.pyplot as plt

    out = io.BytesIO()
    fig.savefig(out, format=fmt, dpi=dpi)
    plt.close(fig)  # a pyplot figure is let go; closing a plain Figure is harmless
    return out.getvalue()

# -- one job -------------------------------------------------------------------------------------

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
        t, u = downsample(g.memory_times_s, g.memory_used_bytes)
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
        ax.annotate(f"out of memory on GPU {o['gpu']} at {x:.1f} ms:\nneeded {gib(o['need_bytes'])} GiB, "
                    f"{gib(o['free_bytes'])} GiB free", xy=(x, used), xytext=(14, 14), textcoords="offset points",
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


#: Colours of the timeline: compute tasks by kind, then the copy lanes, then the collectives
#: of the data- and tensor-parallel groups (``nccl``).
TIMELINE_COLOURS = {"F": "tab:blue", "B": "tab:orange", "U": "tab:green", "copy": "tab:gray",
                    "d2h": "tab:red", "h2d": "tab:olive", "nccl": "tab:purple"}
_TIMELINE_LABELS = {"F": "forward", "B": "backward", "U": "optimizer update", "copy": "activation / D2D copy",
                    "d2h": "swap to host", "h2d": "swap from host", "nccl": "collective (NCCL)"}
#: Where a bar sits in its GPU's row, as (offset from the row's centre, height): compute on
#: top, copies below it, collectives at the bottom, so none hides another.
_TIMELINE_BANDS = {"compute": (-0.42, 0.4), "copy": (0.01, 0.19), "nccl": (0.22, 0.19)}


def _gpu_labels(r: SimResult) -> list[str]:
    return [f"GPU {g.gpu}" + ("" if g.stage is None else f" (stage {g.stage})") for g in r.gpus]


def memory_bars_figure(r: SimResult) -> Figure:
    """One bar per GPU: bytes by category at its peak, the capacity as a black tick (the web
    page's chart; ``html.memory_bars_html`` is the same in SVG drawn by hand)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 1.2 + 0.45 * len(r.gpus)))
    ax = fig.add_subplot()
    categories = [c for c in r.gpus[0].breakdown if any(g.breakdown.get(c) for g in r.gpus)]
    left = [0.0] * len(r.gpus)
    rows = list(range(len(r.gpus)))
    for cat in categories:
        widths = [g.breakdown.get(cat, 0) / GiB for g in r.gpus]
        ax.barh(rows, widths, left=left, label=cat, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    for row, g in zip(rows, r.gpus):
        cap = g.capacity_bytes / GiB
        ax.plot([cap, cap], [row - 0.4, row + 0.4], color="black", linewidth=2)
        colour = "black" if g.fits else "tab:red"
        ax.annotate(f"{g.peak_bytes / GiB:.1f} / {cap:.1f} GiB", (max(cap, g.peak_bytes / GiB), row),
                    xytext=(6, 0), textcoords="offset points", va="center", fontsize=7, color=colour)
    ax.set_yticks(rows, _gpu_labels(r))
    ax.invert_yaxis()
    ax.set_xlabel("GiB at the GPU's peak (black tick: capacity)")
    ax.margins(x=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def timeline_figure(r: SimResult) -> Figure:
    """Per GPU a compute row (forward, backward, update), a thinner copy row (peer copies and
    swaps) and a collective row (the data- and tensor-parallel groups' NCCL collectives; the
    web page's chart). Every layout draws: a lane or task kind this figure does not know is
    drawn in grey under its own name, and a span on a GPU the result does not list gets a row
    of its own."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = {g.gpu: i for i, g in enumerate(r.gpus)}
    labels = _gpu_labels(r)
    bars: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for s in r.spans:
        if s.gpu not in rows:
            rows[s.gpu] = len(rows)
            labels.append(f"GPU {s.gpu}")
        band = "compute" if s.lane == "compute" else "nccl" if s.lane == "nccl" else "copy"
        key = (s.name[:1] or "?") if s.lane == "compute" else s.lane
        bars.setdefault((s.gpu, band, key), []).append((s.start_s * 1e3, (s.end_s - s.start_s) * 1e3))
    fig = Figure(figsize=(12, 1.2 + 0.5 * len(rows)))
    ax = fig.add_subplot()
    for (gpu, band, key), spans in bars.items():
        offset, height = _TIMELINE_BANDS[band]
        # white seams between compute tasks; none on copies and collectives, whose bars are
        # often thinner than a seam
        ax.broken_barh(spans, (rows[gpu] + offset, height), facecolor=TIMELINE_COLOURS.get(key, "tab:gray"),
                       edgecolor="white" if band == "compute" else "none", linewidth=0.3)
    order = list(TIMELINE_COLOURS)
    used = sorted({key for _, _, key in bars}, key=lambda k: (order.index(k) if k in order else len(order), k))
    ax.legend(handles=[Patch(facecolor=TIMELINE_COLOURS.get(k, "tab:gray"), label=_TIMELINE_LABELS.get(k, k))
                       for k in used], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms); rows of a GPU, top to bottom: compute, copies, collectives")
    fig.tight_layout()
    return fig


# -- studies ------------------------------------------------------------------------------------

def choose_figure(report: ChooseReport) -> Figure:
    """Throughput (tokens/s for language models, else samples/s) against USD per hour, a
    point per priced server that fits with the time model's band as an error bar (points
    whose bars overlap are the ties of ``ChooseReport.ties``), the Pareto front joined and
    marked, labels placed clear of each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = report.seq_len is not None
    rows = sorted((r for r in report.rows if r.fits and r.price.usd_per_hour is not None),
                  key=lambda r: r.price.usd_per_hour or 0.0)
    points = [(r.server, r.price.usd_per_hour or 0.0, r.samples_per_s * (report.seq_len or 1), r.pareto) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top_usd = max((p[1] for p in points), default=1.0)
    top_rate = max((p[2] for p in points), default=1.0)
    ax.set_xlim(0, top_usd * 1.3)
    ax.set_ylim(0, top_rate * 1.15)
    for r, (_, usd, rate, pareto) in zip(rows, points, strict=True):
        ax.errorbar([usd], [rate], yerr=[rate * r.band_pct / 100], fmt="D" if pareto else "o", capsize=3,
                    markersize=7 if pareto else 5, zorder=3, color="tab:red" if pareto else "tab:gray")
    _label_points(fig, ax, [(server, usd, rate) for server, usd, rate, _ in points])
    front = sorted((usd, rate) for _, usd, rate, pareto in points if pareto)
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", linestyle="--", linewidth=1,
                label="Pareto front (faster or cheaper than the rest)")
        ax.legend(fontsize=8, loc="upper left")
    shown = {p[0] for p in points}
    left_out = [r.server for r in report.rows if r.server not in shown]
    ax.set_xlabel("USD per hour (on-demand)")
    ax.set_ylabel(("tokens/s" if lm else "samples/s") + " (bars: the time model's band)")
    title = f"{report.model}, {report.schedule}: throughput against price"
    if left_out:
        title += f"\n(not shown, no fit or no price: {', '.join(left_out)})"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


#: Where a point's label may go, in points from it: right above, right below, left above, left below.
LABEL_SPOTS = ((6, 4, "left"), (6, -12, "left"), (-6, 4, "right"), (-6, -12, "right"))


def _label_points(fig: Figure, ax: Any, points: list[tuple[str, float, float]]) -> None:
    """Each point's name beside it, at the first of ``LABEL_SPOTS`` whose box overlaps no
    label placed before (two servers at about the same price and rate stay readable)."""
    fig.canvas.draw()  # lays the axes out, so each label's box is where it will be drawn
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]  # Agg's canvas has one
    placed: list[Any] = []
    for name, x, y in points:
        for dx, dy, ha in LABEL_SPOTS:
            label = ax.annotate(name, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8, ha=ha)
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            label.remove()
        else:  # every spot taken: the first, above the others
            label = ax.annotate(name, (x, y), xytext=LABEL_SPOTS[0][:2], textcoords="offset points", fontsize=8)
            box = label.get_window_extent(renderer)
        placed.append(box)


def plot_choose(report: ChooseReport, path: Path) -> None:
    """``choose_figure`` to a file (PNG, or SVG by the suffix)."""
    import matplotlib.pyplot as plt

    fig = choose_figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


SWEEP_PEAK_CLIP = 2.0
"""The sweep's memory panels reach at most this many times the GPU capacity: a peak far
above it is drawn at the top with its value, so the capacity line keeps its place."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def plot_sweep(frame: pd.DataFrame, path: Path) -> Figure:
    """Throughput and highest per-GPU peak against microbatch size: small multiples, a pair
    of panels (throughput, peak memory) per server/model/microbatch count, a line per
    strategy in the same colour and marker in every panel (drawn largest first, so equal
    lines stay visible), one legend, shared microbatch axes, throughput from zero and a
    shared memory axis clipped at ``SWEEP_PEAK_CLIP`` times capacity; every panel names its
    model and server. Returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(frame.groupby(["server", "model", "microbatches"], sort=False))
    strategies = list(dict.fromkeys(frame["strategy"]))
    cmap = plt.get_cmap("tab10" if len(strategies) <= 10 else "tab20")
    colour = {st: cmap(i % cmap.N) for i, st in enumerate(strategies)}
    counts = frame["microbatches"].nunique()
    per_row = 1 if len(groups) == 1 else 2  # pairs of panels per row
    n_rows = -(-len(groups) // per_row)
    fig, axes = plt.subplots(n_rows, 2 * per_row, figsize=(5.5 * 2 * per_row, 3.2 * n_rows + 0.8), squeeze=False,
                             sharex=True)
    cap = frame["capacity_gib"].astype(float).max()
    top = min(max(cap, float(frame["max_peak_gib"].astype(float).max())), SWEEP_PEAK_CLIP * cap) * 1.08
    mem_axes = []
    for i, ((sv, md, m), group) in enumerate(groups):
        ax_t, ax_m = axes[i // per_row][2 * (i % per_row)], axes[i // per_row][2 * (i % per_row) + 1]
        mem_axes.append(ax_m)
        where = ", ".join([str(md), str(sv)] + ([f"m={m}"] if counts > 1 else []))
        for st, part in group.groupby("strategy", sort=False):
            _sweep_series(ax_t, ax_m, part, _series_style(str(st), strategies, colour), top / 1.08)
        ax_m.axhline(float(group["capacity_gib"].astype(float).max()), color="grey", linestyle="--", linewidth=1)
        ax_t.set_title(f"{where}: samples/s", fontsize=9)
        ax_m.set_title(f"{where}: peak GiB (x: OOM)", fontsize=9)
        ax_t.set_ylim(bottom=0)
        for ax in (ax_t, ax_m):
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    for ax in mem_axes:
        ax.set_ylim(0, top)
    for j in range(len(groups), n_rows * per_row):  # empty slots in the last row
        axes[j // per_row][2 * (j % per_row)].set_visible(False)
        axes[j // per_row][2 * (j % per_row) + 1].set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("microbatch size", fontsize=8)
    handles = [plt.Line2D([], [], color=colour[st], marker=MARKERS[i % len(MARKERS)], label=st)
               for i, st in enumerate(strategies)]
    handles.append(plt.Line2D([], [], color="grey", linestyle="--", label=f"GPU capacity (max {cap:.1f} GiB)"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _series_style(strategy: str, strategies: list[str], colour: dict) -> dict:
    """A strategy's colour and marker; the first drawn largest, so a later equal line
    leaves it showing around its own."""
    k, last = strategies.index(strategy), max(1, len(strategies) - 1)
    return {"color": colour[strategy], "marker": MARKERS[k % len(MARKERS)], "markersize": 7 - 4 * k / last,
            "linewidth": 2.6 - 1.6 * k / last, "label": strategy}


def _sweep_series(ax_t: Any, ax_m: Any, part: pd.DataFrame, style: dict, clip_gib: float) -> None:
    """One strategy's throughput (where it fits) and peak memory against microbatch size; a
    peak above ``clip_gib`` at the panel's top with its value, OOM points as crosses."""
    import pandas as pd

    part = part.assign(mb=part["microbatch"].astype(int)).sort_values("mb")
    fits = part["fits"].astype(str) == "True"
    ax_t.plot(part["mb"], pd.to_numeric(part["samples_per_s"].where(fits), errors="coerce"), **style)
    peaks = part["max_peak_gib"].astype(float)
    ax_m.plot(part["mb"], peaks.clip(upper=clip_gib), **{k: v for k, v in style.items() if k != "label"})
    ax_m.scatter(part["mb"][~fits], peaks[~fits].clip(upper=clip_gib), marker="x", color=style["color"], s=40,
                 zorder=3)
    for mb, peak in zip(part["mb"], peaks, strict=True):
        if peak > clip_gib:
            ax_m.annotate(f"{peak:.0f}", (mb, clip_gib), fontsize=7, color=style["color"], xytext=(0, 3),
                          textcoords="offset points", ha="center")


def plot_scale(report: ScaleReport, path: Path) -> None:
    """``scale_figure`` to a file (PNG, or SVG by the suffix)."""
    import matplotlib.pyplot as plt

    fig = scale_figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scale_figure(report: ScaleReport) -> Figure:
    """Days against cost to train, a line per cluster through its server counts (labelled),
    the Pareto front's points filled, the deadline and budget as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    top = max((r.usd for a in report.answers for r in a.rows if r.usd is not None), default=1.0)
    scale, unit = (1e6, "million USD") if top >= 1e6 else (1e3, "thousand USD") if top >= 1e3 else (1.0, "USD")
    days = [r.days for a in report.answers for r in a.rows] or [1.0]
    for a in report.answers:
        rows = [(r, r.usd / scale) for r in a.rows if r.usd is not None]
        if not rows:
            continue
        line, = ax.plot([r.days for r, _ in rows], [m for _, m in rows], marker="o", markersize=4,
                        label=a.cluster, markerfacecolor="white")
        front = [(r, m) for r, m in rows if r.pareto]
        ax.plot([r.days for r, _ in front], [m for _, m in front], "o", color=line.get_color(), markersize=5)
        for r, m in rows:
            ax.annotate(str(r.servers), (r.days, m), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if report.days:
        ax.axvline(report.days, linestyle="--", color="grey", linewidth=0.8)
    if report.budget_usd:
        ax.axhline(report.budget_usd / scale, linestyle="--", color="grey", linewidth=0.8)
    if max(days) > 10 * min(days):  # server counts double: days halve, a log axis spaces them evenly
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_xlabel("days to train")
    ax.set_ylabel(f"cost to train, {unit}")
    ax.set_title(f"{report.model}, {report.tokens:.3g} tokens (labels: servers; filled: Pareto front)", fontsize=9)
    if any(a.rows for a in report.answers):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
