"""Tables and lines a person reads, from results. ``table_text`` is the one table
formatter; every command's text goes through it."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpsim.hardware.cluster import Cluster
from mpsim.hardware.topology import HOST, Topology
from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.models.frameworks import framework_line
from mpsim.plans.job import DP_NAMES
from mpsim.plans.layouts import parse_layout
from mpsim.plans.plan import PlanFile, optimizer_label
from mpsim.plans.strategies import STRATEGIES, base_name, combines
from mpsim.sim.memory import TECHNIQUES
from mpsim.sim.result import COSTS, GpuResult
from mpsim.studies.choose import ChooseReport, ChooseRow, money
from mpsim.studies.scale import ScaleReport
from mpsim.timing.runtime import DEFAULT_PROFILE, profile_named
from mpsim.units import GiB, format_rate, format_rate_band

if TYPE_CHECKING:
    import pandas as pd

    from mpsim.models.trace import Trace
    from mpsim.sim import SimResult
    from mpsim.sim.result import GpuResult
    from mpsim.studies.capacity import FitsReport, LayoutFits


def table_text(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right; a
    rule of dashes under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def gib(n: float) -> str:
    """Bytes as GiB with two decimals, no unit."""
    return f"{n / GiB:.2f}"


def layer_range(layers: tuple[int, int] | list[int] | None) -> str:
    """A stage's layers as in plan and JSON files, half-open: ``[0, 5)`` is layers 0 to 4."""
    if not layers:
        return "-"
    return f"[{layers[0]}, {layers[1]})"


#: The legend under tables with memory and layer columns.
UNITS_LEGEND = "memory in GiB = 2^30 bytes; layers [a, b) = a to b - 1, as in plan and JSON files"


# -- one job ------------------------------------------------------------------------------------

