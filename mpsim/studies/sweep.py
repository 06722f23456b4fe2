"""Sweeps: one simulated point per (server, model, microbatch size, microbatches, strategy,
parallel layout).

The layout axis (``mpsim.plans.layouts``: ``pipeline`` by default, ``all``, ``data`` or names such
as ``fsdp8``) is expanded per server, and the CSV's ``layout`` column names each point's
layout (``pp8``, ``fsdp8``, ``ddp2xpp4``). A point's ``microbatches`` (the CSV column, as
``--global-microbatches`` gives it) counts the whole iteration over all replicas, so every
layout trains on the same global batch: a layout of ``dp`` replicas runs
``ceil(microbatches / dp)`` per replica, at least one per stage for 1f1b and pipedream.

Points run on a backend (:mod:`mpsim.studies.backends`: local worker processes, or Ray); each
finished point is appended to the CSV at once, as one complete line in a single write, so
a sweep that is interrupted (Ctrl-C, SIGTERM, even ``kill -9``) resumes where it stopped:
points already in the file are not run again, and a last line cut short by a kill is
dropped on resume. On Ctrl-C or SIGTERM the queued points are cancelled and the workers
terminated (on Ray: the outstanding tasks cancelled) at once; only the points in flight
are lost. A point that does not fit is a row too, with its first out-of-memory point.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.planners import plan_job
from mpsim.plans.job import PIPELINE_ONLY, JobSpec, job_of
from mpsim.plans.layouts import (
    candidate_layouts,
    check_global_microbatches,
    microbatches_per_replica,
    parse_layout,
    short_name,
)
from mpsim.studies.backends import Backend, LocalBackend, run_points

KEY = ("server", "model", "schedule", "microbatch", "microbatches", "strategy", "partition", "layout")
FIELDS = KEY + ("fits", "samples_per_s", "iteration_s", "model_tflops", "max_peak_gib", "max_peak_gpu",
                "capacity_gib", "oom_gpu", "oom_time_s", "oom_task", "chosen", "plan_s")


@dataclass(frozen=True)
class Point:
    """One point of the grid by name: the CSV row's key, and what a worker turns into a
    ``JobSpec`` (``mpsim.plans.job.job_of``) to plan and simulate."""

    server: str
    model: str
    schedule: str
    microbatch: int
    microbatches: int
    """Per iteration over all replicas (``--global-microbatches``); each replica of the
    layout runs its share (``microbatches_per_replica``)."""
    strategy: str
    partition: str = "compute"
    layout: str = ""
    """A layout name (``mpsim.plans.layouts.parse_layout``: ``pp8``, ``fsdp8``); empty: one
    pipeline stage per GPU."""

    def key(self) -> tuple[str, ...]:
        return tuple(str(v) for v in asdict(self).values())

    def on(self, job: JobSpec) -> JobSpec:
        """This point's job from ``job`` on its server, model and microbatch size (``base_job``),
        its fields all replaced at once and checked."""
        par, m = PIPELINE_ONLY, self.microbatches
        if self.layout:
            par = parse_layout(self.layout)
            m = microbatches_per_replica(self.microbatches, par, par.stages_on(job.topology), self.schedule)
        return job.but(schedule=self.schedule, microbatches=m, strategy=self.strategy, partition=self.partition,
                       parallelism=par)

    def base_job(self) -> JobSpec:
        """The point's server and model at its microbatch size, as one stage (any schedule
        and count may replace that one's); ``on`` makes it the point's job."""
        return job_of(self.server, self.model, microbatch=self.microbatch, n_stages=1)


def grid(servers: list[str], models: list[str], schedule: str, microbatch_sizes: list[int],
         global_microbatches: list[int], strategies: list[str], partition: str = "compute",
         layouts: str = "pipeline") -> list[Point]:
    """The points of the grid; ``layouts`` (``mpsim.plans.layouts.candidate_layouts``: words
    and names, expanded per server) is the layout axis (empty: no layout named, one
    pipeline stage per GPU); ``global_microbatches``: the counts per iteration over all replicas."""
    for name, values in (("--server", servers), ("--model", models), ("--microbatch", microbatch_sizes),
                         ("--global-microbatches", global_microbatches), ("--strategy", strategies)):
        if not values:
            raise MpsimError(f"{name} needs at least one value")
    for count in global_microbatches:
        check_global_microbatches(count)
    per_job = {(sv, md): _layout_names(sv, md, layouts, schedule) for sv in servers for md in models}
    return [Point(sv, md, schedule, mb, m, st, partition, lay)
            for sv, md, m, st in itertools.product(servers, models, global_microbatches, strategies)
            for lay in per_job[(sv, md)] for mb in microbatch_sizes]


def _layout_names(server: str, model: str, layouts: str, schedule: str) -> list[str]:
    """The layouts of ``layouts`` on ``server``, those ``model`` cannot split left out."""
    if not layouts:
        return [""]
    found = candidate_layouts(load_topology(server), layouts, schedule, load_trace(model))
    return [short_name(p, p.pipeline or 1) for p in found]


def check_points(points: list[Point]) -> None:
    """Refuse unknown names and impossible sizes before any point runs: every distinct job
    of the grid is built once as a ``JobSpec``, which checks it (a trace is rescaled once
    per server, model and microbatch size)."""
    jobs: dict[tuple[str, str, int], JobSpec] = {}
    for p in points:
        job = jobs.get((p.server, p.model, p.microbatch))
        if job is None:
            job = jobs[(p.server, p.model, p.microbatch)] = p.base_job()
        p.on(job)


def run_point(p: Point) -> dict:
    """Plan and simulate one point; the CSV row."""
    t0 = time.perf_counter()
    planned = plan_job(p.on(p.base_job()))
    r = planned.result
    worst = max(r.gpus, key=lambda g: g.peak_bytes)
    oom = r.oom or {}
    row: dict[str, object] = dict(zip(KEY, p.key()))
    row.update(fits=r.fits, samples_per_s=round(r.samples_per_s, 6) if r.fits else "",
               iteration_s=round(r.iteration_s, 6), model_tflops=round(r.model_tflops, 4) if r.fits else "",
               max_peak_gib=round(worst.peak_bytes / 2**30, 4), max_peak_gpu=worst.gpu,
               capacity_gib=round(worst.capacity_bytes / 2**30, 4), oom_gpu=oom.get("gpu", ""),
               oom_time_s=round(oom["time_s"], 6) if oom else "", oom_task=oom.get("task", ""),
               chosen=r.strategy, plan_s=round(time.perf_counter() - t0, 3))
    return row


class SweepInterrupted(Exception):
    """A sweep stopped by SIGINT or SIGTERM; the rows finished before it are in the CSV."""

    def __init__(self, signum: int, kept: int, new: int, total: int, csv_path: Path):
        self.signum, self.kept, self.new, self.total, self.csv_path = signum, kept, new, total, csv_path
        name = signal.Signals(signum).name
        super().__init__(f"sweep interrupted by {name}: {kept} of {total} points kept in {csv_path} ({new} new); "
                         "run the same command again to resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by it (130, 143)."""
        return 128 + self.signum


