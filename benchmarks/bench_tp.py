"""What tensor parallelism and interleaving cost the simulator: one iteration of Llama-3-8B
on 8 A100s in several layouts, in-process, the best of several runs after a warm one
(the shard traced and the stage programs built before the clock starts), and the time to
trace a shard once (cold, in a fresh process's cache).

    python benchmarks/bench_tp.py > reports/bench_tp.txt

A tensor-parallel group is accounted, not simulated: TP x8 runs one GPU's stream, like one
stage; what it adds is one fused ring transfer per layer piece (``sim.tensor_group``).
Interleaving runs p x v stage streams taking turns on p GPUs.
"""

from __future__ import annotations

import time

from bench_dp import best_simulation

from mpsim.data.catalog import load_trace
from mpsim.models.tensor_parallel import shard_trace
from mpsim.plans.job import job_of
from mpsim.plans.layouts import parse_layout
from mpsim.sim import Job

SERVER, MODEL, MICROBATCHES = "dgx-a100-80gb", "llama-3-8b", 8
LAYOUTS = ("pp8", "pp8v2", "fsdp8", "tp8", "tp8sp", "tp2spxpp4", "fsdp2xtp4sp", "zero1x2xtp2spxpp2v2")
REPEATS = 5


def _best_s(name: str) -> tuple[float, int, float]:
    p = parse_layout(name)
    best_s, result = best_simulation(Job(job_of(SERVER, MODEL, microbatches=MICROBATCHES, n_stages=p.pipeline,
                                                parallelism=p)), REPEATS)
    return best_s, result.sim_events, result.iteration_s


def main() -> None:
    start = time.perf_counter()
    shard_trace(load_trace(MODEL), 8, True)
    cold_s = time.perf_counter() - start
    print(f"{MODEL} on {SERVER}, {MICROBATCHES} microbatches of 1 per replica; best of {REPEATS} runs")
    print(f"tracing one shard (t = 8, sequence parallel), cold: {cold_s * 1e3:.0f} ms")
    print(f"{'layout':<22} {'wall ms':>8} {'events':>7} {'over pp8':>9} {'iteration s':>12}")
    base = None
    for name in LAYOUTS:
        wall_s, events, iteration_s = _best_s(name)
        base = base or wall_s
        print(f"{name:<22} {wall_s * 1e3:8.1f} {events:7d} {wall_s / base:8.2f}x {iteration_s:12.3f}")


if __name__ == "__main__":
    main()
