"""Which server to buy or rent: one model on several servers, each with its fastest plan
that fits, ranked by cost per sample (or by throughput).

For every server the allowed strategies (``best`` by default: every planner under both
partitions) are tried at every allowed microbatch size in every allowed parallel layout
(``mpsim.plans.layouts``: by default the pipeline over all GPUs and one data-parallel replica per
GPU under DDP and ZeRO 1 to 3); the fastest plan that fits stands for the server. The global
batch is the same in every layout: ``global_microbatches`` per iteration over all replicas
(``--global-microbatches``; each replica runs its share, the job's ``microbatches``). Where
nothing fits, the plan with the smallest shortfall (highest per-GPU peak above capacity) does, and names the technique
that came closest. Cost per million samples is the hourly price over the samples an hour
trains; per million tokens for language models (``seq_len`` in the trace's ``model``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from mpsim.data.catalog import load_topology, load_trace, shipped_topologies
from mpsim.errors import MpsimError
from mpsim.hardware.topology import MAX_USD, Topology
from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.models.trace import Trace
from mpsim.planners.best import part_of
from mpsim.planners.registry import plan_job
from mpsim.plans.job import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE, JobSpec, check_strategy, partitions_of, pipeline
from mpsim.plans.layouts import CHOOSE_LAYOUTS, candidate_layouts, check_global_microbatches, on_layout
from mpsim.plans.strategies import combines
from mpsim.sim import SimResult
from mpsim.studies import bounds
from mpsim.studies.backends import Backend, run_points
from mpsim.timing.runtime import DEFAULT_PROFILE
from mpsim.units import GiB, format_rate

RANK_BY: tuple[str, ...] = ("cost", "throughput")
"""``cost``: USD per million samples, cheapest first (servers without a price after those
with one, by throughput); ``throughput``: samples per second, fastest first. Servers where
nothing fits come last either way, the smallest shortfall first."""
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Price:
    """An hourly price and where it comes from (``override``: given with ``--price``)."""

    usd_per_hour: float | None
    source: str = ""
    date: str = ""
    purchase_usd: float | None = None
    override: bool = False

    def to_dict(self) -> dict:
        return {"usd_per_hour": self.usd_per_hour, "source": self.source, "date": self.date,
                "purchase_usd": self.purchase_usd, "override": self.override}


@dataclass(frozen=True)
class Tried:
    """One plan tried on a server: microbatch size, strategy as the planner labels it, layout."""

    microbatch: int
    strategy: str
    partition: str
    fits: bool
    samples_per_s: float
    max_peak_bytes: int
    shortfall_bytes: int
    """Highest per-GPU peak above capacity (0 when it fits)."""
    layout: str = ""
    """``pipeline x8``, ``FSDP x8``, ... (``Parallelism.describe``)."""

    def to_dict(self) -> dict:
        return {"microbatch": self.microbatch, "strategy": self.strategy, "partition": self.partition,
                "layout": self.layout, "fits": self.fits, "samples_per_s": self.samples_per_s,
                "max_peak_bytes": self.max_peak_bytes, "shortfall_bytes": self.shortfall_bytes}


@dataclass
class ChooseRow:
    """One server's answer: the plan that stands for it, its throughput, memory and cost."""

    server: str
    source: str
    n_gpus: int
    gpu_model: str
    capacity_bytes: int
    result: SimResult
    """The fastest plan that fits, else the one with the smallest shortfall."""
    tried: list[Tried]
    price: Price
    seq_len: int | None
    pareto: bool = False
    rank: int = 0
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    faster_at_risk: SimResult | None = None
    """A faster plan that fits but is at risk, passed over for ``result``."""
    decided_by_floors: int = 0
    """Plans left out of ``tried`` because the closed-form floors showed they could not
    fit or could not beat a safe plan found (``mpsim.studies.bounds``)."""

    @property
    def fits(self) -> bool:
        return self.result.fits

    @property
    def at_risk(self) -> str:
        """Why the plan that stands for the server may still run out (``SimResult.at_risk``), or ``""``."""
        return self.result.at_risk(self.headroom_gib)

    @property
    def band_pct(self) -> float:
        """Its throughput's error band, % either side (``SimResult.time_band_pct``)."""
        return self.result.time_band_pct

    @property
    def microbatch(self) -> int:
        return self.result.microbatch

    @property
    def strategy(self) -> str:
        return self.result.strategy

    @property
    def layout(self) -> str:
        """The parallel layout of the plan: ``FSDP x8``, ``pipeline x8``, ..."""
        return self.result.layout

    @property
    def technique(self) -> str:
        """The planner behind the plan: ``mpress`` for ``best (mpress, compute partition)``."""
        part = part_of(self.result.strategy)
        return self.result.strategy if part is None else part[0]

    @property
    def samples_per_s(self) -> float:
        return self.result.samples_per_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.seq_len is None else self.samples_per_s * self.seq_len

    @property
    def max_peak_bytes(self) -> int:
        return self.result.max_peak_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, max(g.peak_bytes - g.capacity_bytes for g in self.result.gpus))

    @property
    def usd_per_million_samples(self) -> float | None:
        if self.price.usd_per_hour is None or not self.fits or self.samples_per_s <= 0:
            return None
        return self.price.usd_per_hour / (self.samples_per_s * SECONDS_PER_HOUR) * 1e6

    @property
    def usd_per_million_tokens(self) -> float | None:
        per_sample = self.usd_per_million_samples
        return None if per_sample is None or self.seq_len is None else per_sample / self.seq_len

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "server": self.server, "source": self.source, "n_gpus": self.n_gpus,
            "gpu_model": self.gpu_model, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "at_risk": self.at_risk, "samples_per_s_band": self.result.samples_per_s_band,
            "faster_at_risk": None if self.faster_at_risk is None else _risky(self.faster_at_risk, self.headroom_gib),
            "time_band_pct": self.band_pct,
            "layout": self.layout, "replicas": self.result.replicas, "microbatch": self.microbatch,
            "microbatches": self.result.microbatches, "strategy": self.strategy,
            "technique": self.technique, "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
            "iteration_s": self.result.iteration_s, "max_peak_bytes": self.max_peak_bytes,
            "peak_bytes": [g.peak_bytes for g in self.result.gpus], "shortfall_bytes": self.shortfall_bytes,
            "price": self.price.to_dict(), "usd_per_million_samples": self.usd_per_million_samples,
            "usd_per_million_tokens": self.usd_per_million_tokens, "pareto": self.pareto,
            "tried": [t.to_dict() for t in self.tried], "decided_by_floors": self.decided_by_floors,
        }


