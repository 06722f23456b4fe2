"""The page's charts, drawn with matplotlib on the server: per-GPU memory at the peak
against capacity, memory over time (``mpsim.report.memory_figure``, as ``simulate
--plot``), and the pipeline timeline. Each renders as SVG for the page or PNG to download."""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mpsim.sim import SimResult
from mpsim.units import GiB

#: Colours of the timeline: compute tasks by kind, then the copy lanes.
TIMELINE_COLOURS = {"F": "tab:blue", "B": "tab:orange", "U": "tab:green", "copy": "tab:gray",
                    "d2h": "tab:red", "h2d": "tab:olive"}
_TIMELINE_LABELS = {"F": "forward", "B": "backward", "U": "optimizer update", "copy": "activation / D2D copy",
                    "d2h": "swap to host", "h2d": "swap from host"}


def _gpu_labels(r: SimResult) -> list[str]:
    return [f"GPU {g.gpu}" + ("" if g.stage is None else f" (stage {g.stage})") for g in r.gpus]


def memory_bars_figure(r: SimResult) -> Figure:
    """One bar per GPU: bytes by category at its peak, the capacity as a black tick."""
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
    """Per GPU a compute row (forward, backward, update) and a thinner copy row."""
    fig = Figure(figsize=(12, 1.2 + 0.5 * len(r.gpus)))
    ax = fig.add_subplot()
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in r.spans:
        key = s.name[0] if s.lane == "compute" else s.lane
        bars.setdefault((s.gpu, key), []).append((s.start_s * 1e3, (s.end_s - s.start_s) * 1e3))
    for (gpu, key), spans in bars.items():
        compute = key in ("F", "B", "U")
        y = gpu - 0.4 if compute else gpu + 0.05
        ax.broken_barh(spans, (y, 0.45 if compute else 0.3), facecolor=TIMELINE_COLOURS.get(key, "tab:gray"),
                       edgecolor="white", linewidth=0.3)
    used = sorted({key for _, key in bars}, key=list(TIMELINE_COLOURS).index)
    ax.legend(handles=[Patch(facecolor=TIMELINE_COLOURS[k], label=_TIMELINE_LABELS[k]) for k in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_yticks(range(len(r.gpus)), _gpu_labels(r))
    ax.set_ylim(len(r.gpus) - 0.5, -0.5)
    ax.set_xlabel("time (ms); upper row of a GPU: compute, lower: copies")
    fig.tight_layout()
    return fig


def memory_over_time_figure(r: SimResult) -> Figure:
    from mpsim.report import memory_figure

    return memory_figure(r)


CHARTS = {"bars": memory_bars_figure, "memory": memory_over_time_figure, "timeline": timeline_figure}
FORMATS = {"svg": "image/svg+xml", "png": "image/png"}


def render(r: SimResult, chart: str, fmt: str) -> bytes:
    """``chart`` of ``CHARTS`` as ``fmt`` of ``FORMATS``."""
    import matplotlib.pyplot as plt

    fig = CHARTS[chart](r)
    out = io.BytesIO()
    fig.savefig(out, format=fmt, dpi=110)
    plt.close(fig)  # memory_figure's figure is pyplot's; closing one of ours is harmless
    return out.getvalue()
