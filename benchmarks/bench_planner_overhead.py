"""A fixed set of planner runs, to time one checkout against another (whole process):

    PYTHONPATH=. python benchmarks/bench_planner_overhead.py mpress

``mpress``: GPT on the DGX-1 (1F1B, pipeline x8) at 150-400 layers, MPress's existence
check then its plan. ``tsplit``: TSPLIT on GPT (FSDP x8 and ZeRO-2 x8: one stage holds
every layer) and on BERT on the A100 server (PipeDream, pipeline x8). ``bert``: TSPLIT,
host swap and MPress on that BERT job at 100-360 layers (``best``'s slow cases).
"""

from __future__ import annotations

import sys

from mpsim.planners.registry import plan_fits, plan_job
from mpsim.plans.job import JobSpec
from mpsim.plans.layouts import candidate_layouts, on_layout
from mpsim.studies.capacity import family_job, family_traces

_Case = tuple[str, str, str, int, str, tuple[int, ...], tuple[str, ...]]
CASES: dict[str, list[_Case]] = {
    "mpress": [("gpt", "dgx1-v100", "1f1b", 2, "pp8", (150, 250, 290, 305, 320, 400), ("mpress",))],
    "tsplit": [("gpt", "dgx1-v100", "1f1b", 2, layout, (60, 90, 120, 200), ("tsplit",))
               for layout in ("fsdp8", "zero2x8")]
    + [("bert", "a100-40gb-nvswitch", "pipedream", 12, "pp8", (100, 200, 360), ("tsplit",))],
    "bert": [("bert", "a100-40gb-nvswitch", "pipedream", 12, "pp8", (100, 200, 360),
              ("tsplit", "host-swap", "mpress"))],
}


def on(family: str, server: str, schedule: str, microbatch: int, layout: str) -> tuple[JobSpec, list]:
    """The family's job at its first size on ``layout`` (16 microbatches), and its traces."""
    traces = family_traces(family)
    job = family_job(server, traces, schedule, microbatch, 16, "none", "compute")
    p = next(iter(candidate_layouts(job.topology, layout, job.schedule, job.trace)))
    return on_layout(job, p, 16), traces


def main(which: str) -> None:
    for family, server, schedule, mb, layout, layer_counts, strategies in CASES[which]:
        job, traces = on(family, server, schedule, mb, layout)
        for n in layer_counts:
            sized = job.but(trace=traces[-1].with_layers(n).rescale(mb))
            for strategy in strategies:
                plan_fits(sized.but(strategy=strategy))
                plan_job(sized.but(strategy=strategy))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mpress")