class SweepFailed(MpsimError):
    """Points whose simulation raised: the other rows are in the CSV; a rerun tries these again."""

    def __init__(self, failed: list[tuple[Point, str]], csv_path: Path):
        self.failed = failed
        point, error = failed[0]
        super().__init__(f"{len(failed)} point(s) failed, the other rows are in {csv_path}; first: "
                         f"{point.model} mb {point.microbatch} {point.strategy}: {error}")


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler, like KeyboardInterrupt for SIGINT."""


def _line(values: list[str] | tuple[str, ...] | dict) -> bytes:
    buf = io.StringIO()
    if isinstance(values, dict):
        csv.DictWriter(buf, fieldnames=FIELDS).writerow(values)
    else:
        csv.writer(buf).writerow(values)
    return buf.getvalue().encode()


def _default_note(msg: str) -> None:
    print(f"mpsim: note: {msg}", file=sys.stderr)


def _repair(csv_path: Path, note: Callable[[str], None]) -> set[tuple[str, ...]]:
    """The points already in ``csv_path``. A last line cut short (no newline at its end, or
    not the header's number of columns), as a kill in the middle of a write leaves it, is
    dropped: the file is truncated to its last complete row and the point runs again."""
    if not csv_path.exists():
        return set()
    data = csv_path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end == 0:  # nothing complete, not even the header
        if data and not _line(FIELDS).startswith(data):
            raise MpsimError(f"{csv_path}: not a sweep CSV of this version (columns differ); use another --csv")
        if data:
            note(f"{csv_path}: dropped a header cut short")
            os.truncate(csv_path, 0)
        return set()
    rows = list(csv.reader(io.StringIO(data[:end].decode("utf-8", errors="replace"), newline="")))
    if tuple(rows[0]) != FIELDS:
        raise MpsimError(f"{csv_path}: not a sweep CSV of this version (columns differ); use another --csv")
    torn = end < len(data)
    if len(rows) > 1 and len(rows[-1]) != len(FIELDS):
        torn = True
        rows.pop()
        end = data.rfind(b"\n", 0, end - 1) + 1
    if torn:
        note(f"{csv_path}: dropped a last line cut short (its point runs again)")
        os.truncate(csv_path, end)
    bad = [i for i, row in enumerate(rows) if len(row) != len(FIELDS)]
    if bad:  # a line glued onto a cut one by an older mpsim: keep the good rows, atomically
        note(f"{csv_path}: dropped {len(bad)} malformed line(s) (their points run again)")
        rows = [row for row in rows if len(row) == len(FIELDS)]
        tmp = csv_path.with_name(csv_path.name + ".tmp")
        tmp.write_bytes(b"".join(_line(row) for row in rows))
        os.replace(tmp, csv_path)
    return {tuple(row[:len(KEY)]) for row in rows[1:]}


class _Appender:
    """Appends rows to the CSV, each as one complete line in one write, flushed to disk, so a
    kill at any moment leaves at most one line cut short (which the next run drops)."""

    def __init__(self, csv_path: Path):
        self.fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        if os.fstat(self.fd).st_size == 0:
            self._write(_line(FIELDS))

    def _write(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def row(self, row: dict) -> None:
        self._write(_line(row))

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises in the main thread (SIGINT already does, as KeyboardInterrupt), so
    both stop the sweep the same way; the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sweep(points: list[Point], csv_path: Path, workers: int = 1,
          on_row: Callable[[dict, bool], None] | None = None,
          note: Callable[[str], None] = _default_note, backend: Backend | None = None,
          batch: int | None = None, on_failed: Callable[[Point, str], None] | None = None) -> pd.DataFrame:
    """Run the points not yet in ``csv_path``, appending each row as it finishes; returns
    every row of the file for these points. ``backend`` runs them (default: ``workers``
    local processes), ``batch`` points per task (default: see :func:`mpsim.studies.backends.auto_batch`).
    ``on_row(row, resumed)`` is called per point written or already there; ``on_failed(point,
    error)`` per point whose simulation raised (no row is written for it, so a rerun tries
    it again; after the others finish, :class:`SweepFailed` names them). ``note(text)``
    tells of a cut-short line dropped from the file. SIGINT or SIGTERM stops the sweep at
    once (queued points cancelled, workers terminated or Ray tasks cancelled) and raises
    :class:`SweepInterrupted`."""
    check_points(points)
    done = _repair(csv_path, note)
    todo = [p for p in points if p.key() not in done]
    wanted = {p.key() for p in points}
    if on_row:
        for p in points:
            if p.key() in done:
                on_row(dict(zip(KEY, p.key())), True)
    out = _Appender(csv_path)

    def emit(row: dict) -> None:
        out.row(row)
        if on_row:
            on_row(row, False)

    failed: list[tuple[Point, str]] = []

    def fail(point: Point, error: str) -> None:
        failed.append((point, error))
        if on_failed:
            on_failed(point, error)

    stopped_by: int | None = None
    try:
        with _signals_raise():
            _run(todo, backend or LocalBackend(workers), emit, fail, batch)
    except (KeyboardInterrupt, _Terminated) as exc:
        stopped_by = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
    finally:
        out.close()
    if stopped_by is not None:  # count what is on disk: a signal may land between a write and a count
        kept = wanted & _repair(csv_path, note)
        raise SweepInterrupted(stopped_by, len(kept), len(kept - done), len(points), csv_path)
    if failed:
        raise SweepFailed(failed, csv_path)
    frame = pd.read_csv(csv_path, keep_default_na=False)
    mask = [tuple(str(v) for v in row) in wanted for row in frame[list(KEY)].itertuples(index=False)]
    return frame[mask].reset_index(drop=True)


def _run(todo: list[Point], backend: Backend, emit: Callable[[dict], None],
         on_failed: Callable[[Point, str], None], batch: int | None) -> None:
    with closing(run_points(todo, run_point, backend, batch=batch)) as outcomes:
        for outcome in outcomes:
            if outcome.error is not None:
                on_failed(outcome.point, outcome.error)
            else:
                assert outcome.value is not None  # run_point returns a row
                emit(outcome.value)