def _risky(r: SimResult, headroom_gib: float) -> dict:
    return {"layout": r.layout, "strategy": r.strategy, "microbatch": r.microbatch, "samples_per_s": r.samples_per_s,
            "at_risk": r.at_risk(headroom_gib)}


@dataclass
class ChooseReport:
    model: str
    schedule: str
    microbatches: int
    """The global batch: microbatches per iteration over all replicas (each layout's replicas
    run their share, ``ChooseRow``'s per-replica count); ``global_microbatches`` in ``to_dict``."""
    microbatch_sizes: tuple[int, ...]
    strategies: tuple[str, ...]
    rank_by: str
    seq_len: int | None
    rows: list[ChooseRow] = field(default_factory=list)
    layouts: str = CHOOSE_LAYOUTS
    """The layouts searched (``--layouts``: words and names, ``mpsim.plans.layouts``)."""
    headroom_gib: float = DEFAULT_HEADROOM_GIB
    """The margin a plan should leave (``--headroom``): plans closer are at risk."""
    runtime_profile: str = DEFAULT_PROFILE
    """The framework's run-time rules every plan ran under (``--runtime``)."""

    @property
    def recommendation(self) -> str:
        return recommendation(self)

    @property
    def ties(self) -> list[ChooseRow]:
        """Servers that fit whose ranking figure (cost per unit of work, or throughput) is
        within the error band of the first's (the wider of the two rows' bands): which of
        them is better, the model cannot tell."""
        if not self.rows or not self.rows[0].fits:
            return []
        top = self.rows[0]
        return [r for r in self.rows[1:] if r.fits and _within_band(self, top, r)]

    def to_dict(self) -> dict:
        return {"model": self.model, "schedule": self.schedule, "global_microbatches": self.microbatches,
                "microbatch_sizes": list(self.microbatch_sizes), "strategies": list(self.strategies),
                "layouts": self.layouts, "rank_by": self.rank_by, "seq_len": self.seq_len,
                "headroom_gib": self.headroom_gib, "runtime_profile": self.runtime_profile,
                "recommendation": self.recommendation,
                "ties": [r.server for r in self.ties],
                "rows": [r.to_dict() for r in self.rows]}


