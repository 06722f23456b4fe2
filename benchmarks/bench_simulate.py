"""Simulator speed: wall time per simulated iteration and events per second, next to raw
SimPy's own event rate measured in the same run.

    python benchmarks/bench_simulate.py [--repeat 20]

Job: GPT-25.5B, 1f1b, microbatch 2, 16 microbatches on dgx1-v100 (target: at most 50 ms
per simulated iteration on a 2-core machine). ``--plan swap-recompute`` runs it under a
plan that, on every stage, swaps the first transformer layer (the longest-lived
activations) to host memory and recomputes the others; ``--plan swap-heavy`` swaps every
other transformer layer and recomputes the rest, the busiest case for the engine (a
swap-out, a swap-in and a cut piece per swapped layer and microbatch).

The engine is the one ``MPSIM_ENGINE`` picks (``mpsim engine --help``): run it with
``MPSIM_ENGINE=python`` and, after ``mpsim engine build``, ``MPSIM_ENGINE=compiled``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import simpy

from mpsim import load_topology, load_trace, native
from mpsim.plans.job import JobSpec
from mpsim.plans.partition import compute_balanced
from mpsim.plans.plan import LayerAction, make_plan
from mpsim.plans.schedule import PIPEDREAM_ITERATIONS
from mpsim.sim import Job, simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.timing.costs import cost_model


def raw_simpy_rate(n_events: int = 200_000, n_procs: int = 16) -> float:
    """Events per second of bare SimPy: processes that only yield timeouts."""
    env = simpy.Environment()
    per_proc = n_events // n_procs

    def proc(env: simpy.Environment, k: int):  # type: ignore[no-untyped-def]
        for _ in range(per_proc):
            yield env.timeout(1.0 + k * 1e-3)

    for k in range(n_procs):
        env.process(proc(env, k))
    start = time.perf_counter()
    env.run()
    elapsed = time.perf_counter() - start
    return n_procs * per_proc / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--server", default="dgx1-v100")
    ap.add_argument("--model", default="gpt-25.5b")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--plan", choices=["keep", "swap-recompute", "swap-heavy"], default="keep")
    args = ap.parse_args()

    topo = load_topology(args.server)
    trace = load_trace(args.model).rescale(args.microbatch)
    job = Job(JobSpec(topo, trace, args.schedule, args.microbatches))
    if args.plan != "keep":
        times = cost_model(trace, topo.spec.gpu).layer_times
        stages = compute_balanced(times.fwd_s + times.bwd_s, topo.n_gpus)
        every = 2 if args.plan == "swap-heavy" else 10**9
        actions = {s: [LayerAction(layer=j, action="host" if k % every == 0 else "recompute")
                       for k, j in enumerate(j for j in range(a, b) if trace.layers[j].kind == "transformer")]
                   for s, (a, b) in enumerate(stages)}
        plan = make_plan(trace, topo, args.schedule, args.microbatches, list(stages), list(range(topo.n_gpus)),
                         args.plan, actions)
        job = job_of_plan(topo, trace, plan)
    simulate_job(job)  # warm caches and imports
    walls, events = [], 0
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = simulate_job(job)
        walls.append(time.perf_counter() - start)
        events = result.sim_events
    wall = statistics.median(walls)
    iterations = PIPEDREAM_ITERATIONS if args.schedule == "pipedream" else 1
    raw = raw_simpy_rate()
    print(f"machine            {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"simpy {simpy.__version__}")
    print(f"engine             {native.state().describe()}")
    print(f"job                {args.model} {args.schedule} microbatch {args.microbatch} x {args.microbatches} "
          f"on {args.server}, {len(result.stages)} stages, plan {args.plan}")
    print(f"wall per run       {wall * 1e3:.1f} ms (median of {args.repeat}; min {min(walls) * 1e3:.1f} ms), "
          f"{iterations} iteration(s) simulated per run")
    print(f"wall per iteration {wall / iterations * 1e3:.1f} ms")
    print(f"simpy events       {events} per run")
    print(f"event rate         {events / wall:,.0f} events/s inside mpsim (whole run: setup, engine, analysis)")
    print(f"raw simpy rate     {raw:,.0f} events/s (timeouts only, same process)")
    print(f"ratio              {events / wall / raw:.2f} of raw SimPy")
    print(f"target             {'met' if wall / iterations <= 0.050 else 'MISSED'}: <= 50 ms per simulated iteration")


if __name__ == "__main__":
    main()
