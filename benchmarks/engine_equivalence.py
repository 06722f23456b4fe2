"""Engine equivalence: the same jobs simulated by this checkout and by a baseline checkout
(another worktree of the commit an engine change started from) must give the same
answers, bit for bit.

    git worktree add /tmp/engine_base <start-commit>
    python benchmarks/engine_equivalence.py --base /tmp/engine_base [--quick]
    python benchmarks/engine_equivalence.py --native [--quick]   # Python engine vs compiled

With ``--native`` the two sides are this checkout's Python engine and its compiled one
(``mpsim engine build``), which must also schedule the same number of events per job.

Each side runs in its own process (``PYTHONPATH`` set to its checkout) and prints one
digest line per job: the plan's iteration time and samples/s, each GPU's peak, reserved
and breakdown at the peak, its memory-over-time series, costs and compute time, the first
out-of-memory point, every span, the host's peak and each link's bytes and busy time.
The jobs cover every strategy (none, recompute, selective, cpu-swap, host-swap, d2d,
mpress, tsplit, zero-offload, best), the layouts (pipeline, interleaved, DDP, ZeRO,
FSDP, hybrid, tensor and sequence parallel) and the schedules (1f1b, gpipe, pipedream),
plus ``bench_simulate``'s swap-heavy and swap-recompute plans with link rates recorded.
Differences are printed per job and field, then how many jobs differ and the largest
relative difference among them of the iteration time and of any GPU's peak memory; the
exit status is 1 when there are any.
``SimResult.sim_events`` (the work the engine did) is reported, not compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STRATEGIES = ("none", "recompute", "selective", "cpu-swap", "host-swap", "d2d", "mpress", "tsplit", "zero-offload",
              "best")
PIPELINE_SETTINGS = (("dgx1-v100", "gpt", "1f1b"), ("dgx1-v100", "bert", "gpipe"), ("dgx1-v100", "gpt", "pipedream"),
                     ("titanrtx-x4-pcie", "gpt", "gpipe"), ("a100-40gb-nvswitch", "gpt", "1f1b"))
"""(server, family, schedule) run as one pipeline under every strategy."""
LAYOUT_JOBS = (("dgx1-v100", "gpt", "1f1b", "pp4v2", ("none", "host-swap")),
               ("dgx1-v100", "gpt", "1f1b", "fsdp8", ("none", "zero-offload")),
               ("dgx1-v100", "gpt", "1f1b", "ddp8", ("none",)),
               ("dgx1-v100", "gpt", "gpipe", "zero2x4", ("none", "recompute")),
               ("dgx1-v100", "gpt", "1f1b", "ddp2xpp4", ("none", "d2d", "mpress")),
               ("dgx1-v100", "gpt", "1f1b", "fsdp2xpp4", ("none", "host-swap")),
               ("dgx-h100", "gpt", "1f1b", "tp4spxpp2", ("none", "recompute", "host-swap")),
               ("dgx-h100", "gpt", "gpipe", "tp8", ("none",)),
               ("dgx-h100", "llama", "1f1b", "zero1x2xtp2spxpp2", ("none", "selective")),
               ("a100-40gb-nvswitch", "bert", "1f1b", "zero2x8", ("none", "zero-offload")))
"""(server, family, schedule, layout, strategies) for the other layouts."""
QUICK_STRATEGIES = ("none", "recompute", "host-swap", "cpu-swap", "d2d", "mpress", "tsplit")


def _job_specs(quick: bool) -> Iterator[tuple[str, Any]]:
    """(name, JobSpec) of every job compared; ``quick`` leaves out ``best`` and the
    larger sizes."""
    from mpsim.errors import MpsimError
    from mpsim.plans.layouts import on_layout, parse_layout
    from mpsim.studies.capacity import family_job, family_traces

    strategies = QUICK_STRATEGIES if quick else STRATEGIES
    for server, family, schedule in PIPELINE_SETTINGS:
        traces = family_traces(family)
        for size in (0,) if quick else (0, len(traces) // 2):
            for strategy in strategies:
                job = family_job(server, traces[size:], schedule, 2, 16, strategy, "compute")
                yield f"{server}/{traces[size].name}/{schedule}/pipeline/{strategy}", job
    for server, family, schedule, layout, names in LAYOUT_JOBS:
        traces = family_traces(family)
        for strategy in names:
            for k in range(len(traces)):  # the smallest size whose heads split over the layout
                base = family_job(server, traces[k:], schedule, 2, 16, strategy, "compute")
                try:
                    job = on_layout(base, parse_layout(layout), 16)
                except MpsimError:
                    continue
                yield f"{server}/{traces[k].name}/{schedule}/{layout}/{strategy}", job
                break


def _bench_results() -> Iterator[tuple[str, Any]]:
    """``bench_simulate``'s swap plans, their link rates recorded."""
    from mpsim import load_topology, load_trace
    from mpsim.plans.partition import compute_balanced
    from mpsim.plans.plan import LayerAction, make_plan
    from mpsim.sim import simulate_job
    from mpsim.sim.layout import job_of_plan
    from mpsim.timing.costs import cost_model

    topo = load_topology("dgx1-v100")
    trace = load_trace("gpt-25.5b").rescale(2)
    times = cost_model(trace, topo.spec.gpu).layer_times
    stages = compute_balanced(times.fwd_s + times.bwd_s, topo.n_gpus)
    for every, name in ((2, "swap-heavy"), (10**9, "swap-recompute")):
        for schedule in ("1f1b", "gpipe"):
            actions = {s: [LayerAction(layer=j, action="host" if k % every == 0 else "recompute")
                           for k, j in enumerate(j for j in range(a, b) if trace.layers[j].kind == "transformer")]
                       for s, (a, b) in enumerate(stages)}
            plan = make_plan(trace, topo, schedule, 16, list(stages), list(range(topo.n_gpus)), name, actions)
            yield f"bench/{name}/{schedule}", simulate_job(job_of_plan(topo, trace, plan, record_link_rates=True))