# -- inputs ---------------------------------------------------------------------------------

def all_servers(schedule: str, global_microbatches: int) -> list[str]:
    """``--servers all``: every shipped server with at least two GPUs (a pipeline) whose
    GPUs the schedule can fill with one stage each at ``global_microbatches`` (a pipeline
    over all GPUs is one replica: it runs them all)."""
    names = []
    for name in shipped_topologies():
        n = load_topology(name).n_gpus
        if n >= 2 and (schedule == "gpipe" or global_microbatches >= n):
            names.append(name)
    return names


def parse_servers(text: str, schedule: str = DEFAULT_SCHEDULE,
                  global_microbatches: int = DEFAULT_MICROBATCHES) -> list[str]:
    """``all`` or a comma-separated list of shipped names and topology files."""
    if text.strip() == "all":
        return all_servers(schedule, global_microbatches)
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise MpsimError(f"--servers: expected 'all' or a comma-separated list without empty items, got {text!r}")
    return list(dict.fromkeys(items))


def parse_price(text: str) -> tuple[str, float]:
    """``SERVER=USD`` or ``SERVER=USD/h`` (on-demand USD per hour of the whole server)."""
    server, sep, value = text.partition("=")
    number = value.strip().removesuffix("/h").strip()
    try:
        usd = float(number)
    except ValueError:
        usd = math.nan
    if not sep or not server.strip() or not math.isfinite(usd):
        raise MpsimError(f"--price: expected SERVER=USD/h (e.g. dgx-h100=55.04), got {text!r}")
    if not 0 < usd <= MAX_USD:
        raise MpsimError(f"--price {server.strip()}: USD per hour must be above 0 and at most {MAX_USD:g}, got {usd:g}")
    return server.strip(), usd


def _price_of(topo: Topology, key: str, overrides: Mapping[str, float]) -> Price:
    spec = topo.spec.price
    purchase = spec.purchase.usd if spec and spec.purchase else None
    for name in (key, topo.name):
        if name in overrides:
            return Price(overrides[name], "--price", "", purchase, override=True)
    if spec is None or spec.on_demand is None:
        return Price(None, "", "", purchase)
    return Price(spec.on_demand.usd_per_hour, spec.on_demand.source, spec.on_demand.date, purchase)


def _check_inputs(servers: Sequence[str | Topology], strategies: Sequence[str], prices: Mapping[str, float]) -> None:
    """What no job checks: a server and a strategy to choose from, the prices."""
    if not servers:
        raise MpsimError("--servers: no server to choose from")
    if not strategies:
        raise MpsimError("--strategy needs at least one strategy")
    for key, usd in prices.items():
        if not (math.isfinite(usd) and 0 < usd <= MAX_USD):
            raise MpsimError(f"--price {key}: USD per hour must be above 0 and at most {MAX_USD:g}, got {usd:g}")


# -- the search ------------------------------------------------------------------------------

def _shortfall(r: SimResult) -> int:
    return max(0, max(g.peak_bytes - g.capacity_bytes for g in r.gpus))


