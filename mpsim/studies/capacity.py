"""What fits: every shipped size of a model family, then the largest size that fits.

The family's size knob is its number of transformer layers (``Trace.with_layers``), at
the hidden size, heads and sequence length of a shipped configuration: the largest
shipped one that fits (or the smallest, when none does). The search assumes that adding
layers never lowers the highest per-GPU peak; it doubles until a size does not fit,
then bisects, so it costs O(log n) simulations.

Over several parallel layouts (``fits_layouts``, ``mpsim.plans.layouts``) each layout runs the
same study with the global batch held fixed (``--global-microbatches`` per iteration over
all replicas; each layout's jobs run their share per replica); per model the fastest
layout that fits answers, and the largest size is the largest any layout reaches (each
layout's search starts one layer above the largest an earlier layout reached, so a layout
that cannot beat it costs one probe).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

from mpsim.data.catalog import load_topology, load_trace, shipped_traces
from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.models.trace import Trace
from mpsim.planners.best import FALLBACK, KEEP_ALL, Part, combine, part_of, parts
from mpsim.planners.cache import adopt_plan
from mpsim.planners.context import Planned
from mpsim.planners.registry import made_plan, plan_fits, plan_job
from mpsim.plans.job import (
    DEFAULT_MICROBATCHES,
    DEFAULT_SCHEDULE,
    PIPELINE_ONLY,
    JobSpec,
    OfJob,
    Parallelism,
    partitions_of,
)
from mpsim.plans.layouts import candidate_layouts, on_layout
from mpsim.plans.partition import PARTITIONS
from mpsim.plans.strategies import combines
from mpsim.sim import SimResult
from mpsim.studies import bounds
from mpsim.studies.backends import Backend, run_points
from mpsim.timing.runtime import DEFAULT_PROFILE

MAX_SEARCH_LAYERS = 4096
"""Where the largest-size search stops (``limits.MAX_LAYERS`` bounds any trace)."""


ON_GPU_ONLY: frozenset[Part] = frozenset((name, partition) for name in FALLBACK for partition in PARTITIONS)
"""``fits`` runs ``best`` without its fallback planners (the offload strategies, which it
asks only when nothing else fits): past the largest size every other planner reaches,
its size search would simulate offload plans at every probe (the README's ``fits``: 64 s
against 18 s, the largest answer then 120.55B at 0.07 samples/s through NVMe). They are
columns of their own: ``--strategy ...,zero-offload,zero-infinity``."""


@dataclass
class FitRow:
    model: str
    params: int
    layers: int
    result: SimResult

    def to_dict(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> dict:
        r = self.result
        worst = max(r.gpus, key=lambda g: g.peak_bytes)
        return {
            "model": self.model,
            "params": self.params,
            "transformer_layers": self.layers,
            "fits": r.fits,
            "at_risk": r.at_risk(headroom_gib),
            "max_peak_bytes": worst.peak_bytes,
            "max_peak_gpu": worst.gpu,
            "capacity_bytes": worst.capacity_bytes,
            "iteration_s": r.iteration_s,
            "samples_per_s": r.samples_per_s,
            "model_tflops": r.model_tflops,
            "layout": r.layout,
            "runtime_profile": r.runtime_profile,
            "oom": r.oom,
        }


@dataclass
class FitsReport(OfJob):
    """What fits of one family under one job's strategy: every shipped size, and the
    largest size that fits (at the shape of ``largest_template``)."""

    job: JobSpec
    """The job at the smallest size (its server, schedule, microbatch, strategy, partition)."""
    family: str
    rows: list[FitRow]
    largest: FitRow | None
    largest_template: str
    not_above: int = 0
    """Searched above another layout's largest (``fits_job``'s ``beat``) and found not to
    fit at this many layers: ``largest`` is None though smaller sizes may fit."""
    searched: bool = True
    """False under ``fits --no-largest``: the shipped sizes only, ``largest`` None."""
    probes_simulated: int = 0
    """Sizes the largest-size search simulated."""
    probes_decided: int = 0
    """Sizes it found not to fit from the closed-form floors alone (``mpsim.studies.bounds``)."""

    @property
    def server(self) -> str:
        return self.job.topology.name

    @property
    def strategy(self) -> str:
        return self.job.strategy

    def to_dict(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> dict:
        largest = self.largest
        return {
            "server": self.server, "family": self.family, "schedule": self.schedule,
            "microbatch": self.microbatch, "microbatches": self.microbatches, "strategy": self.strategy,
            "partition": self.partition, "layout": self.job.layout_name,
            "rows": [r.to_dict(headroom_gib) for r in self.rows],
            "largest": None if largest is None else dict(largest.to_dict(headroom_gib), template=self.largest_template),
            "searched": self.searched, "probes_simulated": self.probes_simulated,
            "probes_decided_by_floors": self.probes_decided,
        }


def _prefixed(on_point: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda name: on_point(f"{prefix}: {name}")


def fits_strategies(server: str | Topology, family: str, schedule: str = DEFAULT_SCHEDULE,
                    microbatch: int | None = None, microbatches: int = DEFAULT_MICROBATCHES,
                    strategies: tuple[str, ...] = ("none", "recompute", "cpu-swap", "d2d", "mpress", "tsplit", "best"),
                    on_point: Callable[[str], None] | None = None, partition: str = "compute",
                    models: tuple[str, ...] = (), backend: Backend | None = None) -> list[FitsReport]:
    """``fits`` under each strategy: one report per strategy, in the order given.

    ``best`` runs last: it fits whatever a single planner fits (under the same partition),
    so its search starts from the largest size they reached. With a ``backend``
    (:mod:`mpsim.studies.backends`) the work runs in parallel (``_fits_on_backend``): every
    shipped size under every strategy, then the searches of the single strategies, and
    ``best``'s search, whose probes run their single planners in parallel; the
    simulations, and so the reports, are the same as in one process. ``on_point(name)`` is
    called per simulated size in one process, per shipped size and strategy or search with
    a backend."""
    traces = shipped_or_named(family, models)
    job = family_job(server, traces, schedule, microbatch, microbatches, "none", partition)
    return fits_all(job, family, traces, strategies, models, on_point, backend)


def fits_all(job: JobSpec, family: str, traces: list[Trace], strategies: Sequence[str], models: tuple[str, ...] = (),
             on_point: Callable[[str], None] | None = None, backend: Backend | None = None,
             hints: Mapping[str, dict[str, int]] | None = None, search: bool = True) -> list[FitsReport]:
    """``fits_strategies`` for a checked ``job`` (``family_job``; its strategy is set per
    report) over ``traces`` (those of ``family``, or of the named ``models``). ``hints``:
    per strategy, per template, a layer count to search above (``fits_layouts``: what
    another layout reached); a report that cannot beat it has no largest (``not_above``).
    With a backend, as ``_fits_on_backend`` runs it."""
    strategies, hints = tuple(strategies), hints or {}
    jobs = {s: job.but(strategy=s) for s in strategies}  # each strategy checked before anything runs
    if backend is not None:
        return _fits_on_backend([job], family, traces, strategies, tuple(models), backend, on_point, hints,
                                search)[0]
    done: dict[str, FitsReport] = {}
    for strategy in sorted(strategies, key=combines):
        best = combines(strategy)
        done[strategy] = fits_job(jobs[strategy], family, traces,
                                  on_point=None if on_point is None else _prefixed(on_point, strategy),
                                  known_fitting=_known(done.values(), job.partition) if best else None,
                                  known_failing=_known_failing(done.values()) if best else None,
                                  beat=hints.get(strategy), search=search)
    return [done[s] for s in strategies]


@dataclass
class LayoutFits:
    """``fits`` of one strategy over several layouts: one report per layout (in the order
    searched), per model the fastest layout that fits, and the largest size any reached."""

    strategy: str
    reports: list[FitsReport]
    microbatches: int
    """The global batch: microbatches per iteration over all replicas (each report's job runs
    its layout's share per replica); ``global_microbatches`` in ``to_dict``."""

    def best_row(self, i: int) -> FitRow:
        """The ``i``-th model in its fastest layout that fits, else where its peak is lowest."""
        def key(row: FitRow) -> tuple:
            r = row.result
            return (0, -r.samples_per_s, r.max_peak_bytes) if r.fits else (1, r.max_peak_bytes, -r.samples_per_s)

        return min((rep.rows[i] for rep in self.reports), key=key)

    @property
    def largest(self) -> tuple[FitsReport, FitRow] | None:
        """The layout whose largest size that fits has the most parameters (the faster on a tie)."""
        found = [(rep, rep.largest) for rep in self.reports if rep.largest is not None and rep.largest.result.fits]
        if not found:
            return None
        return max(found, key=lambda x: (x[1].params, x[1].result.samples_per_s))

    def to_dict(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> dict:
        top = self.largest
        first = self.reports[0]
        return {"server": first.server, "family": first.family, "schedule": first.schedule,
                "microbatch": first.microbatch, "global_microbatches": self.microbatches,
                "strategy": self.strategy, "partition": first.partition,
                "rows": [self.best_row(i).to_dict(headroom_gib) for i in range(len(self.reports[0].rows))],
                "largest": (None if top is None
                            else dict(top[1].to_dict(headroom_gib), template=top[0].largest_template)),
                "layouts": [r.to_dict(headroom_gib) for r in self.reports]}


def fits_layouts(job: JobSpec, family: str, traces: list[Trace], strategies: Sequence[str], layouts: str,
                 global_microbatches: int, models: tuple[str, ...] = (),
                 on_point: Callable[[str], None] | None = None,
                 backend: Backend | None = None, search: bool = True) -> list[LayoutFits]:
    """``fits_all`` in each of ``layouts`` (``mpsim.plans.layouts.candidate_layouts`` on the job's
    server), ``global_microbatches`` per iteration over all replicas; one ``LayoutFits`` per
    strategy, in the order given. Every layout's job is checked before anything runs
    (``on_layout``; each strategy by ``fits_all`` before its first layout runs).
    ``search=False``: the shipped sizes only (``fits --no-largest``)."""
    jobs = [on_layout(job, p, global_microbatches)
            for p in candidate_layouts(job.topology, layouts, job.schedule, job.trace)]
    for j in jobs:  # each strategy checked before anything runs
        for st in strategies:
            j.but(strategy=st)
    if backend is not None:
        per_layout = _fits_on_backend(jobs, family, traces, strategies, models, backend, on_point, {}, search)
        return [LayoutFits(s, [reps[k] for reps in per_layout], global_microbatches) for k, s in enumerate(strategies)]
    reached: dict[str, dict[str, int]] = {}
    per_layout = []
    for j in jobs:
        tell = None if on_point is None or len(jobs) == 1 else _prefixed(on_point, j.layout_name)
        reps = fits_all(j, family, traces, strategies, models, tell or on_point, None, reached, search)
        for rep in reps:
            _note_reached(reached.setdefault(rep.strategy, {}), rep)
        per_layout.append(reps)
    return [LayoutFits(s, [reps[k] for reps in per_layout], global_microbatches) for k, s in enumerate(strategies)]


def _note_reached(reached: dict[str, int], rep: FitsReport) -> None:
    """Per template, the most layers a layout reached under the report's strategy, with its."""
    if rep.largest is not None and rep.largest.result.fits:
        reached[rep.largest_template] = max(reached.get(rep.largest_template, 0), rep.largest.layers)


def _known(reports: Iterable[FitsReport], partition: str) -> dict[str, int]:
    """Per template, the most transformer layers a report under ``partition`` found to fit."""
    known: dict[str, int] = {}
    for rep in reports:
        if rep.largest is not None and rep.partition == partition:
            t = rep.largest_template
            known[t] = max(known.get(t, 0), rep.largest.layers)
    return known


Failing = dict[tuple[str, str, str], int]
"""(template trace, strategy, partition) -> the fewest transformer layers known not to fit."""


def _known_failing(reports: Iterable[FitsReport]) -> Failing:
    """What the single strategies' reports show not to fit: every shipped size that did
    not, and one layer more than the largest found (its search probed it and it did not
    fit). ``best``'s search leaves those planners out of its probes above them."""
    failing: Failing = {}

    def note(template: str, strategy: str, partition: str, layers: int) -> None:
        key = (template, strategy, partition)
        failing[key] = min(failing.get(key, layers), layers)

    for rep in reports:
        if combines(rep.strategy):
            continue
        for row in rep.rows:
            if not row.result.fits:
                note(row.model, rep.strategy, rep.partition, row.layers)
        if rep.largest is not None:
            note(rep.largest_template, rep.strategy, rep.partition, rep.largest.layers + 1)
        if rep.not_above:
            note(rep.largest_template, rep.strategy, rep.partition, rep.not_above)
    return failing


@dataclass(frozen=True)
class _FitsUnit:
    """One strategy's search for the largest size of one layout's job, in a worker."""

    job: JobSpec
    family: str
    models: tuple[str, ...]
    rows: tuple[FitRow, ...]
    """Its shipped sizes, simulated (``shipped_rows``)."""
    known: tuple[tuple[str, int], ...] = ()
    """Per template, a layer count to search above (what earlier layouts reached)."""

    def traces(self) -> list[Trace]:
        return shipped_or_named(self.family, self.models)


@dataclass(frozen=True)
class _SizeUnit:
    """One shipped size of one layout's job under every strategy asked, in one worker."""

    job: JobSpec
    family: str
    models: tuple[str, ...]
    size: int
    strategies: tuple[str, ...]


def _size_rows(unit: _SizeUnit) -> tuple[FitRow, ...]:
    """In a worker: one shipped size under each strategy, in ``unit.strategies``' order.
    The combining one (``best``) runs last, so that its parts are the plans this process
    has just made for the single strategies (``mpsim.planners.cache``), not made again."""
    traces = shipped_or_named(unit.family, unit.models)
    t = traces[unit.size]
    job = unit.job.but(trace=t.rescale(unit.job.microbatch))
    results = {st: plan_job(job.but(strategy=st), ON_GPU_ONLY if combines(st) else ()).result
               for st in sorted(unit.strategies, key=combines)}
    for r in results.values():
        r.at_risk()  # the caching-allocator replay here, in parallel: the estimate travels with the result
    return tuple(FitRow(t.name, t.spec.params, _n_transformer(t), results[st]) for st in unit.strategies)


def shipped_rows(jobs: Sequence[JobSpec], family: str, models: tuple[str, ...], traces: list[Trace],
                 strategies: Sequence[str], backend: Backend, on_point: Callable[[str], None] | None = None,
                 named: bool | None = None) -> list[dict[str, tuple[FitRow, ...]]]:
    """Every shipped size of every layout's job (``jobs``) under every strategy, in one
    round on ``backend``: per job, per strategy, its rows (smallest size first; ``traces``,
    ``shipped_or_named(family, models)``, which each worker loads again). A unit is
    one size of one layout under all the strategies (``_size_rows``), the largest sizes
    submitted first (they take longest, so the round ends evenly). ``on_point`` hears of
    each size under each strategy, with the layout's name where ``named`` (default: when
    there are several jobs)."""
    names = tuple(dict.fromkeys(strategies))
    n_sizes = len(traces)
    named = len(jobs) > 1 if named is None else named
    if all(combines(st) for st in names):  # no single planner's plans to reuse: best's parts in parallel
        return _combined_rows(jobs, traces, names, backend, on_point, named)
    placed = [((k, i), _SizeUnit(j, family, models, i, names)) for i in reversed(range(n_sizes))
              for k, j in enumerate(jobs)]
    units = [u for _, u in placed]
    where = {id(u): at for at, u in placed}
    got: dict[tuple[int, int], tuple[FitRow, ...]] = {}
    for outcome in run_points(units, _size_rows, backend, batch=1):
        if outcome.error is not None or outcome.value is None:
            raise MpsimError(f"fits of {outcome.point.job.layout_name}: {outcome.error}")
        got[where[id(outcome.point)]] = outcome.value
        if on_point is not None:  # a point per size and strategy, as the progress counts them
            for st in names:
                on_point(f"{_layout_prefix(outcome.point.job, named)}{st}: size {outcome.point.size + 1}")
    return [{st: tuple(got[(k, i)][m] for i in range(n_sizes)) for m, st in enumerate(names)}
            for k in range(len(jobs))]


def _combined_rows(jobs: Sequence[JobSpec], traces: list[Trace], names: tuple[str, ...], backend: Backend,
                   on_point: Callable[[str], None] | None, named: bool) -> list[dict[str, tuple[FitRow, ...]]]:
    """``shipped_rows`` when every strategy asked combines the others (``best``): each
    size's parts run in parallel (``_best_in_parallel``), one size after another."""
    out: list[dict[str, tuple[FitRow, ...]]] = []
    for j in jobs:
        rows: dict[str, tuple[FitRow, ...]] = {}
        for st in names:
            got = []
            for i, t in enumerate(traces):
                result = _best_in_parallel(j.but(strategy=st, trace=t.rescale(j.microbatch)), ON_GPU_ONLY, backend)
                got.append(FitRow(t.name, t.spec.params, _n_transformer(t), result))
                if on_point is not None:
                    on_point(f"{_layout_prefix(j, named)}{st}: size {i + 1}")
            rows[st] = tuple(got)
        out.append(rows)
    return out


@dataclass(frozen=True)
class _Searched:
    """A single strategy's search made in a worker, and the plan of its largest size by
    its cache key (None where that size is a shipped one, planned elsewhere)."""

    report: FitsReport
    largest_plan: tuple[tuple[object, ...], Planned] | None


def _fits_unit(unit: _FitsUnit) -> _Searched:
    """In a worker: one strategy's search."""
    traces = unit.traces()
    report = fits_job(unit.job, unit.family, traces, rows=list(unit.rows), beat=dict(unit.known))
    if report.largest is None:
        return _Searched(report, None)
    report.largest.result.at_risk()  # replayed here, in parallel (as ``_size_rows`` does)
    template = next(t for t in traces if t.name == report.largest_template)
    largest = template.with_layers(report.largest.layers).rescale(unit.job.microbatch)
    return _Searched(report, made_plan(unit.job.but(trace=largest)))


def _fits_on_backend(jobs: Sequence[JobSpec], family: str, traces: list[Trace], strategies: Sequence[str],
                     models: tuple[str, ...], backend: Backend, on_point: Callable[[str], None] | None,
                     hints: Mapping[str, dict[str, int]], search: bool = True) -> list[list[FitsReport]]:
    """``fits`` of each job (one per layout) under each strategy on ``backend``: per job,
    the reports in ``strategies``' order. The first layout's shipped sizes run first
    (``shipped_rows``), then its single strategies' searches start while the other
    layouts' shipped sizes run; each strategy then searches the later layouts in turn,
    above what the earlier ones reached (``hints`` first; ``_SingleSearches``), while this
    thread runs ``best``'s search of each layout whose single searches are done, its parts
    on the backend too. The reports are those of running the layouts one after the other:
    each search sees the same hints."""
    tell = _serialised(on_point)
    names = list(dict.fromkeys(strategies))
    if not search:
        shipped = shipped_rows(jobs, family, models, traces, names, backend, tell)
        return [[_unsearched(j.but(strategy=st), family, list(shipped[k][st]), traces) for st in strategies]
                for k, j in enumerate(jobs)]
    reached = {st: dict(hints.get(st, {})) for st in names}
    singles = _SingleSearches(jobs, family, models, [st for st in names if not combines(st)], reached, backend, tell)
    out: list[list[FitsReport]] = []
    try:
        shipped = _shipped_then_searches(jobs, family, models, traces, names, backend, tell, singles)
        for k, job in enumerate(jobs):
            done = singles.reports(k)
            for st in (st for st in names if combines(st)):
                done[st] = fits_job(job.but(strategy=st), family, traces,
                                    known_fitting=_known(done.values(), job.partition), beat=reached[st],
                                    known_failing=_known_failing(done.values()), rows=list(shipped[k][st]),
                                    backend=backend)
                _note_reached(reached[st], done[st])
                if tell:
                    tell(f"{_layout_prefix(job, len(jobs) > 1)}{st}: search")
            out.append([done[s] for s in strategies])
    except BaseException as exc:
        singles.stop(exc)
        raise
    return out


def _shipped_then_searches(jobs: Sequence[JobSpec], family: str, models: tuple[str, ...], traces: list[Trace],
                           names: list[str], backend: Backend, tell: Callable[[str], None] | None,
                           singles: _SingleSearches) -> list[dict[str, tuple[FitRow, ...]]]:
    """Every layout's shipped rows, the single searches started as early as they can: on a
    backend that takes calls from several threads, after the first layout's rows (its
    searches, MPress's near its limit the longest, then run beside the other layouts'
    shipped sizes); else after all of them."""
    if not backend.threads:
        shipped = shipped_rows(jobs, family, models, traces, names, backend, tell)
        for k, rows in enumerate(shipped):
            singles.add_shipped(k, rows)
        singles.start()
        return shipped
    named = len(jobs) > 1
    shipped = shipped_rows(jobs[:1], family, models, traces, names, backend, tell, named)
    singles.add_shipped(0, shipped[0])
    singles.start()
    shipped += shipped_rows(jobs[1:], family, models, traces, names, backend, tell, named) if named else []
    for k in range(1, len(jobs)):
        singles.add_shipped(k, shipped[k])
    return shipped


def _layout_prefix(job: JobSpec, named: bool) -> str:
    """What a progress point of ``job`` starts with: its layout's name when several are studied."""
    return f"{job.layout_name}: " if named else ""


def _serialised(on_point: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """``on_point`` called by one thread at a time (the searches' thread and this one)."""
    if on_point is None:
        return None
    lock = threading.Lock()

    def tell(name: str) -> None:
        with lock:
            on_point(name)

    return tell


class _SingleSearches:
    """The single strategies' searches of each layout in turn, on ``backend``, each above
    what that strategy reached in the layouts before (``reached``), each layout's as soon
    as its shipped rows are in (``add_shipped``). A strategy's search of layout k needs
    only its own searches of the layouts before, so on a backend that takes calls from
    several threads (``Backend.threads``) the first layout's searches run as one round,
    the dearest first (``_dearest_first``), and as each ends its strategy goes on through
    the later layouts on a thread of its own: a cheap strategy's later layouts fill the
    workers while a dear one (MPress near its limit) still searches, and ``best``'s search
    of a layout starts as soon as that layout's singles are done. Else all of them run in
    ``start``, a round per layout. Either way each search sees the hints of running the
    layouts one after the other."""

    def __init__(self, jobs: Sequence[JobSpec], family: str, models: tuple[str, ...], strategies: list[str],
                 reached: dict[str, dict[str, int]], backend: Backend, tell: Callable[[str], None] | None):
        self.jobs, self.family, self.models, self.strategies = jobs, family, models, strategies
        self.reached, self.backend, self.tell = reached, backend, tell
        self.shipped: list[Future[dict[str, tuple[FitRow, ...]]]] = [Future() for _ in jobs]
        self.done: list[Future[dict[str, _Searched]]] = [Future() for _ in jobs]
        self._got: list[dict[str, _Searched]] = [{} for _ in jobs]
        self._lock = threading.Lock()

    def add_shipped(self, k: int, rows: dict[str, tuple[FitRow, ...]]) -> None:
        """Layout ``k``'s shipped rows, per strategy: its searches may start."""
        self.shipped[k].set_result(rows)

    def start(self) -> None:
        if not self.strategies:  # best alone: nothing to wait for
            for done in self.done:
                done.set_result({})
        elif self.backend.threads:
            threading.Thread(target=self._first_then_chains, name="fits-searches", daemon=True).start()
        else:
            self._chain(tuple(self.strategies), 0)

    def reports(self, k: int) -> dict[str, FitsReport]:
        """The single strategies' reports of layout ``k`` (waits for their searches); the
        plans of their largest sizes join this process's plan cache, where ``best``'s
        search of the layout finds them (``_parts_planned``) instead of planning them again."""
        searched = self.done[k].result()
        for s in searched.values():
            if s.largest_plan is not None:
                adopt_plan(*s.largest_plan)
        return {st: s.report for st, s in searched.items()}

    def stop(self, exc: BaseException) -> None:
        """Stop the backend's work now (``Backend.abort``): the searches still to run fail,
        and those waiting for shipped rows that will not come hear ``exc``."""
        self.backend.abort()
        with self._lock:
            for rows in self.shipped:
                if not rows.done():
                    rows.set_exception(exc)

    def _first_then_chains(self) -> None:
        """The first layout's searches in one round, dearest first; each strategy's later
        layouts on a thread of its own as its first search ends."""
        strategies = _dearest_first(self.strategies, self.shipped[0].result() if self.jobs else {})
        try:
            for st, searched in self._searches(0, self.jobs[0], strategies):
                self._record(0, {st: searched})
                threading.Thread(target=self._chain, args=((st,), 1), name=f"fits-{st}", daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for it
            self._fail(0, exc)

    def _chain(self, strategies: tuple[str, ...], first: int) -> None:
        """The searches of ``strategies`` in layouts ``first`` on, a round per layout."""
        for k in range(first, len(self.jobs)):
            try:
                got = dict(self._searches(k, self.jobs[k], strategies))
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for it
                self._fail(k, exc)
                return
            if not self._record(k, got):
                return

    def _record(self, k: int, got: dict[str, _Searched]) -> bool:
        """Add searches of layout ``k``; whether the study goes on (no other search failed)."""
        with self._lock:
            if self.done[k].done():  # another search of this layout failed
                return False
            self._got[k].update(got)
            if len(self._got[k]) == len(self.strategies):
                self.done[k].set_result({st: self._got[k][st] for st in self.strategies})
            return True

    def _fail(self, k: int, exc: BaseException) -> None:
        with self._lock:
            for later in self.done[k:]:
                if not later.done():
                    later.set_exception(exc)

    def _searches(self, k: int, job: JobSpec, strategies: Sequence[str]) -> Iterator[tuple[str, _Searched]]:
        """Each strategy's search of layout ``k``, as it ends, its reach noted."""
        rows = self.shipped[k].result()
        units = [_FitsUnit(job.but(strategy=st), self.family, self.models, rows[st],
                           tuple(sorted(self.reached[st].items()))) for st in strategies]
        for outcome in run_points(units, _fits_unit, self.backend, batch=1):
            st = outcome.point.job.strategy
            if outcome.error is not None or outcome.value is None:
                raise MpsimError(f"fits under {st}: {outcome.error}")
            _note_reached(self.reached[st], outcome.value.report)
            if self.tell:
                self.tell(f"{_layout_prefix(job, len(self.jobs) > 1)}{st}: search")
            yield st, outcome.value


def _dearest_first(strategies: Sequence[str], rows: Mapping[str, tuple[FitRow, ...]]) -> list[str]:
    """The strategies in the order their searches are likely to take longest: those whose
    shipped sizes fit the most first (their searches start largest and probe the largest
    plans), the given order among equals. Only the order of work changes, not its answers."""
    return sorted(strategies, key=lambda st: -sum(r.result.fits for r in rows.get(st, ())))


def _plan_best_part(job: JobSpec) -> Planned:
    """In a worker: one part of the combined plan (a single planner under one partition),
    through the one entry point; the context ``plan_part`` builds for ``best``."""
    return plan_job(job)


def _best_in_parallel(job: JobSpec, skip: frozenset[Part], backend: Backend) -> SimResult:
    """``best``'s result for one job with its single planners run in parallel on
    ``backend``, then combined as ``plan_best`` combines them (``combine``): the same
    answer. First the plans that keep everything, one per partition; then, at once, the
    other parts of each partition where keeping everything does not fit (``combine`` does
    not ask them where it does)."""
    partitions = partitions_of(job.parallelism)
    todo = parts(skip, partitions)
    keep = [p for p in todo if p[0] == KEEP_ALL]
    plans = _parts_planned(job, keep, backend)
    kept_all = {partition for (name, partition), planned in plans.items() if planned.result.fits}
    plans.update(_parts_planned(job, [p for p in todo if p not in plans and p[1] not in kept_all], backend))
    return combine(lambda name, partition: plans[(name, partition)], skip, partitions).result


def _parts_planned(job: JobSpec, todo: list[Part], backend: Backend) -> dict[Part, Planned]:
    """Each part of ``best`` in ``todo`` planned for ``job``: those this process knows
    already (a single strategy's search made it: ``_SingleSearches.reports``), the rest at
    once on ``backend``."""
    jobs = {p: job.but(strategy=p[0], partition=p[1]) for p in todo}
    known = {p: made[1] for p, j in jobs.items() if (made := made_plan(j)) is not None}
    return known | _by_part([j for p, j in jobs.items() if p not in known], _plan_best_part, backend)


R = TypeVar("R")


def _by_part(units: list[JobSpec], fn: Callable[[JobSpec], R], backend: Backend) -> dict[Part, R]:
    """``fn`` of each of ``best``'s parts (a job under one planner and partition), at once
    on ``backend``, by part; the first that fails stops the study in one line."""
    got: dict[Part, R] = {}
    for outcome in run_points(units, fn, backend, batch=1):
        if outcome.error is not None or outcome.value is None:
            raise MpsimError(f"fits under best ({outcome.point.strategy}, {outcome.point.partition}): "
                             f"{outcome.error}")
        got[(outcome.point.strategy, outcome.point.partition)] = outcome.value
    return got


def family_traces(family: str) -> list[Trace]:
    """The shipped size series of ``family``: traces named ``<family>-<size>`` (gpt-5.3b ...,
    not gpt2-xl), smallest first."""
    traces = [load_trace(name) for name in shipped_traces() if name.startswith(f"{family}-")]
    chosen = sorted((t for t in traces if t.spec.model.get("family") == family), key=lambda t: t.spec.params)
    if not chosen:
        series = {name.split("-")[0] for name in shipped_traces() if "-" in name}
        families = sorted({t.spec.model.get("family", "?") for t in map(load_trace, shipped_traces())} & series)
        raise MpsimError(f"unknown model family {family!r}: expected one of {', '.join(families)}")
    return chosen


def shipped_or_named(family: str, models: tuple[str, ...]) -> list[Trace]:
    """The traces ``fits`` runs: the named ``models``, else the shipped ``family``."""
    return model_traces(models) if models else family_traces(family)


def model_traces(models: tuple[str, ...]) -> list[Trace]:
    """Named models (shipped names or trace files), smallest first; each needs transformer
    layers, the size knob of the largest-that-fits search."""
    traces = sorted((load_trace(m) for m in models), key=lambda t: t.spec.params)
    for t in traces:
        if not _n_transformer(t):
            raise MpsimError(f"{t.name}: no transformer layers, so no size to search; use `mpsim simulate`")
    return traces


def _n_transformer(trace: Trace) -> int:
    return sum(1 for r in trace.layers if r.kind == "transformer")


def family_job(server: str | Topology, traces: list[Trace], schedule: str, microbatch: int | None,
               microbatches: int, strategy: str, partition: str, layout: Parallelism = PIPELINE_ONLY,
               runtime_profile: str = DEFAULT_PROFILE) -> JobSpec:
    """The job ``fits`` runs at every size: the smallest trace at the microbatch asked
    (None: its traced one) in ``layout`` under ``runtime_profile``, checked once before any
    size is simulated."""
    topo = load_topology(server) if isinstance(server, str) else server
    mb = traces[0].microbatch if microbatch is None else microbatch
    return JobSpec(topo, traces[0].rescale(mb), schedule, microbatches, layout, partition=partition,
                   strategy=strategy, runtime_profile=runtime_profile)


def fits(server: str | Topology, family: str, schedule: str = DEFAULT_SCHEDULE, microbatch: int | None = None,
         microbatches: int = DEFAULT_MICROBATCHES, strategy: str = "none", partition: str = "compute",
         on_point: Callable[[str], None] | None = None, known_fitting: dict[str, int] | None = None,
         models: tuple[str, ...] = (), rows: list[FitRow] | None = None,
         known_failing: Failing | None = None, backend: Backend | None = None) -> FitsReport:
    """Simulate every shipped size of ``family`` (or the named ``models`` instead) and
    search the largest that fits.

    ``known_fitting``: per template trace name, a number of transformer layers already
    known to fit under this strategy; the search starts there and probes one layer more
    first (``best`` most often reaches exactly the largest of the single planners, so
    its search is then that probe and the plan of the largest), then doubles. ``rows``:
    the shipped sizes already simulated under this strategy (one per trace, smallest
    first).
    ``known_failing`` (``best`` only): what single planners are known not to fit
    (``_known_failing``); the search's probes leave them out where they cannot fit. Only
    whether a probe fits, and the plan of the largest that does, are reported, and
    neither changes: a planner left out does not fit there. ``backend`` (``best`` only):
    each probe runs its single planners in parallel there (``_best_in_parallel``)."""
    traces = shipped_or_named(family, models)
    job = family_job(server, traces, schedule, microbatch, microbatches, strategy, partition)
    return fits_job(job, family, traces, on_point, known_fitting, rows, known_failing, backend)


def fits_job(job: JobSpec, family: str, traces: list[Trace], on_point: Callable[[str], None] | None = None,
             known_fitting: dict[str, int] | None = None, rows: list[FitRow] | None = None,
             known_failing: Failing | None = None, backend: Backend | None = None,
             beat: Mapping[str, int] | None = None, search: bool = True) -> FitsReport:
    """``fits`` for a checked ``job`` (``family_job``) over ``traces``, smallest first.
    ``beat``: per template, layers another layout fits; the search only looks above
    them (one probe first: when one layer more does not fit, the report has no largest
    and says so in ``not_above``)."""
    probes = _Search(job, family, on_point, known_failing or {}, backend)
    if not rows:
        rows = [FitRow(t.name, t.spec.params, _n_transformer(t), probes.run(t)) for t in traces]
    if not search:
        return _unsearched(job, family, rows, traces)
    fitting = [(t, row) for t, row in zip(traces, rows) if row.result.fits]
    if fitting:
        probes.start(fitting[-1][0], fitting[-1][1])
        hint = (known_fitting or {}).get(probes.template.name, 0)
        floor = (beat or {}).get(probes.template.name, 0)
        if floor >= max(hint, probes.n0):
            if not probes.fits_at(floor + 1):
                return replace(probes.report(rows, None), not_above=floor + 1)
            hint = floor + 1
        lo, hi = probes.grow(hint)
    else:
        probes.start(traces[0], None)
        bounds = probes.shrink()
        if bounds is None:
            return probes.report(rows, None)
        lo, hi = bounds
    return probes.report(rows, probes.probe(probes.bisect(lo, hi)))


def _unsearched(job: JobSpec, family: str, rows: list[FitRow], traces: list[Trace]) -> FitsReport:
    """The shipped sizes' report without the largest-size search (``fits --no-largest``)."""
    return FitsReport(job, family, rows, None, traces[-1].name, searched=False)


class _Search:
    """The largest-size search of ``fits``: probes of one template trace at more or fewer
    transformer layers, each a simulated plan, remembered by layer count. It assumes that
    adding layers never lowers the highest per-GPU peak: it doubles (or halves) until the
    answer changes, then bisects, so it costs O(log n) simulations."""

    def __init__(self, job: JobSpec, family: str, on_point: Callable[[str], None] | None,
                 known_failing: Failing, backend: Backend | None):
        self.job, self.family, self.on_point = job, family, on_point
        self.known_failing, self.backend = dict(known_failing), backend
        self.template = job.trace
        self.cache: dict[int, FitRow] = {}
        self.decided: set[int] = set()
        """Sizes the floors showed not to fit (never simulated)."""
        self.verdicts: dict[int, bool] = {}
        """``best``'s sizes answered by existence alone (``_any_part_fits``)."""
        self.last_fit: Part | None = None
        self.simulated = 0
        self.ahead: dict[int, Future[FitRow]] = {}
        """Sizes whose row is being made on a thread of its own (``plan_ahead``)."""

    def run(self, trace: Trace, skip: frozenset[tuple[str, str]] = frozenset()) -> SimResult:
        """One size simulated under the job's strategy (``best``'s parts in parallel on a backend)."""
        job = self.job.but(trace=trace.rescale(self.job.microbatch))
        if combines(job.strategy):
            skip = skip | ON_GPU_ONLY
        if self.backend is not None and combines(job.strategy):
            result = _best_in_parallel(job, skip, self.backend)
        else:
            result = plan_job(job, known_not_fitting=skip).result
        if self.on_point:
            self.on_point(trace.name)
        return result

    def start(self, template: Trace, fitting: FitRow | None) -> None:
        """Search at the shape of ``template`` (the largest shipped size that fits, or the smallest)."""
        self.template = template
        self.n0 = _n_transformer(template)
        if fitting is not None:
            self.cache[self.n0] = fitting
            self.last_fit = part_of(fitting.result.strategy)  # best's first guess: what made that size fit

    def probe(self, n: int) -> FitRow:
        if n not in self.cache:
            self.simulated += n not in self.verdicts  # a size answered by existence counts once
            ahead = self.ahead.pop(n, None)
            self.cache[n] = ahead.result() if ahead is not None else self._row(n, self._skip(n))
        return self.cache[n]

    def _row(self, n: int, skip: frozenset[tuple[str, str]]) -> FitRow:
        t = self.template.with_layers(n)
        return FitRow(t.name, t.spec.params, n, self.run(t, skip))

    def plan_ahead(self, n: int) -> None:
        """Under ``best`` on a backend that takes calls from several threads: make the row
        of ``n`` layers (its full plan) on a thread of its own, while the search asks
        whether ``n`` + 1 fits. ``n`` is the largest size a single planner reached, where
        ``best``'s search most often ends, so the plan its report needs is made beside
        that probe instead of after it; ``probe(n)`` takes it. The parts it leaves out are
        those known not to fit at ``n`` now: the probe of ``n`` + 1 adds only larger sizes."""
        if self.backend is None or not self.backend.threads or not combines(self.job.strategy) or n in self.cache:
            return
        future: Future[FitRow] = Future()
        skip = self._skip(n)

        def make() -> None:
            try:
                future.set_result(self._row(n, skip))
            except BaseException as exc:  # noqa: BLE001 - handed to probe(n), which raises it
                future.set_exception(exc)

        self.ahead[n] = future
        threading.Thread(target=make, name=f"fits-best-{n}", daemon=True).start()

    def fits_at(self, n: int) -> bool:
        """Whether ``n`` layers of the template fit: no when the closed-form floors say
        so (``mpsim.studies.bounds``); under ``best``, yes at the first of its parts that fits
        (existence first: only the final size needs the fastest plan); else as the
        simulated plan says. ``bounds.without_floors`` simulates every probe whole."""
        if n in self.decided:
            return False
        if n in self.cache or not bounds.in_use():
            return self.probe(n).result.fits
        if n not in self.verdicts:
            job = self.job.but(trace=self.template.with_layers(n).rescale(self.job.microbatch))
            if bounds.floors(job).cannot_fit():
                self.decided.add(n)
                return False
            self.verdicts[n] = self._any_part_fits(job, n) if combines(job.strategy) else self._fits(job)
        return self.verdicts[n]

    def _fits(self, job: JobSpec) -> bool:
        """A single strategy's verdict by existence (``plan_fits``), counted as a probe."""
        self.simulated += 1
        return plan_fits(job)

    def _any_part_fits(self, job: JobSpec, n: int) -> bool:
        """Whether one of ``best``'s parts fits ``job`` (``n`` layers), stopping at the first
        that does: the one that fitted the last size that fitted first, then ``best``'s
        order (whether any fits does not depend on the order). A part whose own floors
        decide it (``bounds.floors`` under its strategy) is not planned. On a backend, the
        parts after the first are planned in parallel (``_verdicts``). A part that does not
        fit, and comes before the first that does, is remembered as not fitting at ``n``
        and above (the search's own assumption, per planner), so larger probes and the
        final plan leave it out."""
        self.simulated += 1
        todo = parts(self._skip(n), partitions_of(job.parallelism))
        if self.last_fit in todo:  # the part that fitted the last size that fitted, first: most often the answer
            todo.insert(0, todo.pop(todo.index(self.last_fit)))
        jobs = {p: job.but(strategy=p[0], partition=p[1]) for p in todo}
        open_ = {p for p, j in jobs.items() if not bounds.floors(j).cannot_fit()}
        verdicts = self._verdicts(jobs, open_, todo)
        for p in todo:
            if verdicts.get(p, False):
                self.last_fit = p
                return True
            key = (self.template.name, *p)
            self.known_failing[key] = min(self.known_failing.get(key, n), n)
        return False

    def _verdicts(self, jobs: dict[Part, JobSpec], open_: set[Part], order: list[Part]) -> dict[Part, bool]:
        """``plan_fits`` of the parts in ``open_`` (the others: the floors said no), in
        ``order``, up to the first that fits: here one at a time, or on the backend the
        first here (most often the answer: ``last_fit``), then, when it does not fit, all
        the rest at once there (where the first does not fit, most often none does)."""
        verdicts: dict[Part, bool] = {}
        todo = [p for p in order if p in open_]
        if self.backend is None or self.backend.slots() < 2:
            waves = [[p] for p in todo]
        else:
            waves = [todo[:1], todo[1:]]
        for wave in waves:
            if len(wave) == 1:
                verdicts[wave[0]] = plan_fits(jobs[wave[0]])
            elif wave:
                assert self.backend is not None
                verdicts.update(_by_part([jobs[p] for p in wave], plan_fits, self.backend))
            if any(verdicts[p] for p in wave):
                break
        return verdicts

    def _skip(self, n: int) -> frozenset[tuple[str, str]]:
        """``best``'s parts known not to fit at ``n`` layers of the template."""
        if not combines(self.job.strategy):
            return frozenset()
        return ON_GPU_ONLY | frozenset((name, part) for (at, name, part), m in self.known_failing.items()
                                       if at == self.template.name and m <= n)

    def grow(self, hint: int) -> tuple[int, int]:
        """From a size that fits, double the step until one does not: (fits, does not)."""
        lo, step = self.n0, max(1, self.n0)
        if hint > lo:  # best: usually the largest a single planner reached; one layer more first
            lo, step = hint, 1
            self.plan_ahead(hint)
        while True:
            cand = lo + step
            if cand > MAX_SEARCH_LAYERS:
                raise MpsimError(f"{self.family} still fits with {lo} layers; stopped searching at {MAX_SEARCH_LAYERS}")
            if not self.fits_at(cand):
                return lo, cand
            lo, step = cand, step * 2

    def shrink(self) -> tuple[int, int] | None:
        """From a size that does not fit, halve until one does; None when not even the
        fewest layers fit (every stage needs a layer)."""
        min_layers = max(1, self.job.topology.n_gpus - (self.template.n_layers - self.n0))
        hi, n = self.n0, self.n0
        while True:
            n = max(min_layers, n // 2)
            if self.fits_at(n):
                return n, hi
            if n == min_layers:
                return None
            hi = n

    def bisect(self, lo: int, hi: int) -> int:
        """The most layers that fit, between ``lo`` (fits) and ``hi`` (does not)."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits_at(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def report(self, rows: list[FitRow], largest: FitRow | None) -> FitsReport:
        return FitsReport(self.job, self.family, rows, largest, self.template.name,
                          probes_simulated=self.simulated, probes_decided=len(self.decided))
