"""The two-tier search against simulating every candidate: the same answers, and how
many candidates the closed-form tier (``mpsim.studies.bounds``) decided.

    python benchmarks/bench_floors.py > reports/bench_floors.txt

Each study runs twice in fresh processes, one process at a time (no planner cache
carried over): with the floors and existence-first probes (the default) and inside
``bounds.without_floors()`` (every candidate simulated whole). Studies: the README's
``fits`` (GPT on the DGX-1, 1f1b, microbatch 2, the default layouts, in one process)
and ``choose --model llama-3-8b`` over every shipped server. Wall seconds are for the
machine as it was; the ratio is the same-run comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

STUDIES = ("fits", "choose")


def _fits() -> dict:
    from mpsim.studies.capacity import family_job, family_traces, fits_layouts

    traces = family_traces("gpt")
    job = family_job("dgx1-v100", traces, "1f1b", 2, 16, "none", "compute")
    reports = fits_layouts(job, "gpt", traces, ("none", "recompute", "cpu-swap", "d2d", "mpress", "tsplit", "best"),
                           "pipeline,data", 16)
    answer = [[(r.model, r.result.fits, r.result.samples_per_s, r.result.max_peak_bytes) for r in rep.rows]
              + [None if rep.largest is None else (rep.largest.layers, rep.largest.result.samples_per_s),
                 rep.not_above]
              for lf in reports for rep in lf.reports]
    probes = [(rep.probes_simulated, rep.probes_decided) for lf in reports for rep in lf.reports]
    return {"answer": answer, "simulated": sum(p[0] for p in probes), "decided": sum(p[1] for p in probes)}


def _choose() -> dict:
    from mpsim.studies.choose import choose

    report = choose("llama-3-8b", "all")
    answer = [(r.server, r.rank, r.result.strategy, r.result.layout, r.result.fits, r.result.samples_per_s,
               r.result.max_peak_bytes, None if r.faster_at_risk is None else r.faster_at_risk.samples_per_s)
              for r in report.rows]
    return {"answer": answer, "simulated": sum(len(r.tried) for r in report.rows),
            "decided": sum(r.decided_by_floors for r in report.rows)}


def _one(study: str, floors: bool) -> None:
    """In a child: run one study and print its answer, counts and wall seconds as JSON."""
    from mpsim.studies import bounds

    run = {"fits": _fits, "choose": _choose}[study]
    start = time.perf_counter()
    if floors:
        out = run()
    else:
        with bounds.without_floors():
            out = run()
    out["wall_s"] = time.perf_counter() - start
    print(json.dumps(out))


def _child(study: str, floors: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", study, "1" if floors else "0"], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    print(f"{'study':8s} {'same answer':>11s} {'wall, floors':>12s} {'wall, every':>11s} {'ratio':>6s}  candidates")
    for study in STUDIES:
        tiered, every = _child(study, True), _child(study, False)
        same = tiered["answer"] == every["answer"]
        ratio = tiered["wall_s"] / every["wall_s"]
        what = "probes" if study == "fits" else "plans"
        print(f"{study:8s} {'yes' if same else 'NO':>11s} {tiered['wall_s']:11.1f}s {every['wall_s']:10.1f}s "
              f"{ratio:6.2f}  {what}: {tiered['decided']} decided by the floors, {tiered['simulated']} simulated "
              f"(every: {every['simulated']} simulated)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _one(sys.argv[2], sys.argv[3] == "1")
    else:
        main()