def _server_plans(jobs: Sequence[JobSpec], scaled: Sequence[Trace], strategies: Sequence[str],
                  on_point: Callable[[str], None] | None,
                  headroom_gib: float = DEFAULT_HEADROOM_GIB) -> tuple[list[tuple[Tried, SimResult]], int]:
    """Every plan ``choose`` tries on one server: each layout (``jobs``: the job in each),
    each size (``scaled``: the trace at each), each strategy, each single planner under
    both partitions (a combining one, ``best``, varies them itself); and how many of them
    the closed-form floors decided (``mpsim.studies.bounds``), which are left out.

    Candidates are simulated fastest floor first. One whose floor on the iteration time
    makes it slower than a safe plan already found cannot stand for the server nor be
    the faster plan at risk, and is skipped; one whose memory floors show it cannot fit
    waits until the end and is simulated only when nothing fitted (its shortfall then
    counts). The answer is that of simulating all of them (``tests/test_bounds.py``)."""
    candidates = [(k, job.but(trace=trace, partition=partition, strategy=strategy))
                  for k, (job, trace, strategy, partition) in enumerate(_candidates(jobs, scaled, strategies))]
    if not bounds.in_use():
        return [_tried(job, on_point) for _, job in candidates], 0
    floors = {k: bounds.floors(job) for k, job in candidates}
    order = sorted(candidates, key=lambda c: floors[c[0]].iteration_floor_s or 0.0)
    done: dict[int, tuple[Tried, SimResult]] = {}
    unfit: list[tuple[int, JobSpec]] = []
    safe_samples_per_s = 0.0
    for k, job in order:
        if floors[k].cannot_fit():
            unfit.append((k, job))
            continue
        if floors[k].max_samples_per_s(job.samples_per_iteration) < safe_samples_per_s:
            continue
        done[k] = _tried(job, on_point)
        r = done[k][1]
        if r.fits and r.samples_per_s > safe_samples_per_s and not r.at_risk(headroom_gib):
            safe_samples_per_s = r.samples_per_s
    if not any(t.fits for t, _ in done.values()):
        done.update((k, _tried(job, on_point)) for k, job in unfit)
    return [done[k] for k, _ in candidates if k in done], len(candidates) - len(done)


def _candidates(jobs: Sequence[JobSpec], scaled: Sequence[Trace],
                strategies: Sequence[str]) -> list[tuple[JobSpec, Trace, str, str]]:
    return [(job, trace, strategy, partition) for job in jobs for trace in scaled for strategy in strategies
            for partition in (("compute",) if combines(strategy) else partitions_of(job.parallelism))]


def _tried(job: JobSpec, on_point: Callable[[str], None] | None) -> tuple[Tried, SimResult]:
    r = plan_job(job).result
    if on_point:
        on_point(f"{job.topology.name} {r.layout} mb {job.trace.microbatch} {r.strategy}: "
                 f"{'fits' if r.fits else 'OOM'}")
    return Tried(job.trace.microbatch, r.strategy, job.partition, r.fits, r.samples_per_s, r.max_peak_bytes,
                 _shortfall(r), r.layout), r


def _standing(tried: list[tuple[Tried, SimResult]], headroom_gib: float) -> SimResult:
    """The fastest that fits and is not at risk (``SimResult.at_risk``), else the fastest
    that fits, else the smallest shortfall. Plans are checked for risk fastest first, and
    only until one is safe."""
    def key(pair: tuple[Tried, SimResult]) -> tuple:
        t = pair[0]
        return (0, -t.samples_per_s, t.max_peak_bytes) if t.fits else (1, t.shortfall_bytes, -t.samples_per_s)

    ordered = sorted(tried, key=key)
    safe = next((r for t, r in ordered if t.fits and not r.at_risk(headroom_gib)), None)
    return safe if safe is not None else ordered[0][1]


