"""Parallel layouts by name, and the set of layouts the studies search.

A layout is a ``Parallelism`` (``mpsim.job``): data-parallel replicas (DDP, or ZeRO stage
1, 2 or 3, which PyTorch runs as FSDP) of a pipeline. Names, as ``--layouts`` takes them:

- ``pp8``: a pipeline of 8 stages, no data parallelism;
- ``ddp8``, ``zero1x8``, ``zero2x4``, ``fsdp8`` (= ``zero3x8``): that many replicas of one
  stage each;
- ``ddp2xpp4``, ``zero1x2xpp4``, ``fsdp2xpp4``: 2 replicas of a pipeline of 4.

Outputs name a layout as ``Parallelism.describe`` does (``pipeline x8``, ``FSDP x8``,
``ZeRO-2 x4 x pipeline x2``); ``short_name`` gives the name back.

The studies (``choose``, ``fits``, ``sweep``) hold the global batch fixed across layouts:
their microbatch count is per iteration over all replicas, so a layout of ``dp`` replicas
runs ``ceil(M / dp)`` microbatches per replica, and at least one per stage where the
schedule needs it (1f1b, pipedream): ``microbatches_per_replica``.
"""

from __future__ import annotations

import math
import re

from mpsim.errors import MpsimError
from mpsim.job import DP_NAMES, JobSpec, Parallelism, data_parallel
from mpsim.schedule import check_schedule, min_microbatches
from mpsim.topology import Topology

LAYOUT_FORMS = ("pp8 (pipeline of 8), ddp8, zero1x8, zero2x4, fsdp8 (= zero3x8), or replicas of a pipeline: "
                "ddp2xpp4, fsdp2xpp4")
FILTERS: dict[str, str] = {
    "all": "every data-parallel degree x pipeline depth that uses all GPUs, ZeRO 0 to 3 where replicated",
    "pipeline": "one pipeline over all GPUs (pp8 on 8 GPUs)",
    "data": "one replica per GPU, DDP and ZeRO 1 to 3 (ddp8, zero1x8, zero2x8, fsdp8 on 8 GPUs)",
    "hybrid": "replicas of a pipeline of 2 or more stages (ddp2xpp4, ...), ZeRO 0 to 3",
}
"""Words ``--layouts`` takes beside names, each the layouts of one kind on a server."""
DEFAULT_LAYOUTS = "pipeline,data"
"""What ``choose`` and ``fits`` search unless told: the pipeline and the pure data-parallel
layouts, 5 on any server (``all`` is 13 on 8 GPUs, 17 on 16)."""
LAYOUTS_HELP = ("comma-separated layouts: names " + LAYOUT_FORMS + "; or all, pipeline, data (one replica per "
                "GPU, DDP and ZeRO-1/2/3), hybrid (replicas of a pipeline). --microbatches counts the whole "
                "iteration over all replicas: a layout of dp replicas runs ceil(M/dp) per replica, at least "
                "one per stage for 1f1b")

_DATA_NAME = re.compile(r"(ddp|fsdp|zero([0-3])x)(\d+)")
_PIPE_NAME = re.compile(r"pp(\d+)")


def parse_layout(text: str) -> Parallelism:
    """A layout from its name (``pp8``, ``fsdp8``, ``zero2x4``, ``ddp2xpp4``); one-line
    ``MpsimError`` naming the forms for anything else."""
    name = text.strip().lower()
    data_part, sep, pipe_part = name.partition("xpp")
    if not sep and name.startswith("pp"):
        data_part, pipe_part = "", name[2:]
    data = _DATA_NAME.fullmatch(data_part) if data_part else None
    pipe = pipe_part if (sep or not data_part) else "1"
    if (data_part and data is None) or (sep and not data_part) or not pipe.isdigit():
        raise MpsimError(f"unknown layout {text!r}: expected {LAYOUT_FORMS}")
    try:
        if data is None:
            return data_parallel(1, 0, int(pipe))
        return data_parallel(int(data[3]), 3 if data[1] == "fsdp" else int(data[2] or 0), int(pipe))
    except MpsimError as exc:
        raise MpsimError(f"layout {text!r}: {exc}") from None


def short_name(p: Parallelism, n_stages: int) -> str:
    """The name ``parse_layout`` reads back: ``pp8``, ``fsdp8``, ``zero2x4xpp2``."""
    if p.data == 1 and p.zero_stage == 0:
        return f"pp{n_stages}"
    kind = {0: "ddp", 3: "fsdp"}.get(p.zero_stage, f"zero{p.zero_stage}x")
    return f"{kind}{p.data}" + (f"xpp{n_stages}" if n_stages > 1 else "")


def _all_layouts(n_gpus: int) -> list[Parallelism]:
    """Every divisor ``dp`` of ``n_gpus`` with a pipeline of ``n_gpus / dp``: the pipeline
    first, then by more replicas, ZeRO 0 to 3 each."""
    out = [data_parallel(1, 0, n_gpus)]
    for dp in range(2, n_gpus + 1):
        if n_gpus % dp == 0:
            out += [data_parallel(dp, zero, n_gpus // dp) for zero in DP_NAMES]
    return out


def _of_kind(word: str, layouts: list[Parallelism]) -> list[Parallelism]:
    pp = {"pipeline": lambda p: p.data == 1, "data": lambda p: p.data > 1 and p.pipeline == 1,
          "hybrid": lambda p: p.data > 1 and (p.pipeline or 1) > 1, "all": lambda p: True}[word]
    return [p for p in layouts if pp(p)]


def candidate_layouts(topo: Topology, which: str = "all", schedule: str | None = None) -> list[Parallelism]:
    """The layouts to search on ``topo``: ``which`` is a comma list of words (``FILTERS``)
    and names (``parse_layout``), in that order without repeats. Named layouts that need
    more GPUs than ``topo`` has are left out; a word gives no data parallelism under
    ``pipedream``, which the engine does not run with replicas. Refused in one line when
    nothing is left."""
    every = _all_layouts(topo.n_gpus)
    chosen: list[Parallelism] = []
    for item in (x.strip() for x in which.split(",")):
        if item in FILTERS:
            found = _of_kind(item, every)
            chosen += [p for p in found if schedule != "pipedream" or p.data == 1]
        elif not item:
            raise MpsimError(f"--layouts: expected a comma-separated list without empty items, got {which!r}")
        else:
            p = parse_layout(item)
            if p.data * (p.pipeline or 1) <= topo.n_gpus:
                chosen.append(p)
    chosen = list(dict.fromkeys(chosen))
    if not chosen:
        raise MpsimError(f"--layouts {which}: no layout fits the {topo.n_gpus} GPU(s) of {topo.name}")
    return chosen


def microbatches_per_replica(microbatches: int, p: Parallelism, n_stages: int, schedule: str) -> int:
    """The global batch held fixed: ``microbatches`` per iteration over all replicas is
    ``ceil(microbatches / data)`` per replica, and at least one per stage for 1f1b and
    pipedream (their pipelines need it). The count itself is checked first."""
    check_schedule(schedule, 1, microbatches)
    return max(math.ceil(microbatches / p.data), min_microbatches(schedule, n_stages))


def on_layout(job: JobSpec, p: Parallelism, microbatches: int) -> JobSpec:
    """``job`` run as layout ``p``, its ``microbatches`` per iteration over all replicas
    (``microbatches_per_replica``); checked again."""
    n_stages = p.stages_on(job.topology)
    return job.but(parallelism=p, microbatches=microbatches_per_replica(microbatches, p, n_stages, job.schedule))
