"""What fits: every shipped size of a model family, then the largest size that fits.

The family's size knob is its number of transformer layers (``Trace.with_layers``), at
the hidden size, heads and sequence length of a shipped configuration: the largest
shipped one that fits (or the smallest, when none does). The search assumes that adding
layers never lowers the highest per-GPU peak; it doubles until a size does not fit,
then bisects, so it costs O(log n) simulations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from mpsim.api import simulate
from mpsim.backends import Backend, run_points
from mpsim.catalog import load_topology, load_trace, shipped_traces
from mpsim.errors import MpsimError
from mpsim.planners.best import Part, combine, parts
from mpsim.planners.context import Planned
from mpsim.planners.registry import plan_job
from mpsim.schedule import check_schedule
from mpsim.sim import SimResult
from mpsim.topology import Topology
from mpsim.trace import Trace

MAX_LAYERS = 4096


@dataclass
class FitRow:
    model: str
    params: int
    layers: int
    result: SimResult

    def to_dict(self) -> dict:
        r = self.result
        worst = max(r.gpus, key=lambda g: g.peak_bytes)
        return {
            "model": self.model,
            "params": self.params,
            "transformer_layers": self.layers,
            "fits": r.fits,
            "max_peak_bytes": worst.peak_bytes,
            "max_peak_gpu": worst.gpu,
            "capacity_bytes": worst.capacity_bytes,
            "iteration_s": r.iteration_s,
            "samples_per_s": r.samples_per_s,
            "model_tflops": r.model_tflops,
            "oom": r.oom,
        }


@dataclass
class FitsReport:
    server: str
    family: str
    schedule: str
    microbatch: int
    microbatches: int
    strategy: str
    partition: str
    rows: list[FitRow]
    largest: FitRow | None
    largest_template: str

    def to_dict(self) -> dict:
        return {
            "server": self.server, "family": self.family, "schedule": self.schedule,
            "microbatch": self.microbatch, "microbatches": self.microbatches, "strategy": self.strategy,
            "partition": self.partition,
            "rows": [r.to_dict() for r in self.rows],
            "largest": None if self.largest is None else dict(self.largest.to_dict(), template=self.largest_template),
        }


def _prefixed(on_point: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda name: on_point(f"{prefix}: {name}")


def fits_strategies(server: str | Topology, family: str, schedule: str = "1f1b", microbatch: int | None = None,
                    microbatches: int = 16,
                    strategies: tuple[str, ...] = ("none", "recompute", "cpu-swap", "d2d", "mpress", "tsplit", "best"),
                    on_point: Callable[[str], None] | None = None, partition: str = "compute",
                    models: tuple[str, ...] = (), backend: Backend | None = None) -> list[FitsReport]:
    """``fits`` under each strategy: one report per strategy, in the order given.

    ``best`` runs last: it fits whatever a single planner fits (under the same partition),
    so its search starts from the largest size they reached. With a ``backend``
    (:mod:`mpsim.backends`) the work runs in parallel in three rounds: every shipped
    size under every strategy, then the searches of the single strategies, then
    ``best``'s search, whose probes each run their single planners in parallel; the
    simulations, and so the reports, are the same as in one process. ``on_point(name)`` is
    called per simulated size in one process, per finished shipped size or search with a
    backend."""
    if backend is None:
        order = sorted(strategies, key=lambda s: s == "best")
        done: dict[str, FitsReport] = {}
        for strategy in order:
            best = strategy == "best"
            done[strategy] = fits(server, family, schedule, microbatch, microbatches, strategy, partition,
                                  on_point=None if on_point is None else _prefixed(on_point, strategy),
                                  known_fitting=_known(done.values(), partition) if best else None,
                                  known_failing=_known_failing(done.values()) if best else None,
                                  models=models)
        return [done[s] for s in strategies]
    base = _FitsUnit(server, family, schedule, microbatch, microbatches, "", partition, models)
    return _fits_parallel(base, strategies, backend, on_point)


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
        if rep.strategy == "best":
            continue
        for row in rep.rows:
            if not row.result.fits:
                note(row.model, rep.strategy, rep.partition, row.layers)
        if rep.largest is not None:
            note(rep.largest_template, rep.strategy, rep.partition, rep.largest.layers + 1)
    return failing


@dataclass(frozen=True)
class _FitsUnit:
    """One point of a parallel ``fits``: a shipped size (``size``: its index) under a
    strategy, or, with ``rows``, the strategy's search for the largest size."""

    server: str | Topology
    family: str
    schedule: str
    microbatch: int | None
    microbatches: int
    strategy: str
    partition: str
    models: tuple[str, ...]
    size: int | None = None
    rows: tuple[FitRow, ...] | None = None