def _faster_at_risk(tried: list[tuple[Tried, SimResult]], standing: SimResult) -> SimResult | None:
    """The fastest plan that fits, where a slower safe one stands for the server instead."""
    fitting = [r for t, r in tried if t.fits]
    fastest = max(fitting, key=lambda r: r.samples_per_s, default=None)
    return fastest if fastest is not None and fastest.samples_per_s > standing.samples_per_s else None


def _rank_key(rank_by: str) -> Callable[[ChooseRow], tuple]:
    def key(row: ChooseRow) -> tuple:
        if not row.fits:
            return (2, row.shortfall_bytes, row.server)
        cost = row.usd_per_million_samples
        if rank_by == "cost":
            return (0, 0, cost, row.server) if cost is not None else (0, 1, -row.samples_per_s, row.server)
        return (0, 0, -row.samples_per_s, row.server)
    return key


def _mark_pareto(rows: list[ChooseRow]) -> None:
    """On the front: fits, has a price, and no other such server is at least as fast for at
    most the price per hour with one of the two strictly better."""
    priced = [r for r in rows if r.fits and r.price.usd_per_hour is not None]
    for r in priced:
        p, s = r.price.usd_per_hour, r.samples_per_s
        r.pareto = not any(o is not r and o.price.usd_per_hour <= p and o.samples_per_s >= s  # type: ignore[operator]
                           and (o.price.usd_per_hour < p or o.samples_per_s > s) for o in priced)  # type: ignore[operator]


def choose(model: str | Trace, servers: Sequence[str | Topology] | str = "all", schedule: str = DEFAULT_SCHEDULE,
           microbatch_sizes: Sequence[int] | None = None, strategies: Sequence[str] = ("best",),
           global_microbatches: int = DEFAULT_MICROBATCHES, prices: Mapping[str, float] | None = None,
           rank_by: str = "cost", on_point: Callable[[str], None] | None = None,
           layouts: str = CHOOSE_LAYOUTS, headroom_gib: float = DEFAULT_HEADROOM_GIB,
           backend: Backend | None = None, runtime_profile: str = DEFAULT_PROFILE) -> ChooseReport:
    """Rank ``servers`` for training ``model``: per server the fastest plan that fits over
    ``layouts`` (``mpsim.plans.layouts.candidate_layouts``: words and names), ``strategies``
    (each single planner under both partitions; ``best`` tries them all) and
    ``microbatch_sizes`` (None: the trace's own), ``global_microbatches`` per iteration over
    all replicas (``ceil(global_microbatches / replicas)`` each, at least one per stage for 1f1b).
    ``prices`` maps a server (as given, or its name) to USD per hour and overrides its
    file's ``price``. ``on_point`` hears a line after each plan. A plan that fits with
    less than ``headroom_gib`` to spare is at risk: a safe one stands for its server when
    there is one. ``backend``: the servers searched on its workers, one task each (None:
    in this process, ``on_point`` hearing each plan; on a backend it hears each server).
    ``runtime_profile``: the framework's run-time rules every job runs under
    (``mpsim.timing.runtime``)."""
    if rank_by not in RANK_BY:
        raise MpsimError(f"--rank-by: expected one of {', '.join(RANK_BY)}, got {rank_by!r}")
    check_global_microbatches(global_microbatches)
    trace = load_trace(model) if isinstance(model, str) else model
    server_list = (parse_servers(servers, schedule, global_microbatches) if isinstance(servers, str)
                   else list({(s if isinstance(s, str) else id(s)): s for s in servers}.values()))  # each once
    sizes = tuple(microbatch_sizes) if microbatch_sizes else (trace.microbatch,)
    overrides = dict(prices or {})
    _check_inputs(server_list, strategies, overrides)
    scaled = [trace.rescale(mb) for mb in sizes]  # each size checked and rescaled once
    topos = [(s, load_topology(s)) if isinstance(s, str) else (s.name, s) for s in server_list]
    unknown = set(overrides) - {k for k, _ in topos} - {t.name for _, t in topos}
    if unknown:
        raise MpsimError(f"--price: no server {sorted(unknown)[0]!r} among {', '.join(k for k, _ in topos)}")
    jobs = [(key, topo, _jobs_on(topo, trace, schedule, global_microbatches, strategies, layouts, runtime_profile))
            for key, topo in topos]
    seq_len = trace.seq_len
    rows = []
    for key, topo, (tried, decided) in _searched(jobs, scaled, strategies, on_point, headroom_gib, backend):
        standing = _standing(tried, headroom_gib)
        rows.append(ChooseRow(topo.name, topo.source or key, topo.n_gpus, topo.spec.gpu.model, topo.capacity_bytes,
                              standing, [t for t, _ in tried], _price_of(topo, key, overrides), seq_len,
                              headroom_gib=headroom_gib, faster_at_risk=_faster_at_risk(tried, standing),
                              decided_by_floors=decided))
    rows.sort(key=_rank_key(rank_by))
    for i, row in enumerate(rows, 1):
        row.rank = i
    _mark_pareto(rows)
    return ChooseReport(trace.name, schedule, global_microbatches, sizes, tuple(strategies), rank_by, seq_len, rows,
                        layouts, headroom_gib, runtime_profile)