def _digest_array(values: Any) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]


def digest(result: Any) -> dict[str, Any]:
    """What is compared of one ``SimResult`` (floats as ``repr``, so exactly)."""
    spans = [(s.gpu, s.lane, s.name, repr(s.start_s), repr(s.end_s)) for s in result.spans]
    return {
        "iteration_s": repr(result.iteration_s),
        "samples_per_s": repr(result.samples_per_s),
        "makespan_s": repr(result.makespan_s),
        "oom": repr(result.oom),
        "stages": repr(result.stages),
        "gpu_of_stage": repr(result.gpu_of_stage),
        "peaks": [g.peak_bytes for g in result.gpus],
        "reserved": [g.reserved_bytes for g in result.gpus],
        "breakdowns": repr([g.breakdown for g in result.gpus]),
        "saved": repr([g.saved_at_peak for g in result.gpus]),
        "costs": repr([g.costs_s for g in result.gpus]),
        "compute_s": repr([g.compute_s for g in result.gpus]),
        "memory_series": [_digest_array(g.memory_times_s) + _digest_array(g.memory_used_bytes) for g in result.gpus],
        "host_peak_bytes": result.host_peak_bytes,
        "host_series": _digest_array(result.host_memory_times_s) + _digest_array(result.host_memory_used_bytes),
        "links": repr(sorted(result.links.items())),
        "link_rates": hashlib.sha256(repr(result.link_rates).encode()).hexdigest()[:16],
        "n_spans": len(spans),
        "spans": hashlib.sha256(repr(spans).encode()).hexdigest()[:16],
    }


def run_side(quick: bool) -> None:
    """Simulate every job in this process and print one JSON line per job."""
    from mpsim.errors import MpsimError
    from mpsim.planners.registry import plan_job

    for name, job in _job_specs(quick):
        start = time.perf_counter()
        try:
            result = plan_job(job).result
        except MpsimError as exc:
            print(json.dumps({"job": name, "error": str(exc)}), flush=True)
            continue
        print(json.dumps({"job": name, "digest": digest(result), "events": result.sim_events,
                          "wall_s": time.perf_counter() - start}), flush=True)
    for name, result in _bench_results():
        print(json.dumps({"job": name, "digest": digest(result), "events": result.sim_events, "wall_s": 0.0}),
              flush=True)


