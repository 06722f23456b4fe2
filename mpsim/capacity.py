"""What fits: every shipped size of a model family, then the largest size that fits.

The family's size knob is its number of transformer layers (``Trace.with_layers``), at
the hidden size, heads and sequence length of a shipped configuration: the largest
shipped one that fits (or the smallest, when none does). The search assumes that adding
layers never lowers the highest per-GPU peak; it doubles until a size does not fit,
then bisects, so it costs O(log n) simulations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpsim.api import simulate
from mpsim.catalog import load_topology, load_trace, shipped_traces
from mpsim.errors import MpsimError
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
                    models: tuple[str, ...] = ()) -> list[FitsReport]:
    """``fits`` under each strategy: one report per strategy, in the order given.

    ``best`` runs last: it fits whatever a single planner fits (under the same partition),
    so its search starts from the largest size they reached."""
    order = sorted(strategies, key=lambda s: s == "best")
    done: dict[str, FitsReport] = {}
    for strategy in order:
        known: dict[str, int] = {}
        if strategy == "best":
            for rep in done.values():
                if rep.largest is not None and rep.partition == partition:
                    t = rep.largest_template
                    known[t] = max(known.get(t, 0), rep.largest.layers)
        done[strategy] = fits(server, family, schedule, microbatch, microbatches, strategy, partition,
                              on_point=None if on_point is None else _prefixed(on_point, strategy),
                              known_fitting=known, models=models)
    return [done[s] for s in strategies]


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
         models: tuple[str, ...] = ()) -> FitsReport:
    """Simulate every shipped size of ``family`` (or the named ``models`` instead) and
    search the largest that fits.

    ``known_fitting``: per template trace name, a number of transformer layers already
    known to fit under this strategy; the search starts there."""
    topo = load_topology(server) if isinstance(server, str) else server
    traces = model_traces(models) if models else family_traces(family)
    mb = traces[0].microbatch if microbatch is None else microbatch
    if mb < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {mb}")
    check_schedule(schedule, topo.n_gpus, microbatches)

    def run(trace: Trace) -> SimResult:
        result = simulate(topo, trace, schedule, mb, microbatches, strategy=strategy, partition=partition)
        if on_point:
            on_point(trace.name)
        return result

    rows = [FitRow(t.name, t.spec.params, _n_transformer(t), run(t)) for t in traces]
    fitting = [(t, row) for t, row in zip(traces, rows) if row.result.fits]
    template = fitting[-1][0] if fitting else traces[0]
    n0 = _n_transformer(template)
    min_layers = max(1, topo.n_gpus - (template.n_layers - n0))  # every stage needs a layer

    cache: dict[int, FitRow] = {n0: fitting[-1][1]} if fitting else {}

    def probe(n: int) -> FitRow:
        if n not in cache:
            t = template.with_layers(n)
            cache[n] = FitRow(t.name, t.spec.params, n, run(t))
        return cache[n]

    if fitting:
        lo, hi = n0, None
        step = max(1, n0)
        hint = (known_fitting or {}).get(template.name, 0)
        if hint > lo:
            lo, step = hint, max(1, hint // 8)
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
