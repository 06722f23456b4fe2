"""How many servers, with which layout, to train a model on N tokens: time and cost to train.

For every cluster (``mpsim.hardware.cluster``) the search tries server counts in powers of two up
to the cluster's ``max_servers`` and, on each, every layout of Megatron-LM's kind: tensor
parallel with sequence parallel inside a server (the degrees the model's heads allow),
pipeline across servers, and the data-parallel replicas left, their states sharded by
ZeRO-1 (Megatron's distributed optimizer), FSDP or HSDP (``LAYOUT_KINDS``), at each
microbatch size; a mixture of experts also with expert-parallel groups of every degree
that divides its experts (``EXPERT_DEGREES``) carved out of the replicas, ZeRO-1 over them.
The global batch is fixed (``batch_tokens``, as a training recipe fixes
it): each replica runs ``batch / (replicas x microbatch)`` microbatches, so more replicas
mean fewer microbatches and a larger pipeline bubble. Each configuration is simulated
(one iteration, one replica's pipeline: ``mpsim.sim``); a configuration whose peak does
not fit is tried again with selective, then full recomputation.

Per server count the fastest configuration that fits stands; time to train is tokens over
its tokens per second, cost is servers x hours x the server's price (``price`` of the
cluster or its server; ``discount`` off). The answer per cluster: the fewest servers that
train within ``days`` (and ``budget_usd``), and the Pareto front of days against cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from mpsim.data.catalog import load_cluster, load_trace
from mpsim.errors import MpsimError
from mpsim.hardware.cluster import DEFAULT_BATCH_TOKENS, Cluster
from mpsim.limits import check_microbatch
from mpsim.models.expert_parallel import UNIFORM, experts_line, moe_experts
from mpsim.models.trace import Trace
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.plans.layouts import LONG_CONTEXT_TOKENS
from mpsim.studies.backends import Backend, run_points

LAYOUT_KINDS: tuple[tuple[str, int, bool], ...] = (("ZeRO-1", 1, False), ("FSDP", 3, False), ("HSDP", 3, True))
"""Data-parallel kinds searched: (name, ZeRO stage, HSDP)."""
STRATEGIES: tuple[str, ...] = ("none", "selective", "recompute")
"""Tried in this order until one fits."""
HOURS_PER_DAY = 24.0
CONTEXT_DEGREES = (2, 4, 8, 16, 32, 64)
"""Context-parallel degrees searched for a sequence of ``LONG_CONTEXT_TOKENS`` or more
(those that split it), beside each tensor-parallel degree (Llama 3's long-context layouts:
TP8 x CP x PP x FSDP)."""
EXPERT_DEGREES = (2, 4, 8, 16, 32, 64)
"""Expert-parallel degrees searched for a mixture of experts (those dividing its experts)."""
MAX_PIPELINE = 16
"""Deepest pipeline searched: deeper ones run hundreds of microbatches per replica and
leave a layer or two a stage (an 80-layer model over 64 stages)."""


@dataclass(frozen=True)
class Shape:
    """A layout without its server count: tensor (with sequence parallel), pipeline, the
    data-parallel kind, and the microbatch size."""

    tensor: int
    pipeline: int
    zero_stage: int
    hsdp: bool
    microbatch: int
    expert: int = 1
    """Expert-parallel GPUs (a mixture of experts), carved out of the replicas."""
    context: int = 1
    """Context-parallel GPUs (a long sequence split over them), carved out of the replicas."""

    def parallelism(self, data: int) -> Parallelism:
        """The layout with ``data`` replicas in all (``expert`` or ``context`` of them a group)."""
        zero, hsdp = (self.zero_stage, self.hsdp) if data > 1 else (0, False)
        axes = tuple((n, k) for n, k in (("context", self.context), ("expert", self.expert)) if k > 1)
        return Parallelism(data=data // (self.expert * self.context), tensor=self.tensor,
                           sequence_parallel=self.tensor > 1, pipeline=self.pipeline, zero_stage=zero,  # type: ignore[arg-type]
                           hsdp=hsdp, axes=axes)


@dataclass(frozen=True)
class ClusterPoint:
    """One configuration to simulate (picklable: runs on worker processes or Ray)."""

    cluster: str
    model: str
    servers: int
    shape: Shape
    batch_samples: int
    strategy: str = "none"
    seq_len: int | None = None
    """The model retraced at this many tokens per sample (None: as shipped)."""


@dataclass(frozen=True)
class ClusterTried:
    """What one configuration gave."""

    point: ClusterPoint
    layout: str
    fits: bool
    iteration_s: float
    samples_per_s: float
    peak_bytes: int
    capacity_bytes: int
    states_bytes: int = 0
    """The most any GPU keeps of parameters, gradients and optimizer states: when it alone
    passes the capacity, recomputation cannot help."""


@dataclass
class ScaleRow:
    """The configuration that stands for ``servers`` servers of a cluster."""

    cluster: str
    servers: int
    gpus: int
    tried: ClusterTried
    tokens_per_s: float
    days: float
    usd: float | None
    within: bool = False
    """Meets ``days`` and ``budget_usd``."""
    pareto: bool = False

    def to_dict(self) -> dict:
        t = self.tried
        return {"cluster": self.cluster, "servers": self.servers, "gpus": self.gpus, "layout": t.layout,
                "strategy": t.point.strategy, "microbatch": t.point.shape.microbatch, "iteration_s": t.iteration_s,
                "tokens_per_s": self.tokens_per_s, "days": self.days, "usd": self.usd,
                "peak_bytes": t.peak_bytes, "capacity_bytes": t.capacity_bytes, "within": self.within,
                "pareto": self.pareto}


@dataclass
class ClusterAnswer:
    cluster: str
    description: str
    usd_per_server_hour: float | None
    price_source: str
    rows: list[ScaleRow]
    simulated: int
    """Configurations simulated for this cluster."""
    pick: ScaleRow | None = None
    """The fewest servers within the deadline and budget (None: none is)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Configurations left out before simulating, by why (``skip_reason``)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Configurations whose simulation failed, by the error's line."""
    counts: tuple[int, ...] = ()
    """The server counts searched (``server_counts`` within --min-servers and --max-servers)."""

    def to_dict(self) -> dict:
        return {"cluster": self.cluster, "description": self.description,
                "usd_per_server_hour": self.usd_per_server_hour, "price_source": self.price_source,
                "simulated": self.simulated, "pick": None if self.pick is None else self.pick.servers,
                "skipped": dict(self.skipped), "failed": dict(self.failed),
                "rows": [r.to_dict() for r in self.rows]}

    def searched(self) -> str:
        """What the search of this cluster tried and left out, in one line."""
        counts = (f"{len(self.counts)} server count(s) ({', '.join(map(str, self.counts))})" if self.counts
                  else "no server count")
        line = f"{self.cluster}: {self.simulated} configuration(s) simulated on {counts}"
        left = sum(self.skipped.values())
        if left:
            line += f"; {left} left out: " + ", ".join(f"{k} ({v})" for k, v in
                                                        sorted(self.skipped.items(), key=lambda kv: -kv[1]))
        if self.failed:
            line += f"; {sum(self.failed.values())} failed: " + ", ".join(f"{k} ({v})" for k, v in self.failed.items())
        return line


