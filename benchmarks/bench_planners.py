"""Planner speed targets (issue "Planners from the papers"): prints figures measured in one run.

    python benchmarks/bench_planners.py
"""

from __future__ import annotations

import time

import numpy as np

from mpsim.api import plan
from mpsim.data.catalog import load_topology, load_trace
from mpsim.planners.mapping import search_mapping
from mpsim.plans.partition import min_max_partition, stage_peak_table

GiB = 2**30


def best_of(f, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    dgx1 = load_topology("dgx1-v100")
    demand = [20 * GiB, 12 * GiB, 6 * GiB, 2 * GiB, 0, 0, 0, 0]
    spare = [0, 0, 0, 0, 3 * GiB, 5 * GiB, 8 * GiB, 9 * GiB]
    t = best_of(lambda: search_mapping(dgx1, demand, spare))
    m = search_mapping(dgx1, demand, spare)
    print(f"device-mapping search, dgx1-v100 (8 GPUs, {m.searched} maps): {t * 1e3:.0f} ms  (target < 1 s)")
    for name in ("dgx2-v100", "a100-40gb-nvswitch"):
        topo = load_topology(name)
        d = demand + [0] * (topo.n_gpus - 8)
        s = spare + [4 * GiB] * (topo.n_gpus - 8)
        t = best_of(lambda topo=topo, d=d, s=s: search_mapping(topo, d, s))
        print(f"device-mapping search, {name} ({topo.n_gpus} GPUs, symmetric: skipped): {t * 1e3:.2f} ms")

    rng = np.random.default_rng(0)
    n, p = 100, 8
    added = rng.uniform(0.2, 1.0, n) * GiB
    transient = rng.uniform(0.0, 0.3, n) * GiB
    b_in = rng.uniform(0, 0.05, n + 1) * GiB
    b_out = rng.uniform(0, 0.05, n + 1) * GiB

    def partition() -> None:
        tables = [stage_peak_table(added * (1 + 0.1 * (p - k)), transient, b_in, b_out) for k in range(p)]
        min_max_partition(tables)

    t = best_of(partition)
    print(f"memory-balanced partition, {n} layers over {p} GPUs (exact DP, tables included): {t * 1e3:.1f} ms  "
          f"(target < 100 ms)")

    trace = load_trace("gpt-25.5b")
    t0 = time.perf_counter()
    planned = plan(dgx1, trace, "1f1b", 2, 16, strategy="mpress")
    t = time.perf_counter() - t0
    r = planned.result
    print(f"MPress plan, gpt-25.5b on dgx1-v100: {t:.2f} s, {planned.simulations} simulations, fits={r.fits}, "
          f"{r.samples_per_s:.2f} samples/s  (target < 10 s)")


if __name__ == "__main__":
    main()
