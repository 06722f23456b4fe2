"""Golden results: simulate a broad set of jobs and write what each gives, so that a
change meant to make the engine or the planners faster can be checked to change nothing.

    python benchmarks/golden.py out.json [-j 2]
    python benchmarks/golden.py --compare before.json after.json

Jobs: every shipped trace of mpsim's own layers x dgx1-v100, dgx-a100-80gb, titanrtx-x4-pcie x gpipe, 1f1b,
pipedream x none, recompute, selective, cpu-swap, d2d, mpress, tsplit (traced microbatch,
8 microbatches); and data-parallel layouts (``LAYOUTS``: DDP, ZeRO-1/2, FSDP over all GPUs and
FSDP x2 x pipeline x4) x every trace x dgx1-v100, dgx-a100-80gb, dgx-h100 x 1f1b x none, recompute,
zero-offload, zero-infinity, 2 microbatches per replica. Recorded per job: iteration time,
makespan, fits, the out-of-memory point, per-GPU peak, breakdown and costs, host peak, link
bytes and busy time, and a hash of the plan the strategy made. Floats are written with ``repr`` (exact).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from mpsim.api import plan
from mpsim.errors import MpsimError
from mpsim.plans.layouts import parse_layout

_SHIPPED = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.json"))
TRACES = [p.stem for p in _SHIPPED if '"framework": "hf"' not in p.read_text()]
"""Every shipped trace of mpsim's own layers (the Hugging Face traces, the mixtures of experts
and TinyLlama, are held by tests/test_moe_trace.py, tests/test_expert_parallel.py and the
reports the README quotes)."""
SERVERS = ("dgx1-v100", "dgx-a100-80gb", "titanrtx-x4-pcie")
SCHEDULES = ("gpipe", "1f1b", "pipedream")
STRATEGIES = ("none", "recompute", "selective", "cpu-swap", "d2d", "mpress", "tsplit")


LAYOUTS = ("ddp8", "zero1x8", "zero2x8", "fsdp8", "fsdp2xpp4")
LAYOUT_SERVERS = ("dgx1-v100", "dgx-a100-80gb", "dgx-h100")
LAYOUT_STRATEGIES = ("none", "recompute", "zero-offload", "zero-infinity")


def one(job: tuple[str, ...]) -> tuple[str, dict]:
    """The recorded result of one (trace, server, schedule, strategy[, layout]) job."""
    model, server, schedule, strategy, *layout = job
    key = "|".join(job)
    try:
        if layout:
            par = parse_layout(layout[0])
            planned = plan(server, model, schedule, None, 2 * (par.pipeline or 1), n_stages=par.pipeline or 1,
                           strategy=strategy, parallelism=par)
        else:
            planned = plan(server, model, schedule, None, 8, strategy=strategy)
    except MpsimError as exc:
        return key, {"error": str(exc)}
    r = planned.result
    # the schema number and an absent data_parallel block (schema 2) say nothing of the plan
    defaults = {"virtual_stages"} if planned.plan.virtual_stages == 1 else set()  # schema 3's, at its default
    plan_json = planned.plan.model_dump_json(exclude={"schema_", "data_parallel"} | defaults, exclude_none=True)
    return key, {
        "iteration_s": repr(r.iteration_s), "makespan_s": repr(r.makespan_s), "fits": r.fits,
        "oom": json.dumps(r.oom, sort_keys=True, default=repr), "host_peak_bytes": r.host_peak_bytes,
        "simulations": planned.simulations, "plan_sha": hashlib.sha256(plan_json.encode()).hexdigest()[:16],
        "gpus": [{"peak_bytes": g.peak_bytes, "breakdown": g.breakdown, "saved": g.saved_at_peak,
                  "costs_s": {k: repr(v) for k, v in g.costs_s.items() if v}, "compute_s": repr(g.compute_s)}
                 for g in r.gpus],
        "links": {k: {"bytes": v["bytes"], "busy_s": repr(v["busy_s"])} for k, v in r.links.items()},
    }


def compare(before: dict, after: dict) -> int:
    """Print every job whose record differs; the number of those."""
    bad = 0
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            bad += 1
            print(f"DIFF {key}\n  before {before.get(key)}\n  after  {after.get(key)}")
    print(f"{len(before)} jobs before, {len(after)} after, {bad} differ")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("-j", type=int, default=2)
    ap.add_argument("--models", default=",".join(TRACES), help="comma-separated subset of the traces")
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.paths)
        sys.exit(1 if compare(before, after) else 0)
    models = args.models.split(",")
    jobs: list[tuple[str, ...]] = [(m, s, sch, st) for m in models for s in SERVERS for sch in SCHEDULES
                                   for st in STRATEGIES]
    jobs += [(m, s, "1f1b", st, lay) for m in models for s in LAYOUT_SERVERS for st in LAYOUT_STRATEGIES
             for lay in LAYOUTS]
    with ProcessPoolExecutor(args.j) as pool:
        records = dict(pool.map(one, jobs, chunksize=7))
    Path(args.paths[0]).write_text(json.dumps(records, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
