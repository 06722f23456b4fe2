"""Digest of the planners' answers over a fixed set of jobs, to compare two checkouts:

    PYTHONPATH=A python benchmarks/planner_equivalence.py > a.txt
    PYTHONPATH=B python benchmarks/planner_equivalence.py > b.txt
    diff a.txt b.txt

One line per (job, strategy): the plan's JSON digest, the iteration time, each GPU's
peak bytes, whether it fits and how many simulations it took; and, before it is
planned, ``plan_fits``'s verdict (the existence checks). ``--quick``: fewer sizes;
``--strategies a,b``: only those.
Run each side in a fresh process (the planner cache is per process).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator

from mpsim.planners.registry import plan_fits, plan_job
from mpsim.plans.job import JobSpec
from mpsim.plans.layouts import candidate_layouts, on_layout
from mpsim.studies.capacity import family_job, family_traces

STRATEGIES = ("mpress", "tsplit", "cpu-swap", "host-swap", "d2d", "recompute", "best")


def jobs(quick: bool) -> Iterator[tuple[str, JobSpec]]:
    """(label, job) for GPT on the DGX-1 (1F1B; pipeline, FSDP and ZeRO-2 over 8 GPUs)
    and BERT on the A100 server (PipeDream, pipeline), at shipped sizes and with more layers."""
    cases = [("gpt", "dgx1-v100", "1f1b", 2, layout, (200, 300) if quick else (150, 200, 300, 420))
             for layout in ("pp8", "fsdp8", "zero2x8")]
    cases.append(("bert", "a100-40gb-nvswitch", "pipedream", 12, "pp8",
                  (100, 200) if quick else (100, 160, 240, 360)))
    for family, server, schedule, mb, layout, counts in cases:
        traces = family_traces(family)
        base = family_job(server, traces, schedule, mb, 16, "none", "compute")
        p = next(iter(candidate_layouts(base.topology, layout, base.schedule, base.trace)))
        on = on_layout(base, p, 16)
        shipped = traces[-2:] if quick else traces
        sized = [(t.name, t.rescale(mb)) for t in shipped]
        sized += [(f"{traces[-1].name}x{n}", traces[-1].with_layers(n).rescale(mb)) for n in counts]
        for name, trace in sized:
            yield f"{family} {server} {schedule} {layout} {name}", on.but(trace=trace)


def digest(job: JobSpec) -> str:
    planned = plan_job(job)
    r = planned.result
    plan_sha = hashlib.sha256(planned.plan.model_dump_json().encode()).hexdigest()[:16]
    peaks = ",".join(str(g.peak_bytes) for g in r.gpus)
    return f"plan={plan_sha} it={r.iteration_s!r} fits={r.fits} sims={planned.simulations} peaks={peaks}"


def main() -> None:
    quick = "--quick" in sys.argv
    strategies = sys.argv[sys.argv.index("--strategies") + 1].split(",") if "--strategies" in sys.argv else STRATEGIES
    for label, job in jobs(quick):
        for strategy in strategies:
            j = job.but(strategy=strategy)
            verdict = plan_fits(j)
            print(f"{label} {strategy}: exists={verdict} {digest(j)}", flush=True)


if __name__ == "__main__":
    main()
