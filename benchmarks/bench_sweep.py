"""Sweep throughput (issue "Sweeps beyond one machine on Ray"): points per second against
workers on the local pool and on a local Ray instance, and Ray's scheduling cost per task.

    python benchmarks/bench_sweep.py [--points 1000] [--no-ray]

The sweep is a grid of cheap points (gpt-5.3b on dgx1-v100, strategies none and
recompute, microbatch sizes and counts varied) cut to ``--points``. Each configuration
starts from an empty CSV; the figures include starting the workers (spawned processes,
or Ray's worker pool), as a user's sweep pays them too. Ray's own start (``ray.init``) is
printed apart. Prints one line per figure; reports/bench_sweep.txt holds a run's output.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mpsim.studies.backends import Backend, LocalBackend, RayBackend, run_points
from mpsim.studies.sweep import Point, grid, sweep


def points(n: int) -> list[Point]:
    """``n`` points of a grid that has enough of them (microbatch sizes 1-8, counts 8-...)."""
    counts = list(range(8, 8 + max(1, -(-n // 16))))
    every = grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", list(range(1, 9)), counts, ["none", "recompute"])
    return every[:n]


def timed_sweep(todo: list[Point], backend: Backend) -> float:
    """Seconds for the whole sweep into a fresh CSV."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        frame = sweep(todo, Path(tmp) / "s.csv", backend=backend)
        seconds = time.perf_counter() - t0
    assert len(frame) == len(todo)
    return seconds


def report(label: str, n: int, seconds: float, base_s: float | None) -> None:
    ratio = f", {base_s / seconds:.2f}x the 1-worker pool" if base_s else ""
    print(f"{label}: {n} points in {seconds:.1f} s = {n / seconds:.2f} points/s{ratio}; "
          f"{n} -> 1000 points: {1000 * seconds / n / 60:.1f} min (target <= 5 min)", flush=True)


def ray_overhead_per_task(ray_backend: RayBackend, n_tasks: int = 400) -> tuple[float, float]:
    """Seconds per task and per point for trivial points (``abs``): one point per task,
    then 8, so the difference is Ray's scheduling and transfer cost, not the work."""
    per_task = []
    for size in (1, 8):
        t0 = time.perf_counter()
        done = sum(1 for _ in run_points(range(n_tasks * size), abs, ray_backend, batch=size))
        assert done == n_tasks * size
        per_task.append((time.perf_counter() - t0) / n_tasks)
    return per_task[0], per_task[1] / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    todo = points(args.points)
    base_s = timed_sweep(todo, LocalBackend(1))
    report("local pool, 1 worker (in process)", len(todo), base_s, None)
    report("local pool, 2 workers", len(todo), timed_sweep(todo, LocalBackend(2)), base_s)
    if args.no_ray:
        return
    import ray

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    print(f"ray.init, local instance with 2 CPUs: {time.perf_counter() - t0:.1f} s (not in the figures below)")
    try:
        report("local Ray, 2 CPUs", len(todo), timed_sweep(todo, RayBackend()), base_s)
        task_s, point_s = ray_overhead_per_task(RayBackend())
        print(f"Ray scheduling overhead: {task_s * 1e3:.2f} ms per task of one trivial point; "
              f"{point_s * 1e3:.3f} ms per trivial point in tasks of 8")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