@dataclass(frozen=True)
class _ServerSearch:
    """One server's search (picklable: runs on a worker process or Ray)."""

    index: int
    """Its place among the servers."""
    jobs: tuple[JobSpec, ...]
    scaled: tuple[Trace, ...]
    strategies: tuple[str, ...]
    headroom_gib: float


def _search_server(work: _ServerSearch) -> tuple[list[tuple[Tried, SimResult]], int]:
    """On a worker: ``_server_plans`` of one server."""
    return _server_plans(work.jobs, work.scaled, work.strategies, None, work.headroom_gib)


def _searched(jobs: list[tuple[str, Topology, list[JobSpec]]], scaled: Sequence[Trace], strategies: Sequence[str],
              on_point: Callable[[str], None] | None, headroom_gib: float, backend: Backend | None
              ) -> Iterator[tuple[str, Topology, tuple[list[tuple[Tried, SimResult]], int]]]:
    """Each server's plans (``_server_plans``), in the order of ``jobs``: here one after
    another, or every server at once on ``backend`` (the same answers: each server's search
    is its own)."""
    if backend is None:
        for key, topo, on_topo in jobs:
            yield key, topo, _server_plans(on_topo, scaled, strategies, on_point, headroom_gib)
        return
    work = [_ServerSearch(k, tuple(on_topo), tuple(scaled), tuple(strategies), headroom_gib)
            for k, (_, _, on_topo) in enumerate(jobs)]
    found: dict[int, tuple[list[tuple[Tried, SimResult]], int]] = {}
    for outcome in run_points(work, _search_server, backend, batch=1):
        k = outcome.point.index
        key, topo, _ = jobs[k]
        if outcome.value is None:
            raise MpsimError(f"choose on {key}: {outcome.error}")
        found[k] = outcome.value
        if on_point:
            on_point(f"{topo.name}: {len(outcome.value[0])} plans tried")
    for k, (key, topo, _) in enumerate(jobs):
        yield key, topo, found[k]


def _jobs_on(topo: Topology, trace: Trace, schedule: str, global_microbatches: int, strategies: Sequence[str],
             layouts: str, runtime_profile: str = DEFAULT_PROFILE) -> list[JobSpec]:
    """The job on one server in each layout (each checked), every strategy checked before
    any is planned. The base job is one stage on the server (its schedule and microbatch
    count checked there); ``on_layout`` gives each layout's replicas their share of the
    ``global_microbatches``."""
    for strategy in strategies:
        check_strategy(strategy)
    base = JobSpec(topo, trace, schedule, global_microbatches, pipeline(1), runtime_profile=runtime_profile)
    return [on_layout(base, p, global_microbatches) for p in candidate_layouts(topo, layouts, schedule, trace)]


# -- the answer in words: the report's one line (its tables and chart are in mpsim.views) -----