@dataclass
class ScaleReport:
    model: str
    tokens: float
    batch_tokens: int
    seq_len: int
    days: float | None
    budget_usd: float | None
    discount: float
    answers: list[ClusterAnswer] = field(default_factory=list)
    experts: str = ""
    """A mixture of experts' routing as the search assumed it (``expert_parallel.experts_line``)."""

    def recommendation(self) -> str:
        return recommendation(self)

    def to_dict(self) -> dict:
        return {"model": self.model, "tokens": self.tokens, "batch_tokens": self.batch_tokens,
                "seq_len": self.seq_len, "days": self.days, "budget_usd": self.budget_usd,
                "discount": self.discount, "experts": self.experts, "recommendation": self.recommendation(),
                "clusters": [a.to_dict() for a in self.answers]}


def seq_len_of(trace: Trace) -> int:
    seq = trace.seq_len
    if seq is None:
        raise MpsimError(f"{trace.name} has no sequence length (model.seq_len): time to train on tokens needs one")
    return seq


def _tensor_degrees(g: int, trace: Trace) -> list[int]:
    """The tensor-parallel degrees (with sequence parallel) a server of ``g`` GPUs gives the model."""
    from mpsim.models.tensor_parallel import check_shardable

    out = []
    for t in (d for d in (1, 2, 4, 8, 16, 32, 64) if d <= g and g % d == 0):
        try:
            check_shardable(trace, t, t > 1)
        except MpsimError:
            continue
        out.append(t)
    return out


