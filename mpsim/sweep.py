"""Sweeps: one simulated point per (server, model, microbatch size, microbatches, strategy).

Points run in worker processes; each finished point is appended to the CSV at once, so
a sweep that is interrupted resumes where it stopped: points already in the file are not
run again. A point that does not fit is a row too, with its first out-of-memory point.
"""

from __future__ import annotations

import csv
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from mpsim.errors import MpsimError

KEY = ("server", "model", "schedule", "microbatch", "microbatches", "strategy", "partition")
FIELDS = KEY + ("fits", "samples_per_s", "iteration_s", "model_tflops", "max_peak_gib", "max_peak_gpu",
                "capacity_gib", "oom_gpu", "oom_time_s", "oom_task", "chosen", "plan_s")


@dataclass(frozen=True)
class Point:
    server: str
    model: str
    schedule: str
    microbatch: int
    microbatches: int
    strategy: str
    partition: str = "compute"

    def key(self) -> tuple[str, ...]:
        return tuple(str(v) for v in asdict(self).values())


def grid(servers: list[str], models: list[str], schedule: str, microbatch_sizes: list[int],
         microbatch_counts: list[int], strategies: list[str], partition: str = "compute") -> list[Point]:
    for name, values in (("--server", servers), ("--model", models), ("--microbatch", microbatch_sizes),
                         ("--microbatches", microbatch_counts), ("--strategy", strategies)):
        if not values:
            raise MpsimError(f"{name} needs at least one value")
    return [Point(sv, md, schedule, mb, m, st, partition)
            for sv, md, m, st, mb in itertools.product(servers, models, microbatch_counts, strategies,
                                                       microbatch_sizes)]


def check_points(points: list[Point]) -> None:
    """Refuse unknown names and impossible sizes before any point runs."""
    from mpsim.catalog import load_topology, load_trace
    from mpsim.planners import PARTITIONS, STRATEGIES
    from mpsim.schedule import check_schedule

    for p in points:
        if p.strategy not in STRATEGIES:
            raise MpsimError(f"unknown strategy {p.strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if p.partition not in PARTITIONS:
            raise MpsimError(f"unknown partition {p.partition!r}: expected one of {', '.join(PARTITIONS)}")
        if p.microbatch < 1:
            raise MpsimError(f"microbatch must be a positive integer, got {p.microbatch}")
    for sv in {p.server for p in points}:
        topo = load_topology(sv)
        for m in {p.microbatches for p in points}:
            check_schedule(points[0].schedule, topo.n_gpus, m)
    for md in {p.model for p in points}:
        load_trace(md)


def run_point(p: Point) -> dict:
    """Plan and simulate one point; the CSV row."""
    from mpsim.api import plan

    t0 = time.perf_counter()
    planned = plan(p.server, p.model, p.schedule, p.microbatch, p.microbatches, strategy=p.strategy,
                   partition=p.partition)
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


def _done(csv_path: Path) -> set[tuple[str, ...]]:
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return set()
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise MpsimError(f"{csv_path}: not a sweep CSV of this version (columns differ); use another --csv")
        return {tuple(row[k] for k in KEY) for row in reader}


def sweep(points: list[Point], csv_path: Path, workers: int = 1,
          on_row: Callable[[dict, bool], None] | None = None) -> pd.DataFrame:
    """Run the points not yet in ``csv_path``, appending each row as it finishes; returns
    every row of the file for these points. ``on_row(row, resumed)`` is called per point."""
    check_points(points)
    done = _done(csv_path)
    todo = [p for p in points if p.key() not in done]
    if on_row:
        for p in points:
            if p.key() in done:
                on_row(dict(zip(KEY, p.key())), True)
    new_file = not csv_path.exists() or csv_path.stat().st_size == 0
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            writer.writeheader()
            f.flush()
        for row in _run(todo, workers):
            writer.writerow(row)
            f.flush()
            if on_row:
                on_row(row, False)
    frame = pd.read_csv(csv_path, keep_default_na=False)
    wanted = {p.key() for p in points}
    mask = [tuple(str(v) for v in row) in wanted for row in frame[list(KEY)].itertuples(index=False)]
    return frame[mask].reset_index(drop=True)


def _run(todo: list[Point], workers: int) -> Iterator[dict]:
    if workers <= 1 or len(todo) <= 1:
        for p in todo:
            yield run_point(p)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_point, p) for p in todo]
        for fut in as_completed(futures):
            yield fut.result()


def sweep_text(frame: pd.DataFrame) -> str:
    """Samples/s (or OOM and the highest peak) per microbatch size, one column per strategy."""
    from mpsim.report import _table

    lines = []
    for (sv, md, m), part in frame.groupby(["server", "model", "microbatches"], sort=False):
        strategies = list(dict.fromkeys(part["strategy"]))
        rows = []
        for mb in sorted({int(x) for x in part["microbatch"]}):
            cells = [str(mb)]
            for st in strategies:
                r = part[(part["microbatch"].astype(int) == mb) & (part["strategy"] == st)]
                if r.empty:
                    cells.append("")
                    continue
                r = r.iloc[0]
                fits = str(r["fits"]) == "True"
                cells.append(f"{float(r['samples_per_s']):.2f}/s {float(r['max_peak_gib']):.1f}G" if fits
                             else f"OOM {float(r['max_peak_gib']):.1f}G")
            rows.append(cells)
        lines += [f"{md} on {sv}, {m} microbatches: samples/s and highest per-GPU peak (GiB)", "",
                  _table(["microbatch"] + strategies, rows), ""]
    return "\n".join(lines).rstrip()


def plot_sweep(frame: pd.DataFrame, path: Path) -> None:
    """Throughput and highest per-GPU peak against microbatch size, a line per strategy
    (and server/model when the sweep has several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    several = frame[["server", "model", "microbatches"]].drop_duplicates().shape[0] > 1
    for keys, part in frame.groupby(["server", "model", "microbatches", "strategy"], sort=False):
        sv, md, m, st = keys
        label = f"{st} ({md}, {sv}, m={m})" if several else st
        part = part.assign(mb=part["microbatch"].astype(int)).sort_values("mb")
        fits = part["fits"].astype(str) == "True"
        thr = pd.to_numeric(part["samples_per_s"].where(fits), errors="coerce")
        line, = ax_t.plot(part["mb"], thr, marker="o", label=label)
        ax_m.plot(part["mb"], part["max_peak_gib"].astype(float), marker="o", color=line.get_color(), label=label)
        oom = part[~fits]
        ax_m.scatter(oom["mb"], oom["max_peak_gib"].astype(float), marker="x", color=line.get_color(), s=60)
    cap = frame["capacity_gib"].astype(float).max()
    ax_m.axhline(cap, color="grey", linestyle="--", linewidth=1, label=f"capacity {cap:.1f} GiB")
    ax_t.set(xlabel="microbatch size", ylabel="samples/s (where it fits)", title="throughput")
    ax_m.set(xlabel="microbatch size", ylabel="highest per-GPU peak (GiB)", title="peak memory (x: does not fit)")
    ax_t.legend(fontsize=7)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