def _side(checkout: Path, quick: bool, engine: str | None = None) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    if engine is not None:
        env["MPSIM_ENGINE"] = engine
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, cwd=checkout, env=env, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["job"]: row for row in rows}


def compare(base: dict[str, dict[str, Any]], mine: dict[str, dict[str, Any]]) -> list[str]:
    """One line per job and field that differs."""
    lines = []
    for job in sorted(set(base) | set(mine)):
        a, b = base.get(job), mine.get(job)
        if a is None or b is None:
            lines.append(f"{job}: only in {'this checkout' if a is None else 'the baseline'}")
        elif "error" in a or "error" in b:
            if a.get("error") != b.get("error"):
                lines.append(f"{job}: error {a.get('error')!r} vs {b.get('error')!r}")
        else:
            lines += [f"{job}: {key} {str(a['digest'][key])[:60]} vs {str(b['digest'][key])[:60]}"
                      for key in a["digest"] if a["digest"][key] != b["digest"].get(key)]
    return lines


def moved(base: dict[str, dict[str, Any]], mine: dict[str, dict[str, Any]]) -> str:
    """How far the jobs that differ moved: how many differ, and the largest relative
    difference of the iteration time and of any GPU's peak memory among them."""
    jobs = [j for j in mine if "digest" in mine[j] and "digest" in base.get(j, {})
            and base[j]["digest"] != mine[j]["digest"]]
    worst_time = worst_peak = 0.0
    for j in jobs:
        a, b = base[j]["digest"], mine[j]["digest"]
        t_a, t_b = float(a["iteration_s"]), float(b["iteration_s"])
        worst_time = max(worst_time, abs(t_b - t_a) / abs(t_a) if t_a else float(t_a != t_b))
        for p_a, p_b in zip(a["peaks"], b["peaks"], strict=True):
            worst_peak = max(worst_peak, abs(p_b - p_a) / p_a if p_a else float(p_a != p_b))
    return (f"{len(jobs)} jobs differ; largest relative difference: iteration time {worst_time:.3g}, "
            f"per-GPU peak memory {worst_peak:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="the baseline checkout (a worktree of the starting commit)")
    ap.add_argument("--quick", action="store_true", help="fewer jobs: no best, one size per setting")
    ap.add_argument("--native", action="store_true",
                    help="compare this checkout's Python engine with its compiled one (`mpsim engine build`) "
                         "instead of a baseline checkout")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        run_side(args.quick)
        return
    if (args.base is None) == (not args.native):
        ap.error("give one of --base and --native")
    here = Path(__file__).resolve().parents[1]
    if args.native:
        print("baseline: this checkout's Python engine; compared: its compiled engine")
        base, mine = _side(here, args.quick, "python"), _side(here, args.quick, "compiled")
    else:
        base, mine = _side(args.base, args.quick), _side(here, args.quick)
    diffs = compare(base, mine)
    if args.native:  # the same code compiled: the same events too, not only the same answers
        diffs += [f"{j}: events {base[j]['events']} vs {mine[j]['events']}" for j in sorted(mine)
                  if "events" in mine[j] and j in base and base[j].get("events") != mine[j]["events"]]
    compared = [j for j in mine if "digest" in mine[j]]
    for line in diffs:
        print(line)
    print(moved(base, mine))
    ev_base = sum(base[j]["events"] for j in compared if j in base and "events" in base[j])
    ev_mine = sum(mine[j]["events"] for j in compared if "events" in mine[j])
    print(f"{len(compared)} jobs compared ({len(mine) - len(compared)} refused alike), {len(diffs)} differences; "
          f"events {ev_base} -> {ev_mine}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