def money(usd: float | None) -> str:
    """USD as the answer and its tables write it: cents from 10 up, else tenths of a cent."""
    return "-" if usd is None else (f"{usd:,.2f}" if usd >= 10 else f"{usd:.3f}")


def _unit(report: ChooseReport) -> str:
    return "million tokens" if report.seq_len else "million samples"


def _cost(report: ChooseReport, row: ChooseRow) -> float | None:
    return row.usd_per_million_tokens if report.seq_len else row.usd_per_million_samples


def _closest(rows: list[ChooseRow]) -> str:
    r = min(rows, key=lambda x: x.shortfall_bytes)
    return (f"{r.server} comes closest, {r.shortfall_bytes / GiB:.2f} GiB per GPU short with {r.layout}, "
            f"{r.technique} at microbatch {r.microbatch}")


def _within_band(report: ChooseReport, a: ChooseRow, b: ChooseRow) -> bool:
    """``a`` and ``b`` differ by no more than the wider of their error bands in what the
    ranking compares (``ChooseReport.ties``): samples per USD when ranked by cost and both
    are priced, else samples/s."""
    band = max(a.band_pct, b.band_pct) / 100
    cost_a, cost_b = a.usd_per_million_samples, b.usd_per_million_samples
    va, vb = a.samples_per_s, b.samples_per_s
    if report.rank_by == "cost" and cost_a and cost_b:
        va, vb = 1 / cost_a, 1 / cost_b
    return band > 0 and min(va, vb) > 0 and max(va, vb) / min(va, vb) - 1 <= band


def _ties_clause(report: ChooseReport) -> str:
    ties = report.ties
    if not ties:
        return ""
    band = max(r.band_pct for r in [report.rows[0], *ties])
    return (f"; a tie within the time model's ±{band:g}% band with {', '.join(r.server for r in ties)}: "
            "which is better, the simulation cannot tell")


def recommendation(report: ChooseReport) -> str:
    """One line: which server, and why (fastest, cheapest per unit of work, or both)."""
    fitting = [r for r in report.rows if r.fits]
    if not fitting:
        return f"nothing fits {report.model} on any server tried: {_closest(report.rows)}"
    top, fastest = report.rows[0], max(fitting, key=lambda r: r.samples_per_s)
    priced = [r for r in fitting if _cost(report, r) is not None]
    cheapest = min(priced, key=lambda r: _cost(report, r)) if priced else None  # type: ignore[arg-type,return-value]
    unit = _unit(report)
    reasons = []
    if top is fastest:
        reasons.append("fastest")
    if top is cheapest:
        reasons.append(f"cheapest per {unit}")
    line = f"{top.server}: {' and '.join(reasons) or 'ranked first'}"
    line += (f" ({format_rate(top.samples_per_s)} samples/s, {top.layout}, plan {top.technique}, "
             f"microbatch {top.microbatch}")
    line += f", USD {money(_cost(report, top))} per {unit})" if _cost(report, top) is not None else ")"
    if top is not fastest:
        line += (f"; {fastest.server} is {fastest.samples_per_s / top.samples_per_s:.2f}x faster"
                 + (f" at USD {money(_cost(report, fastest))} per {unit}" if _cost(report, fastest) else ""))
    if cheapest is not None and top is not cheapest:
        line += f"; {cheapest.server} is cheapest at USD {money(_cost(report, cheapest))} per {unit}"
    line += _ties_clause(report)
    if top.at_risk:
        line += f"; its plan is at risk ({top.at_risk})"
    elif top.faster_at_risk is not None:
        f = top.faster_at_risk
        line += (f"; a faster plan on {top.server} ({f.layout}, {format_rate(f.samples_per_s)} samples/s) is at risk: "
                 f"{f.at_risk(top.headroom_gib)}")
    misses = [r for r in report.rows if not r.fits]
    if misses:
        line += f"; does not fit on {', '.join(r.server for r in misses)}"
    return line
