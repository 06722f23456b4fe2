"""Parallel layouts by name, and the set of layouts the studies search.

A layout is a ``Parallelism`` (``mpsim.plans.job``): data-parallel replicas (DDP, or ZeRO stage
1, 2 or 3, which PyTorch runs as FSDP) of a pipeline whose stages may each be a
tensor-parallel group. Names, as ``--layouts`` takes them (parts joined by ``x``, data
parallel first, then tensor, then pipeline: Megatron-LM's order read outward):

- ``pp8``: a pipeline of 8 stages, no data parallelism; ``pp4v2``: interleaved 1F1B with
  2 virtual stages per GPU;
- ``ddp8``, ``zero1x8``, ``zero2x4``, ``fsdp8`` (= ``zero3x8``): that many replicas of one
  stage each;
- ``ddp2xpp4``, ``zero1x2xpp4``, ``fsdp2xpp4``: 2 replicas of a pipeline of 4;
- ``tp8``, ``tp4spxpp2`` (sequence parallel), ``zero1x2xtp2spxpp2``, ``fsdp2xtp4``:
  tensor-parallel groups of that many GPUs per stage.

Outputs name a layout as ``Parallelism.describe`` does (``pipeline x8``, ``FSDP x8``,
``ZeRO-2 x4 x pipeline x2``, ``TP x4+SP x pipeline x2``); ``short_name`` gives the name back.

A job's ``microbatches`` are those each replica (pipeline) runs per iteration, as
Megatron-LM counts them (``--microbatches`` everywhere). The studies that compare layouts
(``choose``, ``fits``, ``sweep``) hold the global batch fixed instead: their count is
``global_microbatches`` (``--global-microbatches``), per iteration over all replicas, so a
layout of ``dp`` replicas runs ``ceil(N / dp)`` microbatches per replica, and at least one
per stage where the schedule needs it (1f1b, pipedream): ``microbatches_per_replica``.
"""

from __future__ import annotations

import math

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.context_parallel import check_context_parallel
from mpsim.models.expert_parallel import moe_experts
from mpsim.models.tensor_parallel import check_shardable
from mpsim.models.trace import Trace
from mpsim.plans import mesh
from mpsim.plans.job import DP_NAMES, JobSpec, Parallelism, data_parallel
from mpsim.plans.schedule import MAX_MICROBATCHES, check_schedule, min_microbatches

LAYOUT_FORMS = mesh.layout_forms()
LONG_CONTEXT_TOKENS = 16384
"""From this sequence length on, ``all`` and ``3d`` also search context-parallel layouts."""
FILTERS: dict[str, str] = {
    "all": "every data-parallel degree x pipeline depth that uses all GPUs, ZeRO 0 to 3 where replicated",
    "pipeline": "one pipeline over all GPUs (pp8 on 8 GPUs)",
    "data": "one replica per GPU, DDP and ZeRO 1 to 3 (ddp8, zero1x8, zero2x8, fsdp8 on 8 GPUs); from "
            f"{LONG_CONTEXT_TOKENS:,} tokens also context-parallel groups over them (ddp4xcp2, fsdp1xcp8)",
    "hybrid": "replicas of a pipeline of 2 or more stages (ddp2xpp4, ...), ZeRO 0 to 3",
    "3d": "tensor-parallel groups of 2 to 8 GPUs (sequence parallel) times a pipeline and DDP, ZeRO-1 or FSDP "
          "replicas, every degree that uses all GPUs and the model's heads divide",
    "expert": "a mixture of experts: expert-parallel groups of every size that divides the experts and the GPUs, "
              "times a pipeline and DDP or ZeRO-1 replicas (data and all include those without a pipeline)",
    "context": "context-parallel groups of every size that divides the GPUs and splits the sequence (ring "
               "attention), times tensor parallelism of 1 to 8 and DDP, ZeRO-1 or FSDP over data x context; "
               f"all and 3d include them for sequences of {LONG_CONTEXT_TOKENS:,} tokens or more",
}
"""Words ``--layouts`` takes beside names, each the layouts of one kind on a server."""
DEFAULT_LAYOUTS = "pipeline,data"
"""What ``fits`` searches unless told: the pipeline and the pure data-parallel layouts, 5 on
any server (``all`` is 25 on 8 GPUs, 38 on 16)."""
CHOOSE_LAYOUTS = "pipeline,data,3d"
"""What ``choose`` searches unless told: those and the 3-D layouts (``_3d_layouts``, 12 on 8
GPUs for a model whose heads divide by 8), so each server is ranked by its best layout."""
LAYOUTS_HELP = ("comma-separated layouts: names " + LAYOUT_FORMS + "; or all, pipeline, data (one replica per "
                "GPU, DDP and ZeRO-1/2/3), hybrid (replicas of a pipeline), 3d (tensor-parallel stages times "
                f"pipeline and replicas; from {LONG_CONTEXT_TOKENS:,} tokens also context-parallel groups), expert (a "
                "mixture of "
                "experts' expert-parallel groups), context (context-parallel groups at any sequence length). "
                "Every layout runs the same global batch, "
                "--global-microbatches N: a layout of dp replicas runs ceil(N/dp) per replica, at least one per "
                "stage for 1f1b")

