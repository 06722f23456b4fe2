"""``mpsim reproduce``: the papers' comparisons, simulated from the shipped data, as
markdown reports with plots, our numbers beside what the papers report.

The papers give most results as figures; where the text states a number (a ratio, a
largest size, an out-of-memory cross) that number is quoted, section by section.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mpsim.data.catalog import load_topology, load_trace
from mpsim.hardware.topology import Topology, with_faster_peer_links
from mpsim.planners import Planned, plan_job
from mpsim.plans.job import DEFAULT_MICROBATCHES, Parallelism, job_of
from mpsim.plans.plan import LayerAction, PlanFile, Stripe, stripes_by_bandwidth
from mpsim.sim import SimResult, simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.timing.costs import cost_model

GiB = 2**30
_Progress = Callable[[str], None]


ZERO_SYSTEMS = ("zero-offload", "zero-infinity")
"""Strategies that run as MPress ran the ZeRO baselines: data parallel over every GPU."""


def run_system(server: str, model: str, schedule: str, mb: int, strategy: str,
               partition: str = "compute") -> SimResult:
    """One system of the paper's figures: a pipeline over every GPU with ``strategy``'s
    plan, or for the ZeRO systems (``ZERO_SYSTEMS``) one replica per GPU running the same
    global batch (``DEFAULT_MICROBATCHES`` microbatches of ``mb`` over all replicas)."""
    if strategy not in ZERO_SYSTEMS:
        return plan_job(job_of(server, model, schedule=schedule, microbatch=mb, strategy=strategy,
                               partition=partition)).result
    n = load_topology(server).n_gpus
    return plan_job(job_of(server, model, schedule=schedule, microbatch=mb, strategy=strategy, n_stages=1,
                           microbatches=max(1, DEFAULT_MICROBATCHES // n), parallelism=Parallelism(data=n))).result



def _replay(topo: Topology, model: str, plan: PlanFile) -> SimResult:
    """A plan made elsewhere, simulated on ``topo`` (Fig. 9's changed servers)."""
    return simulate_job(job_of_plan(topo, load_trace(model), plan))


PEER_LINK_FACTOR = 100.0
"""Fig. 9's headroom: the default plan re-simulated with peer links this many times faster."""


def _peer_link_headroom(server: str) -> tuple[Planned, SimResult]:
    """Fig. 9's default MPress plan, and its result on ``server`` with the peer links
    ``PEER_LINK_FACTOR`` times faster: what any mapping or striping of it could gain."""
    planned = plan_job(job_of(server, "gpt-15.4b", microbatch=2, strategy="mpress-no-mapping-no-striping"))
    spec = with_faster_peer_links(load_topology(server).spec, PEER_LINK_FACTOR)
    fast = _replay(Topology(spec, f"{server}, peer links x{PEER_LINK_FACTOR:g}"), "gpt-15.4b", planned.plan)
    return planned, fast


UNBOUNDED_MEMORY_MIB = 1_000_000.0
"""Fig. 9's second bound: GPU memory large enough that no peer runs out of room."""
D2D_BOUND_ROUTES = ("slowest neighbour", "fastest neighbour", "striped over all neighbours")


def _every_saving_to_peers(planned: Planned, topo: Topology, route: str) -> PlanFile:
    """``planned``'s plan with every layer it recomputes or swaps to the host sent by D2D
    swap instead, each to its stage's slowest or fastest NVLink neighbour, or striped over
    all of them in proportion to link bandwidth (III-C)."""
    stages = []
    for st in planned.plan.stages:
        peers = sorted(topo.nvlink_peers(st.gpu), key=lambda q: (topo.route(st.gpu, q).bandwidth, -q))
        if route == "slowest neighbour":
            stripes = [Stripe(gpu=peers[0], fraction=1.0)]
        elif route == "fastest neighbour":
            stripes = [Stripe(gpu=peers[-1], fraction=1.0)]
        else:
            stripes = stripes_by_bandwidth(topo, st.gpu, peers)
        actions = [LayerAction(layer=a.layer, action="peer", peers=stripes) if a.action in ("recompute", "host")
                   else a for a in st.actions]
        stages.append(st.model_copy(update={"actions": actions}))
    return planned.plan.model_copy(update={"stages": stages})


def _unbounded_d2d_bound(server: str, planned: Planned) -> dict[str, SimResult]:
    """Fig. 9's capacity bound: the default plan with every recomputed or host-swapped
    layer moved to D2D swap, on ``server`` with memory enough that no peer runs out
    (``UNBOUNDED_MEMORY_MIB``), per route of ``D2D_BOUND_ROUTES``, plus the default plan
    itself there (``as planned``). How much faster striping is than one link here bounds
    what mapping and striping could give if spare memory were no limit."""
    spec = load_topology(server).spec
    spec = spec.model_copy(update={"gpu": spec.gpu.model_copy(update={"memory_mib": UNBOUNDED_MEMORY_MIB})})
    topo = Topology(spec, f"{server}, unbounded memory")
    out = {"as planned": _replay(topo, "gpt-15.4b", planned.plan)}
    for route in D2D_BOUND_ROUTES:
        out[route] = _replay(topo, "gpt-15.4b", _every_saving_to_peers(planned, topo, route))
    return out


def _layer_over_one_link(server: str) -> tuple[float, float]:
    """A GPT-15.4B layer (microbatch 2) on ``server``: its activations out and back over one
    NVLink, and its forward plus backward, in seconds."""
    topo, trace = load_topology(server), load_trace("gpt-15.4b").rescale(2)
    times = cost_model(trace, topo.spec.gpu).layer_times
    j = trace.n_layers // 2
    link = topo.spec.nvlink.link_bandwidth_gbps * 1e9 if topo.spec.nvlink else float("inf")
    return 2 * trace.layers[j].act_bytes / link, float(times.fwd_s[j] + times.bwd_s[j])


def _cell(r: SimResult) -> str:
    return f"{r.model_tflops:.1f}" if r.fits else f"OOM ({r.max_peak_bytes / GiB:.1f} GiB)"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _bars(path: Path, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        vals = np.array(values, dtype=float)
        ax.bar(x + i * width, np.nan_to_num(vals), width, label=name)
        for k, v in enumerate(vals):
            if np.isnan(v):
                ax.text(x[k] + i * width, 0, "x", ha="center", va="bottom", color="red", fontsize=10)
    ax.set_xticks(x + width * (len(series) - 1) / 2, groups)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compare(out: Path, stem: str, title: str, server: str, models: list[str], schedule: str, mb: int,
             systems: dict[str, str], progress: _Progress) -> tuple[str, dict[tuple[str, str], SimResult]]:
    results = {}
    for md in models:
        for label, strategy in systems.items():
            progress(f"{stem}: {md} {label}")
            results[(md, label)] = run_system(server, md, schedule, mb, strategy)
    rows = [[md] + [_cell(results[(md, lb)]) for lb in systems] for md in models]
    series = {lb: [results[(md, lb)].model_tflops if results[(md, lb)].fits else float("nan") for md in models]
              for lb in systems}
    _bars(out / f"{stem}.png", title, models, series, "model TFLOPS (x: out of memory)")
    return _md_table(["model"] + list(systems), rows) + f"\n\n![{title}]({stem}.png)\n", results


def _ratio(a: SimResult, b: SimResult) -> str:
    return f"{(a.samples_per_s / b.samples_per_s - 1) * 100:+.1f}%" if a.fits and b.fits else "n/a (OOM)"


#: The paper's systems (Fig. 7, 8) and the strategies that stand in for them.
FIG7_SYSTEMS = {"PipeDream": "none", "GPU-CPU swap": "cpu-swap", "Recomputation": "recompute-segments",
                "MPress (D2D only)": "mpress-d2d-only", "MPress": "mpress"}
FIG8_SYSTEMS = {"DAPPLE": "none", "DAPPLE+Recomp": "recompute-segments", "GPU-CPU swap": "cpu-swap",
                "ZeRO-Offload": "zero-offload", "ZeRO-Infinity": "zero-infinity", "MPress": "mpress"}
#: MPress's throughput ratios (IV-B, IV-C, IV-D): (claim, paper's ratio, ours as (figure, model,
#: system over system)); "x over y" is x's samples/s divided by y's.
CLAIMS: tuple[tuple[str, float, str, str, str, str], ...] = (
    ("Fig. 7, BERT-0.64B: Recomputation over GPU-CPU swap (+143.4%)", 2.434, "7", "bert-0.64b",
     "Recomputation", "GPU-CPU swap"),
    ("Fig. 7, BERT-1.67B: Recomputation over GPU-CPU swap (+125.4%)", 2.254, "7", "bert-1.67b",
     "Recomputation", "GPU-CPU swap"),
    ("Fig. 7, BERT-1.67B: MPress over Recomputation (+19.5%)", 1.195, "7", "bert-1.67b", "MPress", "Recomputation"),
    ("Fig. 7, BERT-4B: MPress over GPU-CPU swap (1.8x)", 1.8, "7", "bert-4b", "MPress", "GPU-CPU swap"),
    ("Fig. 7, BERT-6.2B: MPress over GPU-CPU swap (3.1x)", 3.1, "7", "bert-6.2b", "MPress", "GPU-CPU swap"),
    ("Fig. 8a, GPT-10.3B: MPress over DAPPLE+Recomp (+19.2%)", 1.192, "8a", "gpt-10.3b", "MPress", "DAPPLE+Recomp"),
    ("Fig. 8a, GPT-10.3B: MPress over ZeRO-Infinity (+37.0-40.8%)", 1.389, "8a", "gpt-10.3b",
     "MPress", "ZeRO-Infinity"),
    ("Fig. 8a, GPT-15.4B: MPress over ZeRO-Infinity (+37.0-40.8%)", 1.389, "8a", "gpt-15.4b",
     "MPress", "ZeRO-Infinity"),
    ("Fig. 8a, GPT-20.4B: MPress over ZeRO-Infinity (+37.0-40.8%)", 1.389, "8a", "gpt-20.4b",
     "MPress", "ZeRO-Infinity"),
    ("Fig. 8a, GPT-10.3B: ZeRO-Infinity over ZeRO-Offload (+20.6-23.8%)", 1.222, "8a", "gpt-10.3b",
     "ZeRO-Infinity", "ZeRO-Offload"),
)
#: Fig. 9 (IV-D): throughput over the default (DAPPLE's map, no striping), per server.
FIG9_CLAIMS = {("dgx1-v100", "+ device mapping"): 1.174, ("dgx1-v100", "+ data striping"): 1.333,
               ("a100-40gb-nvswitch", "+ device mapping"): 1.0, ("a100-40gb-nvswitch", "+ data striping"): 1.11}


def _speedup(a: SimResult, b: SimResult) -> float | None:
    return a.samples_per_s / b.samples_per_s if a.fits and b.fits else None


def claims_rows(results: dict[str, dict[tuple[str, str], SimResult]],
                fig9: dict[str, dict[str, SimResult]]) -> list[list[str]]:
    """Each paper ratio beside ours and ours over the paper's; within 0.5-1.5 is ±50%.
    Fig. 9's rows are gains: ours over the paper's counts the gain above 1.0 (the issue's
    bar: at least half the paper's gain), and a gain the paper puts at nothing needs ours
    within 2% of nothing."""
    ratios: list[tuple[str, float, float | None]] = [
        (claim, paper, _speedup(results[fig][(model, x)], results[fig][(model, y)]))
        for claim, paper, fig, model, x, y in CLAIMS]
    # II-D: the iteration PipeDream would run with memory to spare is the one it simulates
    # while running out (the simulation goes on past an out-of-memory)
    swap, ideal = results["7"][("bert-0.64b", "GPU-CPU swap")], results["7"][("bert-0.64b", "PipeDream")]
    ratios.append(("II-D, BERT-0.64B: GPU-CPU swap over PipeDream with memory to spare (-67%)", 0.33,
                   swap.samples_per_s / ideal.samples_per_s if swap.fits else None))
    rows = [_ratio_row(*r) for r in ratios]
    default = "default (DAPPLE map, no striping)"
    for (server, step), paper in FIG9_CLAIMS.items():
        ours = _speedup(fig9[server][step], fig9[server][default])
        rows.append(_gain_row(f"Fig. 9, {server}, GPT-15.4B: {step} over the default", paper, ours))
    return rows


def _ratio_row(claim: str, paper: float, ours: float | None) -> list[str]:
    if ours is None:
        return [claim, f"{paper:.3f}", "OOM", "-", "no"]
    ratio = ours / paper
    return [claim, f"{paper:.3f}", f"{ours:.3f}", f"{ratio:.2f}", "yes" if 0.5 <= ratio <= 1.5 else "no"]


def _gain_row(claim: str, paper: float, ours: float | None) -> list[str]:
    if ours is None:
        return [claim, f"{paper:.3f}", "OOM", "-", "no"]
    if paper == 1.0:
        return [claim, f"{paper:.3f}", f"{ours:.3f}", "gain: none", "yes" if abs(ours - 1) <= 0.02 else "no"]
    gain = (ours - 1) / (paper - 1)
    return [claim, f"{paper:.3f}", f"{ours:.3f}", f"gain: {gain:.2f}", "yes" if gain >= 0.5 else "no"]


#: Fig. 9's variants (IV-D): the default and each technique added, and their strategies.
FIG9_ABLATION = {"default (DAPPLE map, no striping)": "mpress-no-mapping-no-striping",
                 "+ device mapping": "mpress-no-striping", "+ data striping": "mpress"}


def _mpress_figs(out: Path, progress: _Progress) -> tuple[list[str], list[dict[tuple[str, str], SimResult]]]:
    """Fig. 7 (BERT, PipeDream) and Fig. 8a/8b (GPT, 1F1B): each table with its plot, and
    each figure's results by (model, system)."""
    bert = ["bert-0.35b", "bert-0.64b", "bert-1.67b", "bert-4b", "bert-6.2b"]
    gpt = ["gpt-5.3b", "gpt-10.3b", "gpt-15.4b", "gpt-20.4b", "gpt-25.5b"]
    fig7, r7 = _compare(out, "mpress_fig7", "BERT on dgx1-v100, PipeDream, microbatch 12", "dgx1-v100", bert,
                        "pipedream", 12, FIG7_SYSTEMS, progress)
    fig8a, r8a = _compare(out, "mpress_fig8a", "GPT on dgx1-v100, 1F1B (DAPPLE), microbatch 2", "dgx1-v100", gpt,
                          "1f1b", 2, FIG8_SYSTEMS, progress)
    fig8b, r8b = _compare(out, "mpress_fig8b", "GPT on a100-40gb-nvswitch, 1F1B, microbatch 2", "a100-40gb-nvswitch",
                          gpt, "1f1b", 2, FIG8_SYSTEMS, progress)
    return [fig7, fig8a, fig8b], [r7, r8a, r8b]


def _fig9_server(server: str, progress: _Progress) -> tuple[dict[str, SimResult], list[str], list[str]]:
    """Fig. 9 on one server: each variant's result, its row of throughput over the default
    (with the peer-link headroom last) and its row of the unbounded-memory D2D bound."""
    res = {}
    for lb, st in FIG9_ABLATION.items():
        progress(f"fig9: {server} {lb}")
        res[lb] = run_system(server, "gpt-15.4b", "1f1b", 2, st)
    base = res["default (DAPPLE map, no striping)"]
    default_plan, fast = _peer_link_headroom(server)
    default = default_plan.result
    row = ([server] + [f"{r.samples_per_s / base.samples_per_s:.3f}" if r.fits and base.fits else _cell(r)
                       for r in res.values()]
           + [f"{default.iteration_s:.2f} s / {fast.iteration_s:.2f} s "
              f"({fast.samples_per_s / default.samples_per_s:.3f})"])
    bound = _unbounded_d2d_bound(server, default_plan)
    slowest = bound["slowest neighbour"].iteration_s
    bound_row = ([server, f"{default.iteration_s:.2f} s"]
                 + [f"{r.iteration_s:.2f} s ({slowest / r.iteration_s:.3f})" for r in bound.values()])
    return res, row, bound_row


def _fig9(progress: _Progress) -> tuple[dict[str, dict[str, SimResult]], list[list[str]], list[list[str]]]:
    """Fig. 9 on the DGX-1 and the A100 server: results per server, the throughput rows and
    the unbounded-memory bound rows."""
    fig9: dict[str, dict[str, SimResult]] = {}
    fig9_rows, bound_rows = [], []
    for server in ("dgx1-v100", "a100-40gb-nvswitch"):
        fig9[server], row, bound_row = _fig9_server(server, progress)
        fig9_rows.append(row)
        bound_rows.append(bound_row)
    return fig9, fig9_rows, bound_rows


def _table4_rows(progress: _Progress) -> list[list[str]]:
    """Table IV: the bytes MPress's plans keep off the GPUs at their peaks on the DGX-1, per
    technique (recomputation, GPU-CPU swap, D2D swap)."""
    rows = []
    for md, sched, mb in (("bert-1.67b", "pipedream", 12), ("bert-6.2b", "pipedream", 12),
                          ("gpt-10.3b", "1f1b", 2), ("gpt-20.4b", "1f1b", 2)):
        progress(f"table IV: {md}")
        r = run_system("dgx1-v100", md, sched, mb, "mpress")
        saved = {t: sum(g.saved_at_peak.get(t, 0) for g in r.gpus) for t in ("recompute", "host", "optimizer",
                                                                                         "stash", "peer")}
        host = saved["host"] + saved["optimizer"] + saved["stash"]
        total = saved["recompute"] + host + saved["peer"] or 1
        rows.append([md, "yes" if r.fits else "no"] + [f"{v / 1e9:.0f} GB ({v / total * 100:.1f}%)"
                                                       for v in (saved["recompute"], host, saved["peer"])])
    return rows


def _mpress_intro_text(claims: str) -> str:
    """The report's head: what stands in for the paper's systems, and the claims table."""
    return f"""# MPress, simulated

Regenerated by `mpsim reproduce`. Numbers are model TFLOPS of the whole server (forward
FLOPs x 3 per sample, as MPress IV-A counts), or OOM with the highest per-GPU peak.
Our baselines stand in for the paper's systems: `none` for PipeDream/DAPPLE, `cpu-swap`
for GPU-CPU swap (on-demand swaps, as the paper's baseline runs them), `zero-offload` and
`zero-infinity` for Fig. 8's ZeRO-Offload and ZeRO-Infinity (data parallel over all eight
GPUs, the same global batch of 16 microbatches as the pipelines, every transformer layer
checkpointed; ZeRO-Offload is ZeRO-2 with the optimizer on the CPU, ZeRO-Infinity ZeRO-3
with parameter shards and optimizer states in host memory, or on NVMe when host memory is
short), `recompute-segments` for Recomputation and
DAPPLE+Recomp (only what each GPU needs to fit, checkpointed as the paper's reference [16],
Chen et al. 2016, and GPipe's and DAPPLE's re-materialization do: a run of consecutive
recomputed layers keeps one checkpoint and re-runs whole before its backward),
`mpress-d2d-only` and `mpress`. Our `recompute`, which keeps every recomputed layer's
input as Megatron-LM and Hugging Face do, reaches further: it fits BERT-4B on the DGX-1,
which the paper's recomputation cannot.

## The paper's throughput claims

{claims}

"""


def _mpress_fig7_text(fig7: str, r7: dict[tuple[str, str], SimResult]) -> str:
    """Fig. 7's section: the table and the paper's IV-B statements beside ours."""
    rec, cpu, mp = r7[("bert-1.67b", "Recomputation")], r7[("bert-1.67b", "GPU-CPU swap")], r7[("bert-1.67b", "MPress")]
    return f"""## Fig. 7: BERT on the DGX-1 with PipeDream

{fig7}
What the paper reports (IV-B) and what we get:
- 0.35B: all five train it at the same speed. Ours: the same.
- 0.64B: PipeDream runs out (stage 0 needs 51 GB; ours {r7[('bert-0.64b', 'PipeDream')].max_peak_bytes / GiB:.1f} GiB);
  the other four train it, D2D-only and MPress alike. Ours: D2D only {_cell(r7[('bert-0.64b', 'MPress (D2D only)')])},
  MPress {_cell(r7[('bert-0.64b', 'MPress')])}, GPU-CPU swap {_cell(r7[('bert-0.64b', 'GPU-CPU swap')])}.
- 1.67B: D2D only fails; recomputation beats GPU-CPU swap by 125.4% and is 19.5% slower than
  MPress. Ours: MPress against recomputation {_ratio(mp, rec)}, recomputation against GPU-CPU
  swap {_ratio(rec, cpu)}.
- 4B and 6.2B: recomputation fails, GPU-CPU swap and MPress train them (MPress 1.8x and 3.1x
  faster). Ours: see the table and the claims above; recomputation fails as the paper's does
  (stage 0 holds its model states, 7 stashed weight versions and a whole segment's
  activations). Our GPU-CPU swap runs out of host memory at 6.2B (an OOM whose GPU peak is under the
  32 GB): with the shape fitted to Table II (1279 GB in all) it must hold about 1 TB on
  the host, more than the DGX-1's 768 GiB; the paper's swap trained it on that host.

"""


def _mpress_fig8_text(fig8a: str, fig8b: str, r8a: dict[tuple[str, str], SimResult]) -> str:
    """Fig. 8's section: both servers' tables and the paper's IV-C statements beside ours."""
    return f"""## Fig. 8: GPT with DAPPLE (1F1B)

DGX-1 (V100 32 GB):

{fig8a}
A100 40 GB, NVSwitch:

{fig8b}
The paper: DAPPLE stops at 5.3B; recomputation reaches 10.3B on the DGX-1 (19.2% slower than
MPress there) and 15.4B on the A100 server; MPress trains all sizes up to 25.5B (20.4B in
Fig. 8a). Ours at 10.3B on the DGX-1: MPress against recomputation
{_ratio(r8a[('gpt-10.3b', 'MPress')], r8a[('gpt-10.3b', 'DAPPLE+Recomp')])}, against ZeRO-Infinity
{_ratio(r8a[('gpt-10.3b', 'MPress')], r8a[('gpt-10.3b', 'ZeRO-Infinity')])}, against ZeRO-Offload
{_ratio(r8a[('gpt-10.3b', 'MPress')], r8a[('gpt-10.3b', 'ZeRO-Offload')])}.

The paper has ZeRO-Offload train 20.4B on the DGX-1. ZeRO-Offload is ZeRO-2, which shards
gradients and optimizer states but keeps every GPU's fp16 weights whole: 2 bytes x 20.4B =
40.8 GB of weights alone on a 32 GB V100, before any activation. Ours runs out there, as
that accounting says it must; the paper's run must have sharded the weights as well
(ZeRO-3 with optimizer offload), which is our `zero-infinity` with its states on the host.

"""


def _mpress_fig9_text(fig9_rows: list[list[str]], bound_rows: list[list[str]]) -> str:
    """Fig. 9's section (IV-D): the ablation table, why our gains are nothing, and the
    unbounded-memory bound on what mapping and striping could give."""
    link_s, layer_s = _layer_over_one_link("dgx1-v100")
    return f"""## Fig. 9: device mapping and data striping (GPT-15.4B, microbatch 2)

Throughput relative to the default (DAPPLE's map, D2D without striping):

{_md_table(["server"] + list(FIG9_ABLATION) + [f"default plan, peer links x{PEER_LINK_FACTOR:g} faster"], fig9_rows)}

The paper: on the DGX-1 mapping adds 17.4% and striping 33.3%; on the symmetric A100
server mapping adds nothing and striping 11.0%. Ours: nothing on either server. The last
column is why: the default plan simulated again on a server whose NVLinks are
{PEER_LINK_FACTOR:g} times faster runs at most about 1% faster, and that is all any stage-to-GPU
map or any striping of its D2D swaps could give it. Its D2D copies are never what the
iteration waits for. In our GPT-15.4B every stage is short of memory before planning
(model states alone are 246 GB of the server's 252 GB), so the time lost goes to
streaming optimizer states over PCIe and to recomputation, and D2D swap is bounded by
spare memory, not by link bandwidth. Each variant keeps the fastest of the plans it may
make (with and without the mapping and striping it allows, Fig. 5's emulator
feedback), so mapping and striping never make a plan slower. The paper's gains need D2D
transfers that are exposed; its runtime (III-E) reports per-tensor swaps whose timing we
cannot recover from the paper.

Even without the memory bound the links do not give the paper's gains. Below, the default
plan is simulated on the same server with unbounded GPU memory, as planned and with every
layer it recomputes or swaps to the host sent by D2D swap instead: each stage to its
slowest NVLink neighbour, to its fastest one, or striped over all of them by bandwidth
(iteration time; in brackets, throughput over the slowest neighbour):

{_md_table(["server", "default plan", "unbounded memory: as planned"]
           + [f"every saving by D2D, {r}" for r in D2D_BOUND_ROUTES], bound_rows)}

Choosing the fastest neighbour over the slowest is about the most a mapping can give a
stage, and striping over all neighbours the most any striping can; neither reaches
the paper's 17.4% and 33.3% on the DGX-1. A GPT-15.4B layer's activations go out and back
over one of the DGX-1's single NVLinks in {link_s * 1e3:.0f} ms, over a double one in
{link_s * 5e2:.0f} ms, while its forward and backward take {layer_s * 1e3:.0f} ms, and a stage
swaps only some of its layers, so even one link nearly keeps up with the compute. On the
NVSwitch server every peer is reached through the same GPU port, so striping adds no
bandwidth.

"""


def _mpress_table4_text(table4_rows: list[list[str]]) -> str:
    """Table IV's section: the bytes each technique saves, ours beside the paper's shares."""
    return f"""## Table IV: what each technique saves (MPress plans, DGX-1)

Bytes kept off the GPUs at their peaks, summed over GPUs (host swap includes optimizer
states streamed to the host and PipeDream's stashed weights):

{_md_table(["model", "fits", "recomputation", "GPU-CPU swap", "D2D swap"], table4_rows)}

The paper: recomputation 51-91% of the saving, GPU-CPU swap 0-42%, D2D 4-23%.
"""


def mpress_report(out: Path, progress: _Progress) -> str:
    """MPress Fig. 7, 8 (IV-B, IV-C), Fig. 9 (IV-D) and Table IV, with the paper's claims."""
    (fig7, fig8a, fig8b), (r7, r8a, _r8b) = _mpress_figs(out, progress)
    fig9, fig9_rows, bound_rows = _fig9(progress)
    fig9_text = _mpress_fig9_text(fig9_rows, bound_rows)
    table4_rows = _table4_rows(progress)
    claims = _md_table(["claim", "paper", "ours", "ours / paper", "within ±50% (Fig. 9: half the gain)"],
                       claims_rows({"7": r7, "8a": r8a}, fig9))
    text = (_mpress_intro_text(claims) + _mpress_fig7_text(fig7, r7) + _mpress_fig8_text(fig8a, fig8b, r8a)
            + fig9_text + _mpress_table4_text(table4_rows))
    (out / "mpress.md").write_text(text)
    return text


def mcap_report(out: Path, progress: _Progress) -> str:
    """mCAP 4.3 on transformer stacks (DGX-1) and 4.2 on VGG-11 (``mpsim.studies.reproduce_tsplit``)."""
    from mpsim.studies.capacity import fits
    from mpsim.studies.reproduce_tsplit import mcap_vgg11_text

    rows = []
    for server, family, sched, mb, strategy in (("dgx1-v100", "gpt", "1f1b", 2, "none"),
                                               ("dgx1-v100", "gpt", "1f1b", 2, "recompute"),
                                               ("dgx1-v100", "bert", "pipedream", 12, "none"),
                                               ("dgx1-v100", "bert", "pipedream", 12, "recompute")):
        cells = [f"{family}, {sched}, {strategy}"]
        largest = {}
        for partition in ("compute", "memory"):
            progress(f"mcap: {family} {strategy} {partition}")
            rep = fits(server, family, sched, mb, 16, strategy, partition)
            largest[partition] = rep.largest.params if rep.largest else 0
            peak = rep.rows[1].result.max_peak_bytes / GiB
            cells.append(f"{peak:.1f}")
        cells += [f"{largest['compute'] / 1e9:.2f}B", f"{largest['memory'] / 1e9:.2f}B",
                  f"{largest['memory'] / max(1, largest['compute']):.2f}x"]
        rows.append(cells)
    text = f"""# mCAP, simulated

Regenerated by `mpsim reproduce`. Compute-balanced partition (PipeDream, DAPPLE,
torchgpipe) against the memory-balanced one (mCAP 3; found exactly by a min-max dynamic
programme over mem_isolated/mem_added statistics of the trace), on the DGX-1. Peak:
the highest per-GPU peak (GiB) of the second shipped size of the family; largest: the
largest model that fits (`mpsim fits --partition ...`).

{_md_table(["job", "peak, compute", "peak, memory", "largest, compute", "largest, memory", "ratio"], rows)}

The paper (4.3): 35% lower peak for AmoebaNet-D(36, 544) and a 1.55x larger trainable model
on 4 x TITAN RTX with torchgpipe (GPipe with recomputation). Ours are transformer stacks,
whose layers are identical, so imbalance comes only from the schedule (stage i holds p - i
microbatches under 1F1B and PipeDream, and p - i weight versions under PipeDream) and from
the embedding and head: the gain is large under PipeDream and smaller under 1F1B with
recomputation, where activations matter less. The brute-force check (mCAP-BF) agrees with
the dynamic programme on every case small enough to enumerate (tests/test_mcap.py).
AmoebaNet-D is not traceable here (`mpsim.models.cnn` does not build it), so the paper's 35%
lower peak and 1.55x larger model (3.61B against 2.32B parameters) have no CNN row of ours.

{mcap_vgg11_text(progress)}"""
    (out / "mcap.md").write_text(text)
    return text


def tsplit_report(out: Path, progress: _Progress) -> str:
    """TSPLIT Tables IV and V (``mpsim.studies.reproduce_tsplit``)."""
    from mpsim.studies.reproduce_tsplit import tsplit_report_text

    text = tsplit_report_text(progress)
    (out / "tsplit.md").write_text(text)
    return text


REPORTS: dict[str, Callable[[Path, _Progress], str]] = {"mpress": mpress_report, "mcap": mcap_report,
                                                        "tsplit": tsplit_report}
