"""What the engine simulates: a job, and the one resolved layout the engine takes as input.

A ``Job`` is what a caller asks for (a server, a trace, and a plan or the fields that make
a keep-everything one). ``resolve`` checks it once (partition, stage-to-GPU map, schedule,
plan rules) and returns a ``Layout``: stages, GPUs, actions, optimizer and stash
placement, already valid. Planners that make plans with ``mpsim.plan.make_plan`` build
layouts with ``layout_of_plan(..., checked=True)`` and skip the checks, so a search that
simulates thousands of plans does not re-validate each one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from mpsim.errors import MpsimError
from mpsim.partition import Stages, compute_balanced, validate_stages
from mpsim.plan import Checkpoints, LayerAction, PlanFile, SwapTiming, check_plan, host_optimizer_layers
from mpsim.schedule import check_schedule
from mpsim.topology import Topology
from mpsim.trace import Trace

Runtime = Literal["mpress", "torch-pipelining"]


@dataclass(frozen=True)
class Job:
    """What to simulate. ``trace`` is already at the wanted microbatch size. A ``plan``
    fixes schedule, microbatches, partition, mapping and actions; without one, every
    tensor is kept and the fields below say the rest."""

    topology: Topology
    trace: Trace
    schedule: str = "1f1b"
    microbatches: int = 16
    n_stages: int | None = None
    """Pipeline depth; None means one stage per GPU (the papers' setting)."""
    stages: Stages | None = None
    """Layer ranges per stage; None means compute-balanced."""
    gpu_of_stage: tuple[int, ...] | None = None
    """Stage-to-GPU map; None means stage i on GPU i."""
    strategy: str = "none"
    """Label of what produced the plan."""
    plan: PlanFile | None = None
    record_link_rates: bool = False
    """Keep every change of link rates (for Chrome-trace counters)."""
    runtime: Runtime = "mpress"
    """The training runtime whose buffer and prefetch policies are modelled.

    ``mpress`` (MPress's and DAPPLE's runtimes): a receive buffer is allocated when its
    transfer starts and freed when the tensor is consumed; a swap-in is prefetched while
    the task before its backward runs. ``torch-pipelining`` (``validate/executor.py`` on
    ``torch.distributed.pipelining``): ``PipelineStage`` allocates one activation and one
    gradient receive buffer per microbatch before the first task and keeps them; a
    swap-in is re-timed from the arrival of its backward's gradient when that comes late
    (the executor restores a layer when the backward reaches the swapped layer above it)."""


@dataclass(frozen=True)
class Layout:
    """A job resolved and checked: the engine's only input."""

    topology: Topology
    trace: Trace
    schedule: str
    microbatches: int
    stages: Stages
    gpu_of: tuple[int, ...]
    actions: tuple[dict[int, LayerAction], ...]
    """Per stage, the action of each listed layer (missing: keep)."""
    optimizer: tuple[str, ...]
    stash: tuple[str, ...]
    host_optimizer: tuple[tuple[int, ...], ...]
    """Per stage, the layers whose optimizer states live on the host (``host_optimizer_layers``)."""
    strategy: str = "none"
    runtime: Runtime = "mpress"
    record_link_rates: bool = False
    swap_timing: SwapTiming = "prefetch"
    """``PlanFile.swap_timing``."""
    recompute_checkpoints: Checkpoints = "layer"
    """``PlanFile.recompute_checkpoints``."""

    @property
    def n_stages(self) -> int:
        return len(self.stages)


def _keep_everything(job: Job) -> Layout:
    topo = job.topology
    n_stages = job.n_stages if job.n_stages is not None else (len(job.stages) if job.stages else topo.n_gpus)
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    if n_stages > topo.n_gpus:
        raise MpsimError(f"{n_stages} stages need {n_stages} GPUs but {topo.name} has {topo.n_gpus}")
    if job.stages:
        stages = list(job.stages)
    else:
        times = job.trace.layer_times(topo.spec.gpu)
        stages = compute_balanced(np.asarray(times.fwd_s + times.bwd_s), n_stages)
    validate_stages(stages, job.trace.n_layers)
    if len(stages) != n_stages:
        raise MpsimError(f"the partition has {len(stages)} stages but {n_stages} were asked for")
    gpus = job.gpu_of_stage or tuple(range(n_stages))
    if len(gpus) != n_stages or len(set(gpus)) != n_stages or any(not 0 <= g < topo.n_gpus for g in gpus):
        raise MpsimError(f"the stage-to-GPU map {list(gpus)} must name {n_stages} distinct GPUs of "
                         f"0..{topo.n_gpus - 1}")
    check_schedule(job.schedule, n_stages, job.microbatches)
    return Layout(topo, job.trace, job.schedule, job.microbatches, stages, tuple(gpus),
                  tuple({} for _ in stages), ("gpu",) * n_stages, ("gpu",) * n_stages, ((),) * n_stages,
                  job.strategy, job.runtime,
                  job.record_link_rates)


def layout_of_plan(plan: PlanFile, topo: Topology, trace: Trace, *, checked: bool = False, strategy: str | None = None,
                   runtime: Runtime = "mpress", record_link_rates: bool = False) -> Layout:
    """The layout a plan describes; ``checked`` says the plan is known valid for this
    server and trace (made by ``make_plan``), otherwise its rules are checked here."""
    if not checked:
        if plan.microbatch != trace.microbatch:
            raise MpsimError(f"the plan is for microbatch {plan.microbatch} but the trace is at {trace.microbatch}")
        check_plan(plan, topo, trace)
    return Layout(topo, trace, plan.schedule, plan.microbatches, [st.layers for st in plan.stages],
                  tuple(st.gpu for st in plan.stages), tuple(plan.action_of(s) for s in range(len(plan.stages))),
                  tuple(st.optimizer for st in plan.stages), tuple(st.stash for st in plan.stages),
                  tuple(host_optimizer_layers(st) for st in plan.stages),
                  plan.strategy if strategy is None else strategy, runtime, record_link_rates, plan.swap_timing,
                  plan.recompute_checkpoints)


def resolve(job: Job) -> Layout:
    """Check a job and resolve it into the layout the engine runs."""
    if job.plan is None:
        return _keep_everything(job)
    return layout_of_plan(job.plan, job.topology, job.trace, strategy=job.strategy, runtime=job.runtime,
                          record_link_rates=job.record_link_rates)