def verdict_lines(r: SimResult, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> list[str]:
    """The verdict: fits (AT RISK where the allocator's reserve comes within ``headroom_gib``
    of a GPU's memory, ``SimResult.at_risk``) or where it ran out, naming the job (its
    layout where it has replicas), then the line that says why, indented."""
    layout = f"{r.layout}, " if r.data_parallel else ""
    job = (f"{r.model} on {r.server}: {layout}{r.schedule}, microbatch {r.microbatch} x {r.microbatches}, "
           f"strategy {r.strategy}" + (f", {r.runs_on}" if r.runs_on else ""))
    if not r.oom:
        risk = r.at_risk(headroom_gib)
        every = "every GPU it uses" if r.runs_on else "every GPU"
        return [f"FITS on {every}, AT RISK: {job}", f"  {risk}"] if risk else [f"FITS on {every}: {job}"]
    o = r.oom
    return [f"DOES NOT FIT: {job}",
            f"  GPU {o['gpu']} ran out at {o['time_s'] * 1e3:.1f} ms during {o['task']}: "
            f"needed {gib(o['need_bytes'])} GiB with {gib(o['free_bytes'])} GiB free"]


def throughput_phrase(r: SimResult) -> str:
    """Samples/s with the time model's band, tokens/s for a language model, model TFLOP/s."""
    tokens = f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s is not None else ""
    return (f"{format_rate_band(r.samples_per_s, r.samples_per_s_band)} samples/s{tokens}, "
            f"{r.model_tflops:.1f} model TFLOP/s")


def runtime_line(name: str) -> str:
    """The runtime profile a result assumed, and what it hides (``mpsim.timing.runtime``)."""
    return f"{name}: {profile_named(name).summary} (--runtime)"


def runtime_header(name: str = "") -> str:
    """A study's header line naming the runtime profile its jobs ran under (none named: the
    default)."""
    return f"runtime: {runtime_line(name or DEFAULT_PROFILE)}"


def experts_header(r: SimResult) -> list[str]:
    """A study's header line on a mixture of experts' routing (none for a dense model)."""
    return [f"experts: {r.experts}"] if r.experts else []


def band_phrase(r: SimResult) -> str:
    """Where the ± band comes from (``± 5%: ...``), or "" without one."""
    return f"± {r.time_band_pct:g}%: {r.time_band_source}" if r.time_band_pct else ""


MAX_GPU_ROWS = 16
"""Above this many GPUs (a cluster's simulated servers) the tables show the stages' own GPUs only."""


def shown_gpus(r: SimResult) -> list[GpuResult]:
    """Every GPU, or on more than ``MAX_GPU_ROWS`` the simulated GPU of each stage (the
    others replicate them: tensor-parallel ranks, data-parallel replicas)."""
    if len(r.gpus) <= MAX_GPU_ROWS:
        return list(r.gpus)
    own = set(r.gpu_of_stage)
    return [g for g in r.gpus if g.gpu in own]


def fits_word(g: GpuResult, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """A GPU's cell in a ``fits`` column: yes, at risk (``GpuResult.reserved().at_risk``) or NO."""
    if not g.fits:
        return "NO"
    return "at risk" if g.reserved().at_risk(headroom_gib) else "yes"


def _reserved_cells(g: GpuResult) -> list[str]:
    """Reserved GiB as the allocator model replays this GPU, and with expandable segments."""
    e = g.reserved(expandable=True)
    return [gib(e.reserved_peak_bytes), gib(e.expandable_peak_bytes or 0)]


@dataclass(frozen=True)
class Asked:
    """What the user named a job's model and server by (a shipped name or a file path, as
    typed), so a hint names commands that run; None: the result's own names."""

    model: str | None = None
    server: str | None = None
    cluster: str | None = None


def simulate_text(r: SimResult, headroom_gib: float = DEFAULT_HEADROOM_GIB, asked: Asked = Asked()) -> str:
    """The verdict first (fits, or where it ran out), then the per-GPU table (peak
    allocated and the allocator's reserved estimate, ``mpsim.sim.reserved``), the
    techniques, iteration time and throughput; where the job does not fit, what to try
    next (``oom_hint``)."""
    cats = ["params", "grads", "optimizer", "activations", "stash", "buffers", "workspace"]
    header = ["gpu", "stage", "layers", "peak GiB", "reserved GiB", "expandable GiB", "capacity GiB", "fits"] + cats
    shown = shown_gpus(r)
    rows = [[str(g.gpu), "-" if g.stage is None else str(g.stage), layer_range(g.layers), gib(g.peak_bytes),
             *_reserved_cells(g), gib(g.capacity_bytes), fits_word(g, headroom_gib)]
            + [gib(g.breakdown[c]) for c in cats] for g in shown]
    legend = (f"(breakdown at each GPU's peak; reserved: the caching allocator's estimate, allocator model; "
              f"expandable: the same with expandable_segments:True; at risk: reserved + CUDA context + NCCL within "
              f"{headroom_gib:g} GiB of the GPU's memory; {UNITS_LEGEND})")
    if len(shown) < len(r.gpus):
        legend += (f"\n(each stage's own GPU; the other {len(r.gpus) - len(shown)} GPUs of the simulated servers "
                   "replicate them: tensor-parallel ranks and data-parallel replicas; --json lists every one)")
    trained = [f"{' ' * len('fine-tune: ')}{r.trainable}"] if r.trainable else []
    lines = verdict_lines(r, headroom_gib) + [_framework_of(r), *trained, "", table_text(header, rows), legend, ""]
    technique = techniques_text(r)
    if technique:
        lines += [technique, ""]
    if r.host_peak_bytes:
        lines.append(f"host memory   {gib(r.host_peak_bytes)} GiB pinned at the peak of "
                     f"{gib(r.host_capacity_bytes)} GiB")
    if r.oom:
        lines.append("(time and throughput of the whole demand, as if the GPUs had the memory)")
    lines.append(f"iteration     {r.iteration_s * 1e3:.1f} ms")
    lines.append(f"throughput    {throughput_phrase(r)}")
    if band_phrase(r):
        lines.append(f"              ({band_phrase(r)})")
    if r.runtime_profile:
        lines.append(f"runtime       {runtime_line(r.runtime_profile)}")
    if r.experts:
        lines.append(f"experts       {r.experts}")
    utilization = {k: u for k, u in r.link_utilization().items() if r.links[k]["bytes"]}
    if utilization:
        name = max(utilization, key=lambda k: (utilization[k], k))
        lines.append(f"busiest link  {name}: busy {100 * utilization[name]:.1f}% of the run, "
                     f"{r.links[name]['bytes'] / 1e9:.2f} GB (10^9 bytes) carried")
    if r.oom:
        lines += ["", oom_hint(r, asked)]
    return "\n".join(lines)


def oom_hint(r: SimResult, asked: Asked = Asked()) -> str:
    """What to try when a job does not fit, as commands that run: the strategies that
    search, a sharded layout where the server has GPUs to shard over, every layout on this
    server, other servers (on a cluster: other server counts and layouts)."""
    name = base_name(r.strategy)
    tried_all = name in STRATEGIES and combines(name)
    first = ("nothing mpsim plans fits this layout" if tried_all
             else "--strategy best tries every memory-saving plan (recompute, swaps, MPress, TSPLIT, offload)")
    gpus = r.gpus_available or len(r.gpus)
    layout = "" if r.data_parallel or gpus < 2 else f"; --dp {gpus} --zero 3 shards the model states (FSDP)"
    model = shlex.quote(asked.model or r.model)
    if asked.cluster is not None:
        where = (f"`mpsim choose --model {model} --clusters {shlex.quote(asked.cluster)} --tokens 1e12` other "
                 "server counts and layouts (give the tokens you train on)")
    else:
        server = shlex.quote(asked.server or r.server)
        where = (f"`mpsim fits --model {model} --server {server}` tries every layout, "
                 f"`mpsim choose --model {model}` other servers")
    return f"hint: {first}{layout}; {where}"


TECHNIQUES_TITLE = "what each technique saved at the GPU's peak, and what it cost per iteration"


def techniques_table(r: SimResult) -> tuple[list[str], list[list[str]]]:
    """Per GPU and technique: GiB kept off the GPU at its peak, and ms it cost per
    iteration (MPress Table IV), as header and rows; no rows when the plan uses no technique."""
    saved_cols = [t for t in TECHNIQUES if any(g.saved_at_peak.get(t) for g in r.gpus)]
    cost_cols = [c for c in COSTS if any(g.costs_s.get(c, 0.0) > 1e-12 for g in r.gpus)]
    if not saved_cols and not cost_cols:
        return [], []
    header = ["gpu"] + [f"saved {t} GiB" for t in saved_cols] + [f"{c[:-2].replace('_', ' ')} ms" for c in cost_cols]
    rows = [[str(g.gpu)] + [gib(g.saved_at_peak.get(t, 0)) for t in saved_cols]
            + [f"{g.costs_s.get(c, 0.0) * 1e3:.1f}" for c in cost_cols] for g in shown_gpus(r) if g.stage is not None
            or any(g.saved_at_peak.values()) or g.breakdown.get("peer_swap")]
    return header, rows


def techniques_text(r: SimResult) -> str:
    """``techniques_table`` as text under its title; empty when the plan uses no technique."""
    header, rows = techniques_table(r)
    return f"{TECHNIQUES_TITLE}\n{table_text(header, rows)}" if header else ""


def plan_counts(plan: PlanFile) -> list[list[Any]]:
    """Per stage: stage, GPU, layers, how many layers take each action (keep, recompute,
    selective, host, peer), split layers, optimizer, stash (``PLAN_HEADER``)."""
    rows = []
    for s, st in enumerate(plan.stages):
        a, b = st.layers
        acts = [x.action for x in st.actions]
        counted = {k: acts.count(k) for k in ("recompute", "selective", "host", "peer")}
        rows.append([s, st.gpu, layer_range(st.layers), (b - a) - sum(counted.values()), *counted.values(),
                     sum(1 for x in st.actions if x.split > 1), optimizer_label(st), st.stash])
    return rows


PLAN_HEADER = ["stage", "gpu", "layers", "keep", "recompute", "selective", "host", "peer", "split", "optimizer",
               "stash"]


def plan_text(plan: PlanFile) -> str:
    """One line per stage: GPU, layers, how many layers take each action, optimizer, stash."""
    rows = [[str(c) for c in row] for row in plan_counts(plan)]
    head = (f"plan {plan.strategy} for {plan.model} on {plan.server}: {plan.schedule}, "
            f"microbatch {plan.microbatch} x {plan.microbatches}")
    dp = plan.data_parallel
    if dp is not None:
        kind = DP_NAMES[dp.zero_stage]
        groups = "; ".join(",".join(map(str, dp.group(s))) for s in range(len(plan.stages)))
        head += f"\n{kind} x{dp.degree}: stage groups (GPUs in ring order) {groups}"
    return (head + "\n\n" + table_text(PLAN_HEADER, rows)
            + "\n(layers [a, b) are a to b - 1, half-open as in the plan file)")


# -- studies ------------------------------------------------------------------------------------

def _framework_of(r: SimResult) -> str:
    """How the layers are written and, for a fine-tune, what trains."""
    line = framework_line(r.framework, r.family)
    return f"{line}\nfine-tune: {r.fine_tune}" if r.fine_tune else line


def _fit_cell(res: SimResult, headroom_gib: float, layout: bool = False) -> str:
    """``fits``' cell: samples/s (``*`` when at risk) where it fits, else OOM and the highest
    peak; the layout after either when ``layout``."""
    cell = (f"{format_rate(res.samples_per_s)}/s" + ("*" if res.at_risk(headroom_gib) else "") if res.fits
            else f"OOM {gib(res.max_peak_bytes)}G")
    return f"{cell} {res.layout}" if layout else cell


def _at_risk_legend(results: list[SimResult], headroom_gib: float) -> list[str]:
    """The legend of ``*``, when a cell has one."""
    if not any(r.at_risk(headroom_gib) for r in results):
        return []
    return [f"(*: fits but at risk: the caching allocator's reserve with the CUDA context and NCCL buffers leaves "
            f"less than --headroom {headroom_gib:g} GiB of a GPU's memory free; `mpsim simulate` names the GPU)"]


def _largest_risk(res: SimResult, headroom_gib: float) -> str:
    return ", at risk" if res.at_risk(headroom_gib) else ""


def fits_strategies_text(reports: list[FitsReport], headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """One column per strategy: samples/s where the size fits, else the highest peak."""
    first = reports[0]
    header = ["model", "params (B)"] + [r.strategy for r in reports]
    rows = []
    shown = []
    for i, fr in enumerate(first.rows):
        cells = [fr.model, f"{fr.params / 1e9:.2f}"]
        for rep in reports:
            shown.append(rep.rows[i].result)
            cells.append(_fit_cell(rep.rows[i].result, headroom_gib))
        rows.append(cells)
    cap = first.rows[0].result.gpus[0].capacity_bytes
    lines = [f"{first.family} on {first.server}: {first.schedule}, microbatch {first.microbatch} x "
             f"{first.microbatches}, {first.partition}-balanced partition, capacity {gib(cap)} GiB per GPU",
             _framework_of(first.rows[0].result), runtime_header(first.rows[0].result.runtime_profile),
             *experts_header(first.rows[0].result),
             "(samples/s where it fits; OOM and the highest per-GPU peak in GiB where it does not)",
             *_at_risk_legend(shown, headroom_gib), "", table_text(header, rows), ""]
    if not first.searched:
        return "\n".join(lines + ["largest that fits: not searched (--no-largest)"])
    lines.append("largest that fits, by strategy:")
    for rep in reports:
        if rep.largest is None:
            lines.append(f"  {rep.strategy:10s} none, even with one transformer layer per GPU")
            continue
        d = rep.largest.to_dict()
        lines.append(f"  {rep.strategy:10s} {d['params'] / 1e9:6.2f}B ({d['transformer_layers']} layers at the shape "
                     f"of {rep.largest_template}), {format_rate(d['samples_per_s'])} samples/s, max peak "
                     f"{gib(d['max_peak_bytes'])} GiB{_largest_risk(rep.largest.result, headroom_gib)}")
    return "\n".join(lines)


def fits_layouts_text(answers: list[LayoutFits], headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
    """``fits`` over layouts: per model and strategy the fastest layout that fits (samples/s
    and its name), else the layout with the lowest peak; the largest size any layout
    reaches. With one layout, ``fits_strategies_text`` as before."""
    if all(len(a.reports) == 1 for a in answers):
        return fits_strategies_text([a.reports[0] for a in answers], headroom_gib)
    first = answers[0].reports[0]
    header = ["model", "params (B)"] + [a.strategy for a in answers]
    rows = []
    shown = []
    for i, fr in enumerate(first.rows):
        cells = [fr.model, f"{fr.params / 1e9:.2f}"]
        for a in answers:
            shown.append(a.best_row(i).result)
            cells.append(_fit_cell(shown[-1], headroom_gib, layout=True))
        rows.append(cells)
    cap = first.rows[0].result.gpus[0].capacity_bytes
    lines = [f"{first.family} on {first.server}: {first.schedule}, microbatch {first.microbatch} x "
             f"{answers[0].microbatches} per iteration over all replicas, {first.partition}-balanced partition, "
             f"capacity {gib(cap)} GiB per GPU",
             "layouts: " + ", ".join(r.job.layout_name for r in answers[0].reports),
             _framework_of(first.rows[0].result), runtime_header(first.rows[0].result.runtime_profile),
             *experts_header(first.rows[0].result),
             "(the fastest layout that fits: samples/s and the layout; where none fits, OOM, the lowest highest "
             "per-GPU peak in GiB and its layout)", *_at_risk_legend(shown, headroom_gib), "",
             table_text(header, rows), ""]
    if not first.searched:
        return "\n".join(lines + ["largest that fits: not searched (--no-largest)"])
    lines.append("largest that fits, by strategy (over the layouts):")
    for a in answers:
        top = a.largest
        if top is None:
            lines.append(f"  {a.strategy:10s} none, even with one transformer layer per GPU")
            continue
        rep, row = top
        d = row.to_dict()
        lines.append(f"  {a.strategy:10s} {d['params'] / 1e9:6.2f}B ({d['transformer_layers']} layers at the shape "
                     f"of {rep.largest_template}), {d['layout']}, {format_rate(d['samples_per_s'])} samples/s, "
                     f"max peak {gib(d['max_peak_bytes'])} GiB{_largest_risk(row.result, headroom_gib)}")
    return "\n".join(lines)


def sweep_text(frame: pd.DataFrame) -> str:
    """Samples/s (or OOM and the highest peak) per microbatch size, one column per strategy
    (per strategy and layout where a server ran several: ``none fsdp8``)."""
    lines = [runtime_header(), ""]  # sweep runs the default profile
    for (sv, md, m), part in frame.groupby(["server", "model", "microbatches"], sort=False):
        layouts = list(dict.fromkeys(_layouts_of(part)))
        columns = list(dict.fromkeys((str(st), str(lay)) for st, lay in zip(part["strategy"], _layouts_of(part))))
        rows = [[str(mb)] + [_sweep_cell(part, mb, st, lay) for st, lay in columns]
                for mb in sorted({int(x) for x in part["microbatch"]})]
        header = [st if len(layouts) == 1 else f"{st} {lay}" for st, lay in columns]
        where = f", {_layout_label(layouts[0])}" if len(layouts) == 1 and _layout_label(layouts[0]) else ""
        lines += [f"{md} on {sv}{where}, {m} microbatches: samples/s and highest per-GPU peak (GiB)", "",
                  table_text(["microbatch"] + header, rows), ""]
    return "\n".join(lines).rstrip()


def _layouts_of(part: pd.DataFrame) -> list[str]:
    return [str(x) for x in part["layout"]] if "layout" in part else [""] * len(part)


def _layout_label(name: str) -> str:
    """A sweep's layout column as a title names it; nothing for a pipeline (as before layouts)."""
    if not name or name.startswith("pp"):
        return ""
    p = parse_layout(name)
    return p.describe(p.pipeline or 1)


def _sweep_cell(part: pd.DataFrame, mb: int, strategy: str, layout: str) -> str:
    mask = (part["microbatch"].astype(int) == mb) & (part["strategy"] == strategy)
    if "layout" in part:
        mask &= part["layout"].astype(str) == layout
    r = part[mask]
    if r.empty:
        return ""
    row = r.iloc[0]
    if str(row["fits"]) == "True":
        return f"{format_rate(float(row['samples_per_s']))}/s {float(row['max_peak_gib']):.1f}G"
    return f"OOM {float(row['max_peak_gib']):.1f}G"


def choose_header(lm: bool) -> list[str]:
    """Columns of ``choose``'s ranked table; ``lm``: with tokens (a language model)."""
    return ["server", "GPUs", "fits", "layout", "plan", "mb", "samples/s"] + (["tokens/s"] if lm else []) + [
        "max peak GiB", "capacity GiB", "USD/h", "USD/M samples"] + (["USD/M tokens"] if lm else []) + ["front"]


def choose_row(report: ChooseReport, r: ChooseRow) -> list[str]:
    """One server's cells under ``choose_header``."""
    lm = report.seq_len is not None
    fits = ("at risk" if r.at_risk else "yes") if r.fits else f"OOM +{r.shortfall_bytes / GiB:.2f}"
    rate = [format_rate_band(r.samples_per_s, r.result.samples_per_s_band) if r.fits else "-"]
    if lm:
        rate.append(f"{r.tokens_per_s:,.0f}" if r.fits else "-")
    cost = [money(r.usd_per_million_samples)] + ([money(r.usd_per_million_tokens)] if lm else [])
    return ([f"{r.rank}. {r.server}", f"{r.n_gpus}", fits, r.layout, r.technique, str(r.microbatch)] + rate
            + [f"{r.max_peak_bytes / GiB:.2f}", f"{r.capacity_bytes / GiB:.2f}", money(r.price.usd_per_hour)]
            + cost + ["*" if r.pareto else ""])


def choose_text(report: ChooseReport) -> str:
    """The ranked table, its legend, the prices' sources and the recommendation."""
    rows = [choose_row(report, r) for r in report.rows]
    strategies = ",".join(report.strategies)
    sizes = "/".join(map(str, report.microbatch_sizes))
    lines = [f"{report.model} on {len(report.rows)} server(s): {report.schedule}, {report.microbatches} "
             f"microbatches of {sizes} per iteration over all replicas, strategies {strategies}, layouts "
             f"{report.layouts}; ranked by {report.rank_by}",
             *([_framework_of(report.rows[0].result)] if report.rows else []),
             runtime_header(report.runtime_profile),
             *(experts_header(report.rows[0].result) if report.rows else []), "",
             table_text(choose_header(report.seq_len is not None), rows),
             "(layout and plan: the parallel layout and technique of the fastest plan that fits, else of the one "
             "that came closest; DDP, ZeRO-1/2 and FSDP (ZeRO-3) xN: N data-parallel replicas; TP xN: N-way "
             "tensor parallel (+SP: sequence parallel); OOM +x: the "
             "smallest highest per-GPU peak above capacity, GiB; at risk: fits, but the caching allocator's reserve "
             f"with the CUDA context and NCCL buffers leaves less than --headroom {report.headroom_gib:g} GiB free "
             "(a safe plan stands for the server where there is one); samples/s ± the time model's error band; "
             "front: on the Pareto front of throughput against USD per hour; M = 10^6; memory in GiB = 2^30 bytes)"]
    sources = [f"  {r.server}: USD {money(r.price.usd_per_hour)}/h, "
               + ("given with --price" if r.price.override else f"{r.price.source} ({r.price.date})")
               for r in report.rows if r.price.usd_per_hour is not None]
    if sources:
        lines += ["", "prices:"] + sources
    return "\n".join(lines + ["", f"recommendation: {report.recommendation}"])


# -- servers and models -------------------------------------------------------------------------

def transfer_text(d: dict) -> str:
    """The table of ``mpsim topo transfer``."""
    target = f"striped over GPUs {', '.join(str(g) for g in d['stripe'])}" if d["stripe"] else f"to {d['dst']}"
    lines = [f"{d['server']}: copy from {d['src']} {target}, alone on an idle server", ""]
    rows = []
    for c in d["copies"]:
        detail = (", ".join(f"gpu{p['dst']} {p['bytes'] / 1e6:.0f} MB" for p in c["parts"]) if "parts" in c
                  else " > ".join(c["route"]))
        rows.append([f"{c['bytes'] / 1e6:.4g}", f"{c['seconds'] * 1e3:.3f}", f"{c['effective_gbps']:.2f}", detail])
    lines.append(table_text(["MB", "ms", "effective GB/s", "parts" if d["stripe"] else "route"], rows))
    lines.append("(decimal units: MB = 10^6 bytes, GB/s = 10^9 bytes/s)")
    return "\n".join(lines)


def topo_text(t: Topology) -> str:
    """GPUs, the connection matrix (``nvidia-smi topo -m`` style) and route bandwidths."""
    n = t.n_gpus
    d = t.to_dict()
    g = t.spec.gpu
    lines = [f"{t.name}: {t.spec.description}",
             f"{n} x {g.model}, {g.memory_mib / 1024:.2f} GiB each ({gib(t.capacity_bytes)} GiB usable after "
             f"{g.reserved_mib:.0f} MiB reserved), "
             f"host {t.spec.host.memory_gib:g} GiB on {t.spec.host.sockets} socket(s)",
             "", "connections (nvidia-smi topo -m style)"]
    names = [f"GPU{i}" for i in range(n)]
    lines.append(table_text([""] + names + ["socket"], [[names[a]] + d["connection"][a] + [str(t.socket_of(a))]
                                                        for a in range(n)]))
    lines += ["", "route bandwidth in GB/s = 10^9 bytes/s (row sends to column; host = pinned memory on the "
                  "local socket)"]
    rows = []
    for a in range(n):
        cells = ["X" if b == a else f"{t.route(a, b).bandwidth / 1e9:.1f}" for b in range(n)]
        rows.append([names[a]] + cells + [f"{t.route(a, HOST).bandwidth / 1e9:.1f}"])
    lines.append(table_text([""] + names + ["host"], rows))
    return "\n".join(lines)


def servers_text(servers: Mapping[str, Topology], clusters: Mapping[str, Cluster] | None = None) -> str:
    """``mpsim topo list``: a line per server, its shipped name and description; then the
    clusters."""
    lines = [f"{name:22s} {t.spec.description}" for name, t in servers.items()]
    if clusters:
        lines += ["", "clusters (--cluster):"] + [f"{name:22s} {c.spec.description}" for name, c in clusters.items()]
    return "\n".join(lines)


def cluster_text(c: Cluster) -> str:
    """``mpsim topo show`` of a cluster: the fabric, each GPU's NICs and its bandwidth to
    another server, and a drawing of one server's way out."""
    f = c.spec.fabric
    shape = {"rail-optimized": "NIC i of every server on leaf switch i (rail i), non-blocking",
             "fat-tree": f"a fat tree, oversubscribed {f.oversubscription:g}:1" if f.oversubscription != 1
             else "a non-blocking fat tree", "single-switch": "one switch, non-blocking"}[f.kind]
    lines = [c.describe(), f"fabric: {shape}; {f.nic_gbit:g} Gb/s a NIC at {f.efficiency:.0%} of line rate, "
                           f"{f.latency_us:g} us a network step", f"source: {f.source}", ""]
    rows = [[f"GPU{g}", f"nic{c.nic_group_of(g)}", str(c.nic_groups[c.nic_group_of(g)].nics),
             str(len(c.nic_groups[c.nic_group_of(g)].gpus)), f"{c.cross_bytes_per_s(g) / 1e9:.1f}"]
            for g in range(c.gpus_per_server)]
    lines.append(table_text(["", "NIC group", "NICs", "GPUs sharing", "to another server GB/s"], rows))
    lines += ["", "(GB/s = 10^9 bytes/s per direction, every GPU sending at once: the least of its NICs' share, "
                  "its PCIe link and, on an oversubscribed fat tree, its share of the spine)", "",
              f"one server: GPU -- PCIe -- NIC group -- {'rail switch' if f.kind == 'rail-optimized' else 'fabric'}"
              f" -- ... -- NIC group -- PCIe -- GPU of another server; inside: {c.server.name} "
              f"(mpsim topo show {c.server.name})"]
    return "\n".join(lines)


def presets_text(presets: dict[str, tuple[Any, int, str]]) -> str:
    """``mpsim trace --list``: a line per preset (its ``ModelConfig``, microbatch, recipe)."""
    return "\n".join(f"{preset:12s} {cfg.family:6s} {cfg.param_count() / 1e9:6.2f}B  {cfg.layers:3d} layers, hidden "
                     f"{cfg.hidden}, seq {cfg.seq_len}, microbatch {mb}, {recipe}, {cfg.attention} attention"
                     for preset, (cfg, mb, recipe) in presets.items())


def trace_line(output: object, trace: Trace) -> str:
    """What ``mpsim trace`` says of the trace it wrote to ``output``."""
    attention = trace.spec.model.get("attention", "")
    seq_len = trace.spec.model.get("seq_len")
    trained = "" if trace.spec.finetune is None else (
        f" ({trace.trained_params:,} trained: {trace.spec.finetune.describe()})")
    return (f"wrote {output}: {trace.name}, {trace.spec.params / 1e9:.2f}B parameters{trained}, {trace.n_layers} "
            f"layers, microbatch {trace.microbatch}" + (f" x {seq_len} tokens" if seq_len else "")
            + f", {trace.spec.precision.recipe}" + (f", {attention} attention" if attention else ""))


def collective_text(d: dict) -> str:
    """The table of ``mpsim topo collective``: nccl-tests' columns (size, time, algbw,
    busbw) per size, and the ring the collective ran over (for all-to-all, which runs
    none, the busbw its busiest link allows)."""
    tree = " (double binary tree over the ring's order)" if d.get("algorithm") == "tree" else ""
    lines = [f"{d['server']}: {d['op']}{tree} over GPUs {', '.join(str(g) for g in d['gpus'])}, alone on an idle "
             "server"]
    if d["ring"] is None:
        lines.append(f"n-1 point-to-point sends per GPU at once (NCCL's all-to-all, no ring); its busiest link "
                     f"allows busbw {d['bottleneck_gbps']:.1f} GB/s")
    else:
        ring = " > ".join(str(g) for g in d["ring"])
        lines.append(f"ring {ring} > {d['ring'][0]} (bottleneck {d['ring_bottleneck_gbps']:.1f} GB/s per hop)")
    lines.append("")
    rows = [[f"{s['bytes']}", f"{s['bytes'] / 1e6:.4g}", f"{s['seconds'] * 1e3:.3f}", f"{s['algbw_gbps']:.2f}",
             f"{s['busbw_gbps']:.2f}"] for s in d["sizes"]]
    lines.append(table_text(["bytes", "MB", "ms", "algbw GB/s", "busbw GB/s"], rows))
    lines.append("(decimal units: MB = 10^6 bytes, GB/s = 10^9 bytes/s; busbw as nccl-tests defines it)")
    return "\n".join(lines)


def scale_text(report: ScaleReport) -> str:
    """``mpsim choose --tokens``: per cluster, per server count the fastest layout that fits,
    its days and cost to train, and the recommendation."""
    goal = ", ".join(x for x in (f"in {report.days:g} days" if report.days else "",
                                 f"within ${report.budget_usd:,.0f}" if report.budget_usd else "") if x)
    out = [f"{report.model}: {report.tokens:.3g} tokens, {report.batch_tokens:,} tokens an iteration "
           f"({report.batch_tokens // report.seq_len} x {report.seq_len}), 1f1b" + (f"; goal: {goal}" if goal else ""),
           runtime_header()]  # the search over clusters runs the default
    out += [f"experts: {report.experts}"] if report.experts else []
    header = ["servers", "GPUs", "layout", "strategy", "mb", "iter s", "tokens/s", "days", "cost USD", "peak GiB", ""]
    for a in report.answers:
        price = "no price" if a.usd_per_server_hour is None else f"${a.usd_per_server_hour:,.2f} a server-hour"
        out += ["", f"{a.description}; {price} ({a.price_source or 'no source'}); {a.simulated} configurations "
                    "simulated"]
        rows = [[str(r.servers), str(r.gpus), r.tried.layout, r.tried.point.strategy,
                 str(r.tried.point.shape.microbatch),
                 f"{r.tried.iteration_s:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.days:.1f}",
                 "-" if r.usd is None else f"{r.usd:,.0f}", gib(r.tried.peak_bytes),
                 " ".join(x for x in ("<- pick" if r is a.pick else "", "pareto" if r.pareto else "") if x)]
                for r in a.rows]
        out.append(table_text(header, rows) if rows else "nothing fits on any number of servers searched")
    out += ["", "recommendation: " + report.recommendation()]
    return "\n".join(out)