def parse_layout(text: str) -> Parallelism:
    """A layout from its name (``mpsim.plans.mesh.parse_layout``, the one grammar)."""
    return mesh.parse_layout(text)


def short_name(p: Parallelism, n_stages: int) -> str:
    """The name ``parse_layout`` reads back (``mpsim.plans.mesh.layout_name``)."""
    return mesh.layout_name(p, n_stages)


def _all_layouts(n_gpus: int) -> list[Parallelism]:
    """Every divisor ``dp`` of ``n_gpus`` with a pipeline of ``n_gpus / dp``: the pipeline
    first, then by more replicas, ZeRO 0 to 3 each; then the 3-D layouts (``_3d_layouts``)."""
    out = [data_parallel(1, 0, n_gpus)]
    for dp in range(2, n_gpus + 1):
        if n_gpus % dp == 0:
            out += [data_parallel(dp, zero, n_gpus // dp) for zero in DP_NAMES]
    return out + _3d_layouts(n_gpus)


TENSOR_DEGREES = (2, 4, 8)
"""Tensor-parallel degrees the ``3d`` word searches: inside one server, as Megatron-LM keeps them."""
_3D_ZERO = (0, 1, 3)
"""Replicas of a 3-D layout: DDP, ZeRO-1 (Megatron-LM's distributed optimizer) or FSDP."""


def _3d_layouts(n_gpus: int) -> list[Parallelism]:
    """Tensor-parallel groups of t in ``TENSOR_DEGREES`` with sequence parallelism, times
    every split of the other n/t GPUs into dp replicas of a pipeline: by t, then by more
    replicas, ZeRO as in ``_3D_ZERO``."""
    out = []
    for t in (t for t in TENSOR_DEGREES if n_gpus % t == 0):
        rest = n_gpus // t
        for dp in (d for d in range(1, rest + 1) if rest % d == 0):
            for zero in (_3D_ZERO if dp > 1 else (0,)):
                out.append(data_parallel(dp, zero, rest // dp, tensor=t, sequence_parallel=True))
    return out


def _expert_layouts(n_gpus: int, experts: int) -> list[Parallelism]:
    """Expert-parallel groups of e >= 2 GPUs (e dividing the experts and the GPUs), times a
    pipeline of every depth the rest divides into and DDP or ZeRO-1 over the replicas
    left: by e, then by depth."""
    out = []
    for e in (e for e in range(2, n_gpus + 1) if n_gpus % e == 0 and experts % e == 0):
        rest = n_gpus // e
        for depth in (d for d in range(1, rest + 1) if rest % d == 0):
            dp = rest // depth
            out += [data_parallel(dp, zero, depth, axes=(("expert", e),)) for zero in (0, 1)]
    return out


def _context_layouts(n_gpus: int, trace: Trace) -> list[Parallelism]:
    """Context-parallel groups of c >= 2 GPUs (c dividing the GPUs, the sequence splitting
    into 2c chunks) times tensor-parallel groups of t in 1 and ``TENSOR_DEGREES`` (sequence
    parallel), the rest data parallel over data x context (DDP, ZeRO-1, FSDP: what
    Megatron-Core and torchtitan shard over), one stage: by c, then t, then ZeRO."""
    out = []
    for c in (c for c in range(2, n_gpus + 1) if n_gpus % c == 0):
        for t in (t for t in (1, *TENSOR_DEGREES) if (n_gpus // c) % t == 0):
            p = data_parallel(n_gpus // (c * t), 0, 1, tensor=t, sequence_parallel=t > 1, axes=(("context", c),))
            if _splits(trace, p):
                out += [p.model_copy(update={"zero_stage": zero}) for zero in _3D_ZERO]
    return out


def _of_kind(word: str, layouts: list[Parallelism]) -> list[Parallelism]:
    pp = {"pipeline": lambda p: p.data == 1 and p.tensor == 1 and not p.axes,
          "data": lambda p: p.replicas > 1 and p.pipeline == 1 and p.tensor == 1,
          "hybrid": lambda p: p.data > 1 and (p.pipeline or 1) > 1 and p.tensor == 1 and not p.axes,
          "3d": lambda p: p.tensor > 1 or p.context > 1, "expert": lambda p: p.expert > 1,
          "context": lambda p: p.context > 1, "all": lambda p: True}[word]
    return [p for p in layouts if pp(p)]


def candidate_layouts(topo: Topology, which: str = "all", schedule: str | None = None,
                      trace: Trace | None = None) -> list[Parallelism]:
    """The layouts to search on ``topo``: ``which`` is a comma list of words (``FILTERS``)
    and names (``parse_layout``), in that order without repeats. Named layouts that need
    more GPUs than ``topo`` has are left out; a word gives no data or tensor parallelism
    under ``pipedream``, which the engine does not run with either, and no tensor
    parallelism that ``trace`` (when given) cannot split; a mixture of experts also gets its
    expert-parallel layouts (``_expert_layouts``: the ``expert`` word, and under ``data`` and
    ``all`` those without a pipeline). Refused in one line when nothing is left."""
    every = _all_layouts(topo.n_gpus)
    experts = moe_experts(trace) if trace is not None else 0
    if experts:  # a mixture of experts: its expert-parallel layouts too (data: those without a pipeline)
        every += _expert_layouts(topo.n_gpus, experts)
    asked = {x.strip() for x in which.split(",")}
    if trace is not None and ("context" in asked or (trace.seq_len or 0) >= LONG_CONTEXT_TOKENS):
        every += _context_layouts(topo.n_gpus, trace)
    chosen: list[Parallelism] = []
    why = [f"no layout fits the {topo.n_gpus} GPU(s) of {topo.name}"]
    for item in (x.strip() for x in which.split(",")):
        if item in FILTERS:
            found = _of_kind(item, every)
            for reason, keep in (("pipedream runs no data, expert or tensor parallelism",
                                  lambda p: schedule != "pipedream" or (p.replicas == 1 and p.tensor == 1)),
                                 (f"{trace.name if trace else ''} does not split over some tensor-parallel degrees",
                                  lambda p: trace is None or _splits(trace, p))):
                kept = [p for p in found if keep(p)]
                if len(kept) < len(found):
                    why.append(reason)
                found = kept
            chosen += found
        elif not item:
            raise MpsimError(f"--layouts: expected a comma-separated list without empty items, got {which!r}")
        else:
            p = parse_layout(item)
            if p.stage_gpus * (p.pipeline or 1) <= topo.n_gpus:
                chosen.append(p)
    chosen = list(dict.fromkeys(chosen))
    if not chosen:
        raise MpsimError(f"--layouts {which}: {'; '.join(dict.fromkeys(why))}")
    return chosen


def _splits(trace: Trace, p: Parallelism) -> bool:
    try:
        check_shardable(trace, p.tensor, p.sequence_parallel)
        check_context_parallel(trace, p.context, p.context_attention, p.tensor)
    except MpsimError:
        return False
    return True


def check_global_microbatches(global_microbatches: int) -> None:
    """The one check of a global microbatch count (``--global-microbatches``): from 1 to
    ``MAX_MICROBATCHES``, as a replica's count is (a pipeline of one replica runs them all)."""
    if isinstance(global_microbatches, bool) or not isinstance(global_microbatches, int):
        raise MpsimError(f"global_microbatches is the count per iteration over all replicas, got "
                         f"{global_microbatches!r}; the sizes go in microbatch_sizes")
    if not 1 <= global_microbatches <= MAX_MICROBATCHES:
        raise MpsimError(f"--global-microbatches must be from 1 to {MAX_MICROBATCHES} per iteration, got "
                         f"{global_microbatches}")


def microbatches_per_replica(global_microbatches: int, p: Parallelism, n_stages: int, schedule: str) -> int:
    """The global batch held fixed: ``global_microbatches`` per iteration over all replicas
    is ``ceil(global_microbatches / replicas)`` per replica, and at least one per stage for
    1f1b and pipedream (their pipelines need it). The count and schedule are checked first."""
    check_global_microbatches(global_microbatches)
    check_schedule(schedule, 1, 1)
    return max(math.ceil(global_microbatches / p.sample_ways), min_microbatches(schedule, n_stages))


def on_layout(job: JobSpec, p: Parallelism, global_microbatches: int) -> JobSpec:
    """``job`` run as layout ``p`` at ``global_microbatches`` per iteration over all replicas
    (``microbatches_per_replica``: the job's own count is per replica); checked again."""
    n_stages = p.stages_on(job.topology)
    per_replica = microbatches_per_replica(global_microbatches, p, n_stages, job.schedule)
    return job.but(parallelism=p, microbatches=per_replica)
