"""Self-contained HTML views of results: one file with inline CSS and inline SVG charts, no
external URL, no script. Each view is a function returning an HTML fragment (all text
escaped), so a web page can show the same views; ``page`` wraps fragments in a document.
"""

from __future__ import annotations

import html
import io
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.views.plots import choose_figure, memory_figure, plot_sweep, scale_figure
from mpsim.views.text import (
    TECHNIQUES_TITLE,
    UNITS_LEGEND,
    band_phrase,
    choose_header,
    choose_row,
    fits_word,
    gib,
    layer_range,
    plan_counts,
    sweep_text,
    techniques_table,
    throughput_phrase,
    verdict_lines,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from mpsim.plans.plan import PlanFile
    from mpsim.sim import SimResult
    from mpsim.studies.choose import ChooseReport
    from mpsim.studies.scale import ScaleReport

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
.verdict { font-size: 1.1em; font-weight: bold; padding: 0.6em 1em; border-radius: 4px; }
.fits { background: #e3f4e3; border: 1px solid #4a4; } .risk { background: #fdf1d8; border: 1px solid #c90; }
.oom { background: #fbe3e3; border: 1px solid #c44; }
.note { color: #555; font-size: 0.85em; } pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; }
svg { max-width: 100%; height: auto; }
td.act { width: 14px; padding: 0; border: 1px solid #fff; }
"""

#: Colours of the breakdown categories at a GPU's peak (bars) and of plan actions.
CATEGORY_COLOURS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#e15759", "activations": "#76b7b2",
                    "stash": "#59a14f", "buffers": "#edc948", "workspace": "#b07aa1", "peer_swap": "#ff9da7"}
ACTION_COLOURS = {"keep": "#dddddd", "recompute": "#f28e2b", "selective": "#edc948", "host": "#e15759",
                  "peer": "#b07aa1"}
LANE_COLOURS = {"compute": "#4e79a7", "copy": "#b07aa1", "d2h": "#e15759", "h2d": "#59a14f", "nccl": "#f28e2b"}


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def page(title: str, fragments: Iterable[str]) -> str:
    """A complete HTML document around the fragments (inline CSS, nothing fetched)."""
    body = "\n".join(fragments)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n<h1>{esc(title)}</h1>\n{body}\n</body></html>\n")


def section(heading: str, *fragments: str) -> str:
    return f"<section><h2>{esc(heading)}</h2>\n" + "\n".join(fragments) + "</section>"


def table_html(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def pre_html(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def svg_of(fig: Figure) -> str:
    """A matplotlib figure as an inline ``<svg>`` element (text kept as text, no metadata,
    stable ids), the figure closed."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mpsim"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return inline_svg(buf.getvalue())


def inline_svg(text: str) -> str:
    """An SVG file's text as an element to put in HTML: no XML prolog, no metadata."""
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    return text[text.index("<svg"):]


# -- one simulated job -----------------------------------------------------------------------------

def verdict_html(r: SimResult, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """The text view's verdict (``verdict_lines``: fits, AT RISK or where it ran out, the
    job with its layout), then iteration time and throughput with its band and tokens/s."""
    head, *why = verdict_lines(r, headroom_gib)
    detail = " ".join(x.strip() for x in why)
    if r.oom:
        detail += ". Time and throughput below are of the whole demand, as if the GPUs had the memory."
    kind = "oom" if r.oom else "risk" if r.at_risk(headroom_gib) else "fits"
    numbers = (f"iteration {r.iteration_s * 1e3:.1f} ms, {throughput_phrase(r)}, "
               f"highest peak {gib(r.max_peak_bytes)} GiB")
    band = f"<p class=\"note\">{esc(band_phrase(r))}</p>\n" if band_phrase(r) else ""
    return (f"<div class=\"verdict {kind}\">{esc(head)}</div>\n" + (f"<p>{esc(detail)}</p>\n" if detail else "")
            + f"<p>{esc(numbers)}</p>\n" + band)


def memory_bars_html(r: SimResult, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """Per GPU a bar of its peak split by category, against its capacity (dashed line), as
    inline SVG, with the numbers in a table below."""
    cats = [c for c in CATEGORY_COLOURS if any(g.breakdown.get(c) for g in r.gpus)]
    top = max(max(g.capacity_bytes, g.peak_bytes) for g in r.gpus) or 1
    bar_h, gap, left, width = 18, 6, 70, 700
    rows = []
    for i, g in enumerate(r.gpus):
        y, x = i * (bar_h + gap), float(left)
        parts = []
        for c in cats:
            w = g.breakdown.get(c, 0) / top * width
            if w > 0:
                parts.append(f"<rect x=\"{x:.1f}\" y=\"{y}\" width=\"{w:.1f}\" height=\"{bar_h}\" "
                             f"fill=\"{CATEGORY_COLOURS[c]}\"><title>{esc(c)}: {gib(g.breakdown[c])} GiB</title>"
                             "</rect>")
                x += w
        cap_x = left + g.capacity_bytes / top * width
        colour = "#222" if g.fits else "#c00"
        rows.append(f"<text x=\"0\" y=\"{y + 13}\" font-size=\"12\">GPU {g.gpu}</text>" + "".join(parts)
                    + f"<line x1=\"{cap_x:.1f}\" x2=\"{cap_x:.1f}\" y1=\"{y - 2}\" y2=\"{y + bar_h + 2}\" "
                      f"stroke=\"{colour}\" stroke-dasharray=\"3,2\"/>"
                    + f"<text x=\"{left + width + 8}\" y=\"{y + 13}\" font-size=\"11\" fill=\"{colour}\">"
                      f"{gib(g.peak_bytes)} / {gib(g.capacity_bytes)} GiB</text>")
    height = len(r.gpus) * (bar_h + gap)
    legend_y = height + 14
    legend = "".join(f"<rect x=\"{left + k * 95}\" y=\"{legend_y - 10}\" width=\"10\" height=\"10\" "
                     f"fill=\"{CATEGORY_COLOURS[c]}\"/><text x=\"{left + k * 95 + 14}\" y=\"{legend_y}\" "
                     f"font-size=\"11\">{esc(c)}</text>" for k, c in enumerate(cats))
    svg = (f"<svg width=\"{left + width + 150}\" height=\"{legend_y + 8}\" "
           f"role=\"img\" aria-label=\"peak memory per GPU\">{''.join(rows)}{legend}</svg>")
    header = ["GPU", "stage", "layers", "peak GiB", "capacity GiB", "fits"] + cats
    table = table_html(header, [[g.gpu, "-" if g.stage is None else g.stage, layer_range(g.layers),
                                 gib(g.peak_bytes), gib(g.capacity_bytes), fits_word(g, headroom_gib)]
                                + [gib(g.breakdown.get(c, 0)) for c in cats] for g in r.gpus])
    note = ("<p class=\"note\">Bars: bytes per category at each GPU's peak; dashed line: capacity (memory less the "
            "reserved context), red where the peak is above it; at risk: the caching allocator's reserve with "
            f"the CUDA context and NCCL buffers within {headroom_gib:g} GiB of the GPU's memory. "
            f"{esc(UNITS_LEGEND)}.</p>")
    return svg + "\n" + table + "\n" + note


def memory_timeline_html(r: SimResult) -> str:
    """Memory over time per GPU with capacities, the out-of-memory point and the swaps
    (the figure of ``mpsim simulate --plot``)."""
    return svg_of(memory_figure(r))


def techniques_html(r: SimResult) -> str:
    header, rows = techniques_table(r)
    if not header:
        return "<p class=\"note\">The plan uses no memory-saving technique.</p>"
    return f"<p>{esc(TECHNIQUES_TITLE)}</p>\n" + table_html(header, rows)


def pipeline_timeline_html(r: SimResult, max_spans: int = 20000) -> str:
    """The pipeline as a Gantt chart: per GPU a row per busy lane (compute stream, peer
    copies, copies to and from host), forward and backward tasks named on hover."""
    lanes = [(g.gpu, lane) for g in r.gpus for lane in LANE_COLOURS if any(s.gpu == g.gpu and s.lane == lane
                                                                               for s in r.spans)]
    if not lanes or not r.spans:
        return "<p class=\"note\">No timeline recorded.</p>"
    end_s = max(s.end_s for s in r.spans) or 1.0
    row_of = {key: i for i, key in enumerate(lanes)}
    left, width, row_h = 120, 1000, 14
    shapes = []
    for s in r.spans[:max_spans]:
        x = left + s.start_s / end_s * width
        w = max((s.end_s - s.start_s) / end_s * width, 0.3)
        colour = LANE_COLOURS[s.lane] if not s.name.startswith("B") else "#a0cbe8"
        shapes.append(f"<rect x=\"{x:.2f}\" y=\"{row_of[s.gpu, s.lane] * row_h + 1}\" width=\"{w:.2f}\" "
                      f"height=\"{row_h - 2}\" fill=\"{colour}\"><title>GPU {s.gpu} {esc(s.lane)}: {esc(s.name)}, "
                      f"{s.start_s * 1e3:.2f} to {s.end_s * 1e3:.2f} ms</title></rect>")
    labels = "".join(f"<text x=\"0\" y=\"{i * row_h + 11}\" font-size=\"10\">GPU {g} {esc(lane)}</text>"
                     for i, (g, lane) in enumerate(lanes))
    axis_y = len(lanes) * row_h + 12
    anchors = ("start", "middle", "middle", "middle", "end")  # the last label ends at the axis' end, inside the svg
    ticks = "".join(f"<text x=\"{left + k / 4 * width:.0f}\" y=\"{axis_y}\" font-size=\"10\" "
                    f"text-anchor=\"{anchors[k]}\">{end_s * k / 4 * 1e3:.0f} ms</text>" for k in range(5))
    svg = (f"<svg width=\"{left + width + 40}\" height=\"{axis_y + 6}\" "
           f"role=\"img\" aria-label=\"pipeline timeline\">{labels}{''.join(shapes)}{ticks}</svg>")
    cut = f" (first {max_spans} of {len(r.spans)} spans)" if len(r.spans) > max_spans else ""
    return svg + (f"<p class=\"note\">Compute: forward dark blue, backward light blue; peer copies purple, to host "
                  f"red, from host green; collectives (nccl) orange. Hover a bar for its task and times{esc(cut)}.</p>")


def plan_html(plan: PlanFile) -> str:
    """Which technique on which layer: a row per stage, a cell per layer coloured by its
    action (hover for the layer and details), and the counts per stage."""
    rows = []
    for s, st in enumerate(plan.stages):
        actions = {a.layer: a for a in st.actions}
        cells = []
        for layer in range(st.layers[0], st.layers[1]):
            a = actions.get(layer)
            what = a.action if a else "keep"
            extra = (f", split {a.split}" if a and a.split > 1 else "") + (
                f", peers {', '.join(f'gpu{p.gpu} {p.fraction:.2f}' for p in a.peers)}" if a and a.peers else "")
            cells.append(f"<td class=\"act\" style=\"background:{ACTION_COLOURS[what]}\" "
                         f"title=\"layer {layer}: {esc(what + extra)}\">{'s' if a and a.split > 1 else ''}</td>")
        rows.append(f"<tr><td>stage {s}, GPU {st.gpu}, layers {esc(layer_range(st.layers))}</td>{''.join(cells)}</tr>")
    legend = " ".join(f"<span style=\"background:{c};padding:0 6px\">{esc(k)}</span>"
                      for k, c in ACTION_COLOURS.items())
    head = (f"<p>plan {esc(plan.strategy)} for {esc(plan.model)} on {esc(plan.server)}: {esc(plan.schedule)}, "
            f"microbatch {plan.microbatch} x {plan.microbatches}</p>")
    grid = f"<table>{''.join(rows)}</table><p class=\"note\">{legend} (s: tensor split)</p>"
    return head + grid + table_html(["stage", "GPU", "layers", "keep", "recompute", "selective", "host", "peer",
                                     "split", "optimizer", "stash"], plan_counts(plan))


def simulate_page(r: SimResult, plan: PlanFile | None = None, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """The HTML file of ``mpsim simulate --html``: verdict, memory per GPU, memory over
    time, the pipeline, the techniques, and the plan; at risk as ``headroom_gib`` says."""
    parts = [verdict_html(r, headroom_gib), section("Peak memory per GPU", memory_bars_html(r, headroom_gib)),
             section("Memory over time", memory_timeline_html(r)),
             section("Pipeline timeline", pipeline_timeline_html(r)),
             section("What each technique saved and cost", techniques_html(r))]
    if plan is not None:
        parts.append(section("Plan: the technique on each layer", plan_html(plan)))
    return page(f"mpsim simulate: {r.model} on {r.server}", parts)


# -- choose -------------------------------------------------------------------------------------------

def choose_verdict_html(report: ChooseReport) -> str:
    fits = any(r.fits for r in report.rows)
    return f"<div class=\"verdict {'fits' if fits else 'oom'}\">{esc(report.recommendation)}</div>"


def choose_table_html(report: ChooseReport) -> str:
    rows = [choose_row(report, r) for r in report.rows]
    sources = [[r.server, r.price.usd_per_hour, "given with --price" if r.price.override else r.price.source,
                r.price.date] for r in report.rows if r.price.usd_per_hour is not None]
    note = (f"<p class=\"note\">{esc(report.model)}, {esc(report.schedule)}, {report.microbatches} microbatches, "
            f"strategies {esc(', '.join(report.strategies))}, ranked by {esc(report.rank_by)}. OOM +x: GiB per GPU "
            "short (the smallest over the plans tried); front: on the Pareto front of throughput against USD per "
            "hour.</p>")
    prices = table_html(["server", "USD/h", "source", "date"], sources) if sources else ""
    return table_html(choose_header(report.seq_len is not None), rows) + note + prices


def choose_chart_html(report: ChooseReport) -> str:
    return svg_of(choose_figure(report))


def choose_html(report: ChooseReport) -> str:
    """The recommendation, the ranked table and the chart: the web page's choose view."""
    return choose_verdict_html(report) + choose_table_html(report) + choose_chart_html(report)


def choose_page(report: ChooseReport) -> str:
    """The HTML file of ``mpsim choose --html``: the recommendation, the ranked table, the
    chart, and the memory of the first-ranked server's plan."""
    parts = [choose_verdict_html(report), section("Servers, ranked", choose_table_html(report)),
             section("Throughput against price", choose_chart_html(report))]
    if report.rows:
        top = report.rows[0]
        parts.append(section(f"Peak memory per GPU on {top.server}", verdict_html(top.result, report.headroom_gib),
                             memory_bars_html(top.result, report.headroom_gib)))
    return page(f"mpsim choose: {report.model}", parts)


# -- how many servers (choose --tokens) ---------------------------------------------------------------

def scale_html(report: ScaleReport) -> str:
    """The recommendation, per cluster the server counts with their layout, days and cost,
    and the chart of days against cost: the web page's "how many servers" view."""
    parts = [f"<div class=\"verdict {'fits' if any(a.pick for a in report.answers) else 'oom'}\">"
             f"{esc(report.recommendation())}</div>"]
    header = ["servers", "GPUs", "layout", "strategy", "microbatch", "iteration s", "tokens/s", "days", "cost USD",
              "peak GiB", ""]
    for a in report.answers:
        rows = [[r.servers, r.gpus, r.tried.layout, r.tried.point.strategy, r.tried.point.shape.microbatch,
                 f"{r.tried.iteration_s:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.days:.1f}",
                 "-" if r.usd is None else f"{r.usd:,.0f}", gib(r.tried.peak_bytes),
                 " ".join(x for x in ("pick" if r is a.pick else "", "front" if r.pareto else "") if x)]
                for r in a.rows]
        price = "no price" if a.usd_per_server_hour is None else f"${a.usd_per_server_hour:,.2f} a server-hour"
        parts.append(f"<h3>{esc(a.cluster)}</h3><p class=\"note\">{esc(a.description)}; {esc(price)} "
                     f"({esc(a.price_source)}); {a.simulated} configurations simulated</p>")
        parts.append(table_html(header, rows) if rows else "<p>nothing fits on any number of servers tried</p>")
    parts.append(svg_of(scale_figure(report)))
    return "".join(parts)


def scale_page(report: ScaleReport) -> str:
    """The HTML file of ``mpsim choose --tokens --html``."""
    return page(f"mpsim choose: {report.model} on {report.tokens:.3g} tokens",
                [section("How many servers: time and cost to train", scale_html(report))])


# -- sweep ------------------------------------------------------------------------------------------

def sweep_page(frame: pd.DataFrame) -> str:
    """The HTML file of ``mpsim sweep --html``: the table as printed, the plot as inline
    SVG, every row."""
    with tempfile.TemporaryDirectory() as tmp:
        svg_path = Path(tmp) / "sweep.svg"
        plot_sweep(frame, svg_path)
        svg = inline_svg(svg_path.read_text(encoding="utf-8"))
    rows = frame.to_dict(orient="records")
    parts = [section("Throughput or OOM per microbatch size", pre_html(sweep_text(frame))),
             section("Throughput and peak memory against microbatch size", svg),
             section("Every point", table_html(list(frame.columns), [[r[c] for c in frame.columns] for r in rows]))]
    return page("mpsim sweep", parts)
