"""What the engine simulates: a job, and the one resolved layout the engine takes as input.

A ``Job`` is what a caller asks for (a ``JobSpec``, and a plan or the fields that make a
keep-everything one). ``resolve`` checks it once (partition, stage-to-GPU map, schedule,
plan rules) and returns a ``Layout``: stages, GPUs, actions, optimizer and stash
placement, already valid. Planners that make plans with ``mpsim.plan.make_plan`` build
layouts with ``layout_of_plan(..., checked=True)`` and skip the checks, so a search that
simulates thousands of plans does not re-validate each one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from mpsim.costs import cost_model
from mpsim.errors import MpsimError
from mpsim.job import JobSpec, OfJob, pipeline
from mpsim.partition import Stages, compute_balanced, validate_stages
from mpsim.plan import Checkpoints, LayerAction, PlanFile, SwapTiming, check_plan, host_optimizer_layers
from mpsim.topology import Topology
from mpsim.trace import Trace

Runtime = Literal["mpress", "torch-pipelining"]


@dataclass(frozen=True)
class Job:
    """What to simulate: a job (``JobSpec``: server, trace at its microbatch size,
    schedule, microbatches, stages), and a ``plan`` that fixes schedule, microbatches,
    partition, mapping and actions; without one, every tensor is kept and the fields below
    say the rest."""

    spec: JobSpec
    plan: PlanFile | None = None
    stages: Stages | None = None
    """Layer ranges per stage; None means compute-balanced."""
    gpu_of_stage: tuple[int, ...] | None = None
    """Stage-to-GPU map; None means stage i on GPU i."""
    runtime: Runtime = "mpress"
    """The training runtime whose buffer and prefetch policies are modelled.

    ``mpress`` (MPress's and DAPPLE's runtimes): a receive buffer is allocated when its
    transfer starts and freed when the tensor is consumed; a swap-in is prefetched while
    the task before its backward runs. ``torch-pipelining`` (``validate/executor.py`` on
    ``torch.distributed.pipelining``): ``PipelineStage`` allocates one activation and one
    gradient receive buffer per microbatch before the first task and keeps them; a
    swap-in is re-timed from the arrival of its backward's gradient when that comes late
    (the executor restores a layer when the backward reaches the swapped layer above it)."""


def job_of_plan(topo: Topology, trace: Trace, plan: PlanFile, record_link_rates: bool = False,
                runtime: Runtime = "mpress") -> Job:
    """The job a plan file describes on ``topo``, with ``trace`` rescaled to the plan's
    microbatch; the plan's own rules are checked when it is resolved (``check_plan``)."""
    spec = JobSpec(topo, trace.rescale(plan.microbatch), plan.schedule, plan.microbatches,
                   pipeline(len(plan.stages)), record_link_rates=record_link_rates)
    return Job(spec, plan, runtime=runtime)


@dataclass(frozen=True)
class Layout(OfJob):
    """A job resolved and checked: the engine's only input. ``job`` says the server, the
    trace, the schedule and the microbatches; the rest is the plan, resolved per stage."""

    job: JobSpec
    stages: Stages
    gpu_of: tuple[int, ...]
    actions: tuple[dict[int, LayerAction], ...]
    """Per stage, the action of each listed layer (missing: keep)."""
    optimizer: tuple[str, ...]
    stash: tuple[str, ...]
    host_optimizer: tuple[tuple[int, ...], ...]
    """Per stage, the layers whose optimizer states live on the host (``host_optimizer_layers``)."""
    label: str = "none"
    """What produced the plan (``PlanFile.strategy``: a strategy's name, or any label)."""
    runtime: Runtime = "mpress"
    swap_timing: SwapTiming = "prefetch"
    """``PlanFile.swap_timing``."""
    recompute_checkpoints: Checkpoints = "layer"
    """``PlanFile.recompute_checkpoints``."""

    @property
    def n_stages(self) -> int:
        return len(self.stages)


def _keep_everything(job: Job) -> Layout:
    spec, topo = job.spec, job.spec.topology
    n_stages = len(job.stages) if job.stages and spec.parallelism.pipeline is None else spec.n_stages
    if job.stages:
        stages = list(job.stages)
    else:
        times = cost_model(spec.trace, topo.spec.gpu).layer_times
        stages = compute_balanced(np.asarray(times.fwd_s + times.bwd_s), n_stages)
    validate_stages(stages, spec.trace.n_layers)
    if len(stages) != n_stages:
        raise MpsimError(f"the partition has {len(stages)} stages but {n_stages} were asked for")
    gpus = job.gpu_of_stage or tuple(range(n_stages))
    if len(gpus) != n_stages or len(set(gpus)) != n_stages or any(not 0 <= g < topo.n_gpus for g in gpus):
        raise MpsimError(f"the stage-to-GPU map {list(gpus)} must name {n_stages} distinct GPUs of "
                         f"0..{topo.n_gpus - 1}")
    if spec.parallelism.pipeline != n_stages:
        spec = spec.but(parallelism=pipeline(n_stages))
    return Layout(spec, stages, tuple(gpus), tuple({} for _ in stages), ("gpu",) * n_stages, ("gpu",) * n_stages,
                  ((),) * n_stages, spec.strategy, job.runtime)


def layout_of_plan(plan: PlanFile, job: JobSpec, *, checked: bool = False, runtime: Runtime = "mpress") -> Layout:
    """The layout a plan describes for ``job`` (its server, trace, schedule and
    microbatches: the plan's); ``checked`` says the plan is known valid for them (made by
    ``make_plan``), otherwise its rules are checked here."""
    if not checked:
        if plan.microbatch != job.trace.microbatch:
            raise MpsimError(f"the plan is for microbatch {plan.microbatch} but the trace is at "
                             f"{job.trace.microbatch}")
        check_plan(plan, job.topology, job.trace)
        if (plan.schedule, plan.microbatches, len(plan.stages)) != (job.schedule, job.microbatches, job.n_stages):
            raise MpsimError(f"the plan is for {plan.schedule}, {plan.microbatches} microbatches and "
                             f"{len(plan.stages)} stages but the job is {job.schedule}, {job.microbatches} and "
                             f"{job.n_stages}")
    return Layout(job, [st.layers for st in plan.stages], tuple(st.gpu for st in plan.stages),
                  tuple(plan.action_of(s) for s in range(len(plan.stages))),
                  tuple(st.optimizer for st in plan.stages), tuple(st.stash for st in plan.stages),
                  tuple(host_optimizer_layers(st) for st in plan.stages),
                  plan.strategy, runtime, plan.swap_timing,
                  plan.recompute_checkpoints)


def resolve(job: Job) -> Layout:
    """Check a job and resolve it into the layout the engine runs."""
    if job.plan is None:
        return _keep_everything(job)
    return layout_of_plan(job.plan, job.spec, runtime=job.runtime)