def shapes(cluster: Cluster, trace: Trace, microbatch_sizes: Sequence[int]) -> list[Shape]:
    """Every layout shape the model splits into on ``cluster``'s servers (module doc)."""
    g = cluster.gpus_per_server
    out = []
    depths = [q for q in (1, 2, 4, 8, 16) if q <= min(trace.n_layers, MAX_PIPELINE)]
    for t in _tensor_degrees(g, trace):
        for p in depths:
            for _, zero, hsdp in LAYOUT_KINDS:
                out += [Shape(t, p, zero, hsdp, mb) for mb in microbatch_sizes]
    experts = moe_experts(trace)
    for e in (e for e in EXPERT_DEGREES if experts and experts % e == 0):  # ZeRO-1, Megatron-Core's MoE default
        out += [Shape(1, p, 1, False, mb, e) for p in depths for mb in microbatch_sizes]
    return out + _context_shapes(g, trace, depths, microbatch_sizes)


def _context_shapes(g: int, trace: Trace, depths: Sequence[int], microbatch_sizes: Sequence[int]) -> list[Shape]:
    """A long sequence's context-parallel shapes: every degree of ``CONTEXT_DEGREES`` that
    splits it, beside every tensor-parallel degree a server of ``g`` GPUs gives the model,
    every depth, ZeRO-1 or FSDP over data x context."""
    from mpsim.models.context_parallel import check_context_parallel

    if (trace.seq_len or 0) < LONG_CONTEXT_TOKENS or trace.is_moe:
        return []
    out: list[Shape] = []
    for t in _tensor_degrees(g, trace):
        for c in CONTEXT_DEGREES:
            try:
                check_context_parallel(trace, c, "ring", t)
            except MpsimError:
                continue
            out += [Shape(t, p, zero, False, mb, context=c) for p in depths for zero in (1, 3)
                    for mb in microbatch_sizes]
    return out


def job_of_point(point: ClusterPoint, cluster: Cluster | None = None, trace: Trace | None = None) -> JobSpec | None:
    """The job a point describes, or None when its layout does not split the batch or the
    servers (replicas must divide the global batch, stages need microbatches): why, in
    ``skip_reason``."""
    job = _job_or_reason(point, cluster, trace)
    return job if isinstance(job, JobSpec) else None


def skip_reason(point: ClusterPoint, cluster: Cluster | None = None, trace: Trace | None = None) -> str | None:
    """Why ``job_of_point`` has no job for ``point`` (None: it has one). ``NOT_A_LAYOUT`` when
    the shape is no layout of the point's servers (its tensor x pipeline GPUs do not divide
    theirs, HSDP on one server, or a single replica under another kind than ZeRO-1's, which
    is searched once as ZeRO-1's row): not a configuration left out."""
    job = _job_or_reason(point, cluster, trace)
    return None if isinstance(job, JobSpec) else job


NOT_A_LAYOUT = "not a layout of these servers"
"""``skip_reason`` of a shape that is no layout of the point's servers."""


def _job_or_reason(point: ClusterPoint, cluster: Cluster | None, trace: Trace | None) -> JobSpec | str:
    cluster = cluster or load_cluster(point.cluster)
    shape, n = point.shape, point.servers
    per_replica = shape.tensor * shape.pipeline
    gpus = n * cluster.gpus_per_server
    if gpus % per_replica or (shape.hsdp and n == 1):
        return NOT_A_LAYOUT
    data = gpus // per_replica
    if data % (shape.expert * shape.context):
        return NOT_A_LAYOUT
    samples = data // shape.context  # the context group shares each sample
    if point.batch_samples % (samples * shape.microbatch):
        return (f"replicas x microbatch do not divide the batch of {point.batch_samples} samples "
                "(--batch-tokens over the sequence length)")
    m = point.batch_samples // (samples * shape.microbatch)
    if m < shape.pipeline:
        return "fewer microbatches per replica than pipeline stages"
    if data == 1 and (shape.zero_stage, shape.hsdp) != LAYOUT_KINDS[0][1:]:
        return NOT_A_LAYOUT  # searched once, as ZeRO-1's row: it has nothing to shard
    trace = (trace or point_trace(point.model, point.seq_len)).rescale(shape.microbatch)
    try:
        return JobSpec(cluster.server, trace, "1f1b", m, shape.parallelism(data), strategy=point.strategy,
                       cluster=cluster, servers=n)
    except MpsimError as exc:
        return str(exc)