def _fits_unit(unit: _FitsUnit) -> FitRow | FitsReport:
    """In a worker: simulate one shipped size, or run one strategy's search."""
    if unit.size is not None:
        traces = model_traces(unit.models) if unit.models else family_traces(unit.family)
        topo = load_topology(unit.server) if isinstance(unit.server, str) else unit.server
        t = traces[unit.size]
        mb = traces[0].microbatch if unit.microbatch is None else unit.microbatch
        result = simulate(topo, t, unit.schedule, mb, unit.microbatches, strategy=unit.strategy,
                          partition=unit.partition)
        return FitRow(t.name, t.spec.params, _n_transformer(t), result)
    return fits(unit.server, unit.family, unit.schedule, unit.microbatch, unit.microbatches, unit.strategy,
                unit.partition, models=unit.models, rows=list(unit.rows or ()))


def _fits_parallel(base: _FitsUnit, strategies: tuple[str, ...], backend: Backend,
                   on_point: Callable[[str], None] | None) -> list[FitsReport]:
    n_sizes = len(model_traces(base.models) if base.models else family_traces(base.family))
    # the checks fits makes, here, so that a bad argument fails before any worker starts
    topo = load_topology(base.server) if isinstance(base.server, str) else base.server
    check_schedule(base.schedule, topo.n_gpus, base.microbatches)
    if base.microbatch is not None and base.microbatch < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {base.microbatch}")

    def run(units: list[_FitsUnit]) -> list[FitRow | FitsReport]:
        """The units' values, in the units' order (they finish in any)."""
        where = {id(u): k for k, u in enumerate(units)}
        out: list[FitRow | FitsReport | None] = [None] * len(units)
        for outcome in run_points(units, _fits_unit, backend, batch=1):
            unit = outcome.point
            if outcome.error is not None:
                raise MpsimError(f"fits under {unit.strategy}: {outcome.error}")
            out[where[id(unit)]] = outcome.value
            if on_point:
                on_point(f"{unit.strategy}: {'search' if unit.size is None else f'size {unit.size + 1}'}")
        return [v for v in out if v is not None]

    names = list(dict.fromkeys(strategies))
    sized = run([replace(base, strategy=st, size=i) for st in names for i in range(n_sizes)])
    rows = {st: tuple(_as_row(v) for v in sized[k * n_sizes:(k + 1) * n_sizes]) for k, st in enumerate(names)}
    singles = [st for st in names if st != "best"]
    done = {st: _as_report(v) for st, v in zip(singles, run([replace(base, strategy=st, rows=rows[st])
                                                              for st in singles]))}
    if "best" in names:
        done["best"] = fits(base.server, base.family, base.schedule, base.microbatch, base.microbatches, "best",
                            base.partition, known_fitting=_known(done.values(), base.partition),
                            known_failing=_known_failing(done.values()), models=base.models,
                            rows=list(rows["best"]), backend=backend)
        if on_point:
            on_point("best: search")
    return [done[s] for s in strategies]


@dataclass(frozen=True)
class _BestPart:
    """One single planner under one partition, for a probe of ``best``'s search."""

    topo: Topology
    trace: Trace
    schedule: str
    microbatches: int
    part: Part


def _plan_best_part(unit: _BestPart) -> Planned:
    """In a worker: one part of the combined plan, through the one entry point; it builds
    the context ``plan_part`` builds for ``best`` (a stage per GPU, the part's partition)."""
    name, partition = unit.part
    return plan_job(name, unit.topo, unit.trace, unit.schedule, unit.microbatches, partition=partition)


