"""What data-parallel replicas cost the simulator: one iteration of the same job with
dp = 1, 2 and 8 (DDP, ZeRO-2 and FSDP), in-process, the best of several runs after a warm
one (plans and stage programs are built before the clock starts).

    python benchmarks/bench_dp.py > reports/bench_dp.txt

Replicas are accounted, not simulated: dp = 8 runs one replica's streams, like dp = 1; what
it adds is its collectives (one fused ring per bucket or layer, ``mpsim.sim.collectives``).
"""

from __future__ import annotations

import time

from mpsim.plans.job import Parallelism, job_of
from mpsim.sim import Job, SimResult, simulate_job

SERVER, MODEL, MICROBATCH, MICROBATCHES = "dgx-a100-80gb", "llama-3-8b", 1, 8
REPEATS = 5


def best_simulation(job: Job, repeats: int = REPEATS) -> tuple[float, SimResult]:
    """The best wall time of ``repeats`` simulations of ``job`` after a warm one (plans and
    stage programs built before the clock starts), and its result."""
    result = simulate_job(job)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        simulate_job(job)
        times.append(time.perf_counter() - start)
    return min(times), result


def _best_s(parallelism: Parallelism) -> tuple[float, int]:
    best_s, result = best_simulation(Job(job_of(SERVER, MODEL, microbatch=MICROBATCH, microbatches=MICROBATCHES,
                                                n_stages=1, parallelism=parallelism)))
    return best_s, result.sim_events


def main() -> None:
    print(f"{MODEL} on {SERVER}, microbatch {MICROBATCH} x {MICROBATCHES} per replica, one stage per replica; "
          f"best of {REPEATS} runs")
    print(f"{'layout':<10} {'dp=1 ms':>8} {'dp=2 ms':>8} {'dp=8 ms':>8} {'events 1/2/8':>18} {'8 over 1':>9} "
          f"{'8 over 2':>9}")
    for zero, name in ((0, "DDP"), (2, "ZeRO-2"), (3, "FSDP")):
        runs = {d: _best_s(Parallelism(data=d, zero_stage=zero, pipeline=1)) for d in (1, 2, 8)}
        ms = {d: s * 1e3 for d, (s, _) in runs.items()}
        events = "/".join(str(runs[d][1]) for d in (1, 2, 8))
        print(f"{name:<10} {ms[1]:8.1f} {ms[2]:8.1f} {ms[8]:8.1f} {events:>18} {ms[8] / ms[1]:8.1f}x "
              f"{ms[8] / ms[2]:8.1f}x")


if __name__ == "__main__":
    main()