@lru_cache(maxsize=8)
def point_trace(model: str, seq_len: int | None = None) -> Trace:
    """The shipped model ``model``, retraced at ``seq_len`` tokens per sample where one is
    given (``mpsim.models.retrace.at_seq_len``, as ``--seq-len`` retraces it); once per
    process, as workers simulate many points of one model."""
    from mpsim.models.retrace import at_seq_len

    return at_seq_len(load_trace(model), seq_len)


def simulated_microbatches(stages: int) -> tuple[int, int]:
    """The two microbatch counts a long iteration is simulated at (``simulate_point``)."""
    return max(2 * stages, 4), max(3 * stages, 6)


def simulate_point(point: ClusterPoint) -> ClusterTried:
    """One configuration simulated (runs on a worker). An iteration of m microbatches,
    more than the two counts of ``simulated_microbatches`` (m1 < m2) together, is
    simulated at both and extended along the line through them: past 1F1B's warm-up
    every further microbatch adds the same forward and backward of the slowest stage, and
    a stage holds at most p microbatches, so the peak is m2's (``tests/test_scale.py``
    holds the line to full runs; on Llama-3-70B layouts it agrees to 1e-13)."""
    from mpsim.planners.registry import plan_job

    job = job_of_point(point)
    if job is None:
        raise MpsimError(f"{point} is not a layout of its servers")
    m = job.microbatches
    m1, m2 = simulated_microbatches(job.n_stages)
    extend = m > m1 + m2  # two short runs cost less than the long one
    r = plan_job(job if not extend else job.but(microbatches=m2)).result
    iteration_s = r.iteration_s
    if extend:
        short = plan_job(job.but(microbatches=m1)).result
        iteration_s += (m - m2) * (r.iteration_s - short.iteration_s) / (m2 - m1)
    samples_per_s = job.samples_per_iteration / iteration_s
    peak = max(g.peak_bytes for g in r.gpus)
    states = max(sum(g.breakdown.get(k, 0) for k in ("params", "grads", "optimizer")) for g in r.gpus)
    return ClusterTried(point, job.layout_name, r.fits, iteration_s, samples_per_s, peak, r.gpus[0].capacity_bytes,
                        states)


def server_counts(cluster: Cluster, least: int = 1) -> list[int]:
    top = cluster.spec.max_servers
    return [2**k for k in range(int(math.log2(top)) + 1) if least <= 2**k <= top]