def _best_in_parallel(topo: Topology, trace: Trace, schedule: str, microbatches: int, skip: frozenset[Part],
                      backend: Backend) -> SimResult:
    """``best``'s result for one job with its single planners run in parallel on
    ``backend``, then combined as ``plan_best`` combines them (``combine``): the same
    answer. Each part runs, even under a partition where keeping everything fits and
    ``combine`` does not ask the rest (it returns at once there)."""
    units = [_BestPart(topo, trace, schedule, microbatches, part) for part in parts(skip)]
    plans: dict[Part, Planned] = {}
    for outcome in run_points(units, _plan_best_part, backend, batch=1):
        if outcome.error is not None or outcome.value is None:
            raise MpsimError(f"fits under best ({', '.join(outcome.point.part)}): {outcome.error}")
        plans[outcome.point.part] = outcome.value
    return combine(lambda name, partition: plans[(name, partition)], skip).result


def _as_row(value: FitRow | FitsReport) -> FitRow:
    assert isinstance(value, FitRow)
    return value


def _as_report(value: FitRow | FitsReport) -> FitsReport:
    assert isinstance(value, FitsReport)
    return value


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


def fits(server: str | Topology, family: str, schedule: str = "1f1b", microbatch: int | None = None,
         microbatches: int = 16, strategy: str = "none", partition: str = "compute",
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
    topo = load_topology(server) if isinstance(server, str) else server
    traces = model_traces(models) if models else family_traces(family)
    mb = traces[0].microbatch if microbatch is None else microbatch
    if mb < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {mb}")
    check_schedule(schedule, topo.n_gpus, microbatches)

    def run(trace: Trace, skip: frozenset[tuple[str, str]] = frozenset()) -> SimResult:
        if backend is not None and strategy == "best":
            result = _best_in_parallel(topo, trace.rescale(mb), schedule, microbatches, skip, backend)
        else:
            result = plan_job(strategy, topo, trace.rescale(mb), schedule, microbatches, partition=partition,
                              known_not_fitting=skip).result
        if on_point:
            on_point(trace.name)
        return result

    if not rows:
        rows = [FitRow(t.name, t.spec.params, _n_transformer(t), run(t)) for t in traces]
    fitting = [(t, row) for t, row in zip(traces, rows) if row.result.fits]
    template = fitting[-1][0] if fitting else traces[0]
    n0 = _n_transformer(template)
    min_layers = max(1, topo.n_gpus - (template.n_layers - n0))  # every stage needs a layer

    cache: dict[int, FitRow] = {n0: fitting[-1][1]} if fitting else {}

    def probe(n: int) -> FitRow:
        if n not in cache:
            t = template.with_layers(n)
            skip = frozenset((name, part) for (at, name, part), m in (known_failing or {}).items()
                             if at == template.name and m <= n) if strategy == "best" else frozenset()
            cache[n] = FitRow(t.name, t.spec.params, n, run(t, skip))
        return cache[n]

    if fitting:
        lo, hi = n0, None
        step = max(1, n0)
        hint = (known_fitting or {}).get(template.name, 0)
        if hint > lo:  # best: usually the largest a single planner reached; one layer more first
            lo, step = hint, 1
        while hi is None:
            cand = lo + step
            if cand > MAX_LAYERS:
                raise MpsimError(f"{family} still fits with {lo} layers; stopped searching at {MAX_LAYERS}")
            if probe(cand).result.fits:
                lo, step = cand, step * 2
            else:
                hi = cand
    else:
        hi, lo = n0, None
        n = n0
        while lo is None:
            n = max(min_layers, n // 2)
            if probe(n).result.fits:
                lo = n
            elif n == min_layers:
                break
            else:
                hi = n
        if lo is None:
            return FitsReport(topo.name, family, schedule, mb, microbatches, strategy, partition, rows, None,
                              template.name)
    assert lo is not None and hi is not None  # each search above ends with both bounds set
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid).result.fits:
            lo = mid
        else:
            hi = mid
    return FitsReport(topo.name, family, schedule, mb, microbatches, strategy, partition, rows, probe(lo),
                      template.name)
