"""Studies, each many simulations: what fits (``fits``), grids (``sweep``), which server to
buy or rent (``choose``), the papers' comparisons (``reproduce``), and efficiencies fitted
to a measured trace (``calibrate``). They return data; :mod:`mpsim.views` shows it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpsim.api.jobs import measured_warning
from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.models.finetune import FineTune
from mpsim.models.trace import Trace
from mpsim.plans.job import DEFAULT_MICROBATCHES, DEFAULT_SCHEDULE, JobSpec, check_strategy, pipeline
from mpsim.plans.layouts import DEFAULT_LAYOUTS, candidate_layouts, check_global_microbatches
from mpsim.studies.backends import Backend, backend_for
from mpsim.studies.capacity import LayoutFits, family_job, family_traces, fits_layouts, model_traces
from mpsim.studies.sweep import Point
from mpsim.timing.runtime import DEFAULT_PROFILE

SEARCH_PROBES = 10
"""About how many sizes one strategy's largest-size search simulates in one process."""


@dataclass(frozen=True)
class FitsRequest:
    """``fits`` under several strategies and layouts, checked before any simulation: the job
    at the family's smallest size, the family (the named models' own) and its traces, the
    layouts (``mpsim.plans.layouts``) and the microbatches per iteration over all replicas
    (``global_microbatches``), the
    backend the work runs on (None: this process), and how many points ``run``'s
    ``on_point`` hears."""

    job: JobSpec
    family: str
    traces: tuple[Trace, ...]
    models: tuple[str, ...]
    strategies: tuple[str, ...]
    backend: Backend | None
    points: int
    layouts: str = DEFAULT_LAYOUTS
    global_microbatches: int = DEFAULT_MICROBATCHES
    search: bool = True
    """False: the shipped sizes only, no largest-size search (``--no-largest``)."""

    def run(self, on_point: Callable[[str], None] | None = None) -> list[LayoutFits]:
        """One answer per strategy over the layouts, in the order asked
        (:func:`mpsim.studies.capacity.fits_layouts`)."""
        try:
            return fits_layouts(self.job, self.family, list(self.traces), self.strategies, self.layouts,
                                self.global_microbatches, self.models, on_point, self.backend, self.search)
        finally:
            if self.backend is not None:
                self.backend.close()


def fits_request(server: str, family: str, models: Sequence[str] = (), schedule: str = DEFAULT_SCHEDULE,
                 microbatch: int | None = None, global_microbatches: int = DEFAULT_MICROBATCHES,
                 strategies: Sequence[str] = ("none",),
                 partition: str = "compute", workers: int | None = None, backend: str = "local",
                 address: str | None = None, layouts: str = DEFAULT_LAYOUTS, search: bool = True,
                 runtime_profile: str = DEFAULT_PROFILE) -> FitsRequest:
    """Check a ``fits`` over ``strategies`` and ``layouts`` of ``family``'s shipped sizes (or
    of ``models``), ``global_microbatches`` per iteration over all replicas (each layout's
    replicas run ``ceil(global_microbatches / replicas)``), and pick where it
    runs: one process when ``backend`` is local with one worker, else ``workers`` local
    processes (default: one per core) or a Ray cluster at ``address``. ``search=False``
    leaves out the largest-size search (``--no-largest``); ``runtime_profile``: the
    framework's run-time rules (``mpsim.timing.runtime``)."""
    check_global_microbatches(global_microbatches)
    for name in strategies:
        check_strategy(name)
    if not strategies:
        raise MpsimError("--strategy needs at least one strategy")
    traces = model_traces(tuple(models)) if models else family_traces(family)
    if models:
        family = str(traces[-1].spec.model.get("family", family))
    topo = load_topology(server)
    n_layouts = len(candidate_layouts(topo, layouts, schedule, traces[-1]))
    # one stage: the base job checks the schedule and count; each layout takes its share
    job = family_job(topo, traces, schedule, microbatch, global_microbatches, "none", partition, pipeline(1),
                     runtime_profile)
    workers = workers or os.cpu_count() or 1
    runner = backend_for(backend, workers, address)
    # in one process a point is a simulated size (the searches' count estimated); in
    # parallel, a shipped size under a strategy, or one strategy's search
    probes = 0 if not search else SEARCH_PROBES if runner is None else 1
    points = (len(traces) + probes) * len(strategies) * n_layouts
    return FitsRequest(job, family, tuple(traces), tuple(models), tuple(strategies), runner, points, layouts,
                       global_microbatches, search)


def fine_tuned_files(family: str, models: Sequence[str], spec: FineTune, folder: Path) -> list[str]:
    """``fits --lora``: each of ``family``'s shipped sizes (or ``models``) fine-tuned as
    ``spec`` says (``at_finetune``), written to ``folder`` as trace files: the files are what
    ``fits`` runs, since its workers load every model again by name."""
    from mpsim.models.retrace import at_finetune
    from mpsim.studies.capacity import shipped_or_named

    paths: list[str] = []
    for trace in shipped_or_named(family, tuple(models)):
        tuned = at_finetune(trace, spec)
        path = folder / f"{tuned.name}.json"
        path.write_text(tuned.to_json() + "\n")
        paths.append(str(path))
    return paths


def sweep_warnings(points: Sequence[Point]) -> Iterator[str]:
    """A line for each server and model of a sweep whose trace holds times measured on
    another kind of device (``measured_warning``), as each pair is loaded."""
    for server, model in dict.fromkeys((p.server, p.model) for p in points):
        line = measured_warning(load_trace(model), load_topology(server))
        if line:
            yield line


def reproduce(papers: Sequence[str], out: Path, on_step: Callable[[str], None] | None = None,
              on_written: Callable[[Path], None] | None = None) -> list[str]:
    """Simulate each paper's comparisons (``mpress``, ``mcap``, ``tsplit``) and write its
    markdown report with plots into ``out``; returns the reports. ``on_step`` hears what
    runs, ``on_written`` each report's file."""
    from mpsim.studies.reproduce import REPORTS  # it plans and simulates through this facade

    for name in papers:
        if name not in REPORTS:
            raise MpsimError(f"unknown paper {name!r}: expected one of {', '.join(REPORTS)}")
    out.mkdir(parents=True, exist_ok=True)
    texts = []
    for name in papers:
        texts.append(REPORTS[name](out, on_step or (lambda what: None)))
        if on_written:
            on_written(out / f"{name}.md")
    return texts