def scale(model: str | Trace, clusters: Sequence[str], tokens: float, days: float | None = None,
          budget_usd: float | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS,
          microbatch_sizes: Sequence[int] = (1,), discount: float = 0.0, backend: Backend | None = None,
          on_point: Callable[[ClusterTried], None] | None = None, min_servers: int = 1,
          max_servers: int | None = None, seq_len: int | None = None) -> ScaleReport:
    """How many servers of each cluster train ``model`` on ``tokens`` (module doc), at
    ``seq_len`` tokens per sample when given (a shipped model's name, retraced)."""
    _check(tokens, days, budget_usd, batch_tokens, discount)
    _check_search(microbatch_sizes, min_servers, max_servers)
    trace = _model_trace(model, seq_len)
    seq = seq_len_of(trace)
    batch = max(1, batch_tokens // seq)
    report = ScaleReport(trace.name, tokens, batch * seq, seq, days, budget_usd, discount,
                         experts=experts_line(trace, 1, UNIFORM))
    for name in clusters:
        cluster = load_cluster(name)
        counts, kept, skipped = _points(name, cluster, trace, batch, microbatch_sizes, min_servers, max_servers,
                                        seq_len, model if isinstance(model, str) else None)
        failed: dict[str, int] = {}
        tried = _search(kept, backend, on_point, failed)
        answer = _answer(cluster, name, tried, report)
        answer.skipped, answer.failed, answer.counts = skipped, failed, tuple(counts)
        report.answers.append(answer)
    return report


def _model_trace(model: str | Trace, seq_len: int | None) -> Trace:
    """The trace searched: ``model`` itself, or the shipped one named, at ``seq_len``."""
    if isinstance(model, str):
        return point_trace(model, seq_len)
    if seq_len is not None and seq_len != model.seq_len:
        raise MpsimError("--seq-len: give the model by its shipped name to search it at another length")
    return model


def _points(name: str, cluster: Cluster, trace: Trace, batch: int, microbatch_sizes: Sequence[int],
            min_servers: int, max_servers: int | None, seq_len: int | None = None,
            source: str | None = None) -> tuple[list[int], list[ClusterPoint], dict[str, int]]:
    """The server counts searched on ``cluster``, the configurations simulated there, and
    how many were left out and why (``skip_reason``; shapes that are no layout of the
    servers are not counted)."""
    counts = [n for n in server_counts(cluster, min_servers) if max_servers is None or n <= max_servers]
    kept: list[ClusterPoint] = []
    skipped: dict[str, int] = {}
    every = shapes(cluster, trace, microbatch_sizes)
    for n in counts:  # ``source``: the shipped model the workers load (and retrace at ``seq_len``)
        for shape in every:
            point = ClusterPoint(name, source or trace.source or trace.name, n, shape, batch, seq_len=seq_len)
            why = skip_reason(point, cluster, trace)
            if why is None:
                kept.append(point)
            elif why != NOT_A_LAYOUT:
                skipped[why] = skipped.get(why, 0) + 1
    return counts, kept, skipped


def search_work(model: str | Trace, clusters: Sequence[str], batch_tokens: int = DEFAULT_BATCH_TOKENS,
                microbatch_sizes: Sequence[int] = (1,), min_servers: int = 1,
                max_servers: int | None = None, seq_len: int | None = None) -> tuple[int, int]:
    """The configurations ``scale`` would simulate with these bounds and its work at most
    (layers x microbatches simulated x every strategy of ``STRATEGIES``, summed: the
    measure a caller bounds a run by), counted before anything is simulated."""
    _check_search(microbatch_sizes, min_servers, max_servers)
    trace = _model_trace(model, seq_len)
    batch = max(1, batch_tokens // seq_len_of(trace))
    configurations = work = 0
    for name in clusters:
        cluster = load_cluster(name)
        for point in _points(name, cluster, trace, batch, microbatch_sizes, min_servers, max_servers)[1]:
            per_replica = point.shape.tensor * point.shape.pipeline
            samples = point.servers * cluster.gpus_per_server // per_replica // point.shape.context
            m = batch // (samples * point.shape.microbatch)
            m1, m2 = simulated_microbatches(point.shape.pipeline)
            configurations += 1
            work += trace.n_layers * (m if m <= m1 + m2 else m1 + m2) * len(STRATEGIES)
    return configurations, work


def _check_search(microbatch_sizes: Sequence[int], min_servers: int, max_servers: int | None) -> None:
    """The search's own bounds, refused in one line before anything is simulated."""
    if not microbatch_sizes:
        raise MpsimError("--microbatch needs at least one size")
    for mb in microbatch_sizes:
        try:
            check_microbatch(mb)
        except MpsimError as exc:
            raise MpsimError(f"--microbatch: {exc}") from None
    if min_servers < 1:
        raise MpsimError(f"--min-servers must be at least 1, got {min_servers}")
    if max_servers is not None and max_servers < min_servers:
        raise MpsimError(f"--min-servers {min_servers} is above --max-servers {max_servers}: no server count "
                         "to search")


def _check(tokens: float, days: float | None, budget: float | None, batch_tokens: int, discount: float) -> None:
    if not 0 < tokens < 1e16:
        raise MpsimError(f"--tokens must be a positive count below 1e16, got {tokens:g}")
    if days is not None and not 0 < days <= 3650:
        raise MpsimError(f"--days must be between 0 and 3650, got {days:g}")
    if budget is not None and not 0 < budget < 1e12:
        raise MpsimError(f"--budget must be a positive number of USD, got {budget:g}")
    if not 1 <= batch_tokens <= 2**30:
        raise MpsimError(f"--batch-tokens must be 1 to 2^30, got {batch_tokens}")
    if not 0 <= discount < 1:
        raise MpsimError(f"--discount is a fraction off the list price, 0 to below 1, got {discount:g}")


def _search(points: list[ClusterPoint], backend: Backend | None,
            on_point: Callable[[ClusterTried], None] | None,
            errors: dict[str, int] | None = None) -> list[ClusterTried]:
    """Every point with ``none``; what does not fit again with the next strategy, unless
    its model states alone overflow the GPU. ``errors`` counts the points whose simulation
    failed, by the error's last line."""
    done: list[ClusterTried] = []
    todo = points
    for strategy in STRATEGIES:
        todo = [replace(p, strategy=strategy) for p in todo]
        failed = []
        for outcome in run_points(todo, simulate_point, backend):
            if outcome.value is None:
                if errors is not None:
                    why = ((outcome.error or "").strip().splitlines() or ["no result"])[-1]
                    errors[why] = errors.get(why, 0) + 1
                continue
            tried: ClusterTried = outcome.value
            done.append(tried)
            if on_point:
                on_point(tried)
            if not tried.fits and tried.states_bytes < tried.capacity_bytes:
                failed.append(tried.point)
        todo = failed
    return done


def _answer(cluster: Cluster, name: str, tried: Sequence[ClusterTried], report: ScaleReport) -> ClusterAnswer:
    price = cluster.price
    hourly = price.on_demand.usd_per_hour * (1 - report.discount) if price and price.on_demand else None
    source = price.on_demand.source if price and price.on_demand else ""
    best: dict[int, ClusterTried] = {}
    for t in tried:
        if t.fits and (t.point.servers not in best or t.samples_per_s > best[t.point.servers].samples_per_s):
            best[t.point.servers] = t
    rows = []
    for n, t in sorted(best.items()):
        tokens_per_s = t.samples_per_s * report.seq_len
        days = report.tokens / tokens_per_s / 86400
        usd = None if hourly is None else hourly * n * days * HOURS_PER_DAY
        within = (report.days is None or days <= report.days) and (
            report.budget_usd is None or (usd is not None and usd <= report.budget_usd))
        rows.append(ScaleRow(name, n, n * cluster.gpus_per_server, t, tokens_per_s, days, usd, within))
    _mark_pareto(rows)
    pick = next((r for r in rows if r.within), None)
    return ClusterAnswer(cluster.name, cluster.describe(), hourly, source, rows, len(tried), pick)


def _mark_pareto(rows: list[ScaleRow]) -> None:
    """A row is on the front when no other is both faster and cheaper (or as fast and cheaper)."""
    priced = [(r.days, r.usd) for r in rows if r.usd is not None]
    for r in rows:
        r.pareto = r.usd is not None and not any(
            d <= r.days and u <= r.usd and (d, u) != (r.days, r.usd) for d, u in priced)


def days_text(days: float) -> str:
    """Days with one decimal, or three significant digits under a day."""
    return f"{days:.1f}" if days >= 1 else f"{days:.3g}"


def recommendation(report: ScaleReport) -> str:
    """One line: the cheapest pick over the clusters, or why there is none."""
    picks = [a.pick for a in report.answers if a.pick is not None]
    goal = " and ".join(x for x in (f"within {report.days:g} days" if report.days else "",
                                    f"within ${report.budget_usd:,.0f}" if report.budget_usd else "") if x)
    if not picks:
        fits = [r for a in report.answers for r in a.rows]
        if not fits:
            if not any(a.simulated for a in report.answers):
                return f"{report.model}: nothing was tried: " + "; ".join(a.searched() for a in report.answers)
            return f"{report.model} fits on none of the clusters searched"
        fastest = min(fits, key=lambda r: r.days)
        return (f"no cluster trains {report.model} on {report.tokens:.3g} tokens {goal}; the fastest is "
                f"{fastest.servers} x {fastest.cluster} ({fastest.tried.layout}) in {days_text(fastest.days)} days")
    best = min(picks, key=lambda r: (math.inf if r.usd is None else r.usd, r.days))
    cost = "" if best.usd is None else f" for ${best.usd:,.0f}"
    servers = f"{best.servers} server" + ("s" if best.servers != 1 else "")
    return (f"{servers} of {best.cluster} ({best.gpus} GPUs), {best.tried.layout} with "
            f"{best.tried.point.strategy}, microbatch {best.tried.point.shape.microbatch}: {report.tokens:.3g} tokens "
            f"in {days_text(best.days)} days{cost}" + (f" ({goal})" if goal else ""))
