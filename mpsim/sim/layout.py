"""What the engine simulates: a job, and the one resolved layout the engine takes as input.

A ``Job`` is what a caller asks for (a ``JobSpec``, and a plan or the fields that make a
keep-everything one). ``resolve`` checks it once (partition, stage-to-GPU map, schedule,
plan rules) and returns a ``Layout``: stages, GPUs, actions, optimizer and stash
placement, already valid. Planners that make plans with ``mpsim.plans.plan.make_plan`` build
layouts with ``layout_of_plan(..., checked=True)`` and skip the checks, so a search that
simulates thousands of plans does not re-validate each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.context_parallel import context_shard
from mpsim.models.expert_parallel import expert_shard
from mpsim.models.tensor_parallel import shard_trace
from mpsim.models.trace import Trace
from mpsim.plans.job import JobSpec, OfJob, Parallelism, pipeline
from mpsim.plans.mesh import layout_name, parse_layout
from mpsim.plans.partition import Stages, compute_balanced, validate_stages
from mpsim.plans.plan import (
    Checkpoints,
    DataParallelPlan,
    LayerAction,
    MeshPlan,
    PlanFile,
    SwapTiming,
    TensorParallelPlan,
    check_plan,
    host_optimizer_layers,
)
from mpsim.sim.placement import Groups, Replicas, place_job
from mpsim.timing.costs import cost_model
from mpsim.timing.runtime import DEFAULT_PROFILE

Runtime = Literal["mpress", "torch-pipelining"]
T = TypeVar("T")


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
                runtime: Runtime = "mpress", runtime_profile: str = DEFAULT_PROFILE) -> Job:
    """The job a plan file describes on ``topo``, with ``trace`` rescaled to the plan's
    microbatch, under ``runtime_profile`` (``mpsim.timing.runtime``); the plan's own rules
    are checked when it is resolved (``check_plan``)."""
    spec = JobSpec(topo, trace.rescale(plan.microbatch), plan.schedule, plan.microbatches,
                   parallelism_of_plan(plan), record_link_rates=record_link_rates, runtime_profile=runtime_profile)
    return Job(spec, plan, runtime=runtime)


def parallelism_of_plan(plan: PlanFile) -> Parallelism:
    """The parallel layout a plan file describes (schema 1: a pipeline of its stages)."""
    dp, tp = plan.data_parallel, plan.tensor_parallel
    if plan.mesh is not None:  # schema 4: the mesh names it; the data block keeps the bucket and resharding
        named = parse_layout(plan.mesh.layout)
        options: dict[str, object] = {"bucket_mib": dp.bucket_mib,
                                      "reshard_after_forward": dp.reshard_after_forward} if dp else {}
        return named.model_copy(update=options | {"context_attention": plan.mesh.context_attention})
    tensor = 1 if tp is None else tp.degree
    sp = tp is not None and tp.sequence_parallel
    p, v = len(plan.stages) // plan.virtual_stages, plan.virtual_stages
    if dp is None:
        return pipeline(p).model_copy(update={"tensor": tensor, "sequence_parallel": sp, "virtual_stages": v})
    return Parallelism(data=dp.degree, zero_stage=dp.zero_stage, pipeline=p, virtual_stages=v,
                       bucket_mib=dp.bucket_mib, reshard_after_forward=dp.reshard_after_forward, tensor=tensor,
                       sequence_parallel=sp)


def data_parallel_plan(parallelism: Parallelism, replicas: Replicas, offload_params: bool = False,
                       offload_device: Literal["host", "nvme"] = "host") -> DataParallelPlan | None:
    """What a plan file records of a layout's replicas (None for one replica without ZeRO)."""
    if parallelism.replicas == 1 and parallelism.zero_stage == 0:
        return None
    return DataParallelPlan(degree=parallelism.replicas, zero_stage=parallelism.zero_stage,
                            bucket_mib=parallelism.bucket_mib, reshard_after_forward=parallelism.reshard_after_forward,
                            replicas=[list(r) for r in replicas], offload_params=offload_params,
                            offload_device=offload_device)


def mesh_plan(parallelism: Parallelism, n_stages: int) -> MeshPlan | None:
    """What a plan file records of a layout's mesh (schema 4): only where the data and
    tensor blocks cannot say the layout (HSDP, registered axes), else None."""
    if not (parallelism.hsdp or parallelism.axes):
        return None
    return MeshPlan(layout=layout_name(parallelism, n_stages), axes=list(parallelism.mesh(n_stages).axes),
                    context_attention=parallelism.context_attention)


def tensor_parallel_plan(parallelism: Parallelism, groups: Groups) -> TensorParallelPlan | None:
    """What a plan file records of a layout's tensor-parallel groups (None without)."""
    if parallelism.tensor == 1:
        return None
    return TensorParallelPlan(degree=parallelism.tensor, sequence_parallel=parallelism.sequence_parallel,
                              groups=[[list(g) for g in replica] for replica in groups])


def stage_trace(job: JobSpec, runtime: Runtime) -> Trace | None:
    """The trace one GPU of a stage runs: the job's, or with tensor parallelism its shard
    (``mpsim.models.tensor_parallel``; the executor's DTensor layers keep the gathered input under
    sequence parallelism, Megatron's the shard), with expert parallelism the busiest expert
    GPU's shard of that (``mpsim.models.expert_parallel``), with context parallelism one
    context GPU's part of it (``mpsim.models.context_parallel``). None when it is the job's own."""
    par = job.parallelism
    if par.tensor == 1 and par.expert == 1 and par.context == 1:
        return None
    shard = shard_trace(job.trace, par.tensor, par.sequence_parallel, saves_gathered=runtime == "torch-pipelining")
    shard = context_shard(shard, par.context, par.context_attention)
    return expert_shard(shard, par.expert, job.expert_load)


@dataclass(frozen=True)
class Laid:
    """A job laid on its hardware: what is derived from the job once (``lay``) and carried
    from the planner's context (``Ctx.laid``) to the engine's layout (``Layout.laid``). It
    depends on the mesh's sizes, the cluster and the runtime, not on the plan's actions or
    the ZeRO stage."""

    replicas: Replicas = ()
    """Per data-parallel replica, the GPU of each model stage (virtual stages repeated);
    empty for one replica."""
    tp_groups: Groups = ()
    """Per replica, per model stage, its tensor-parallel group in ring order; empty without."""
    shard: Trace | None = None
    """With tensor parallelism, one GPU's shard of the job's trace (``stage_trace``)."""
    view: Topology | None = None
    """On a cluster, the servers the engine simulates (``ClusterView``); None: the job's server."""
    across: int = 1
    """Servers each stage's data-parallel group spans (``placement.Placed``)."""
    first: tuple[int, ...] = ()
    """Replica 0's GPU of each model stage (the stages' own GPUs)."""


def lay(job: JobSpec, runtime: Runtime = "mpress") -> Laid:
    """``job`` laid on its server or cluster (``placement.place_job``), its stages'
    placements repeated for every virtual stage, with the trace one GPU runs."""
    v = job.parallelism.virtual_stages
    placed = place_job(job, job.n_stages)
    replicas, groups = interleaved(placed.replicas, v), interleaved(placed.groups, v)
    on_cluster = job.cluster is not None
    return Laid(replicas if len(replicas) > 1 else (), groups if job.parallelism.tensor > 1 else (),
                stage_trace(job, runtime), placed.topology if on_cluster else None,
                placed.across if on_cluster else 1, replicas[0])


class OnLaid:
    """Read-through fields for a type that holds a ``laid`` (the planner's context, the
    engine's layout): the placement and shard derived once from the job (``lay``)."""

    laid: Laid

    @property
    def replicas(self) -> Replicas:
        """Per data-parallel replica, the GPU of each model stage; replica 0 is the stages'
        own GPUs, the one simulated. Empty means one replica."""
        return self.laid.replicas

    @property
    def tp_groups(self) -> Groups:
        """Per replica, per model stage, its tensor-parallel group in ring order; empty without."""
        return self.laid.tp_groups

    @property
    def shard(self) -> Trace | None:
        """With tensor parallelism, what one GPU of a stage runs (``stage_trace``)."""
        return self.laid.shard

    @property
    def view(self) -> Topology | None:
        """On a cluster, the servers simulated (``ClusterView``); None: the job's server."""
        return self.laid.view

    @property
    def across(self) -> int:
        """On a cluster, the servers each stage's data-parallel group spans."""
        return self.laid.across


@dataclass(frozen=True)
class Layout(OfJob, OnLaid):
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
    offload_params: bool = False
    """ZeRO-Infinity: parameter shards live on ``offload_device`` (``DataParallelPlan``)."""
    offload_device: str = "host"
    """Where offloaded parameters and optimizer states live: ``host`` or ``nvme``."""
    laid: Laid = field(default_factory=lambda: Laid())
    """The job on its hardware (``lay``): replicas, tensor groups, the shard, the view."""

    @property
    def topology(self) -> Topology:
        """What the engine simulates: the server, or a cluster's view of some of its servers."""
        return self.view if self.view is not None else self.job.topology

    @property
    def shard_ways(self) -> int:
        """GPUs a stage's sharded states are split over: the data-parallel group, or under
        HSDP its GPUs on one server."""
        return self.parallelism.shard_ways(self.across)

    @property
    def host_ways(self) -> int:
        """GPUs whose work shares a host per simulated GPU (host memory, NVMe, the CPU's
        Adam): on one server every data-parallel replica's every tensor rank; on a
        cluster the GPUs of a server over the simulated GPUs on it."""
        par = self.parallelism
        if self.view is None:
            return par.stage_gpus
        return self.job.topology.n_gpus * self.view_servers // self.job.n_stages

    @property
    def view_servers(self) -> int:
        """Servers the engine simulates (1 without a cluster)."""
        return self.topology.n_gpus // self.job.topology.n_gpus

    @property
    def trace(self) -> Trace:
        """What one GPU of a stage runs: the job's trace, or its tensor-parallel shard."""
        return self.shard if self.shard is not None else self.job.trace

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def parallelism(self) -> Parallelism:
        return self.job.parallelism

    def group(self, stage: int) -> tuple[int, ...]:
        """Stage ``stage``'s data-parallel group: its GPU in every replica."""
        return tuple(r[stage] for r in self.replicas) if self.replicas else (self.gpu_of[stage],)

    def expert_group(self, stage: int) -> tuple[tuple[int, ...], int]:
        """Stage ``stage``'s expert-parallel group in replica 0: its GPUs on the simulated
        servers and the servers it spans. The expert axis lies inside the data axis and
        outside the context axis (``mpsim.plans.expert``), so on a cluster its GPUs are
        every ``cp``-th of the stage's group (``cluster_placement``: replicas in mesh
        order), the first ``ep`` of them; on one server likewise in the group's ring order."""
        cp, ep, group = self.parallelism.context, self.parallelism.expert, self.group(stage)
        if cp * ep <= len(group):
            return group[: cp * ep : cp], 1
        if len(group) % cp:
            raise MpsimError(f"{self.parallelism.describe(1)}: a context group across servers with expert "
                             "parallelism is not simulated; keep context x expert GPUs within a server's")
        return group[::cp], cp * ep // len(group)

    def context_group(self, stage: int) -> tuple[tuple[int, ...], int]:
        """Stage ``stage``'s context-parallel group in replica 0: its GPUs on the simulated
        servers and the servers it spans. The context axis is the innermost of the stage's
        group (``mpsim.plans.context_parallel``: tensor, context, expert, data), so it is
        the group's first ``cp`` GPUs, or on a cluster where it outgrows a server the
        group's GPUs there, repeated on ``cp / len`` servers."""
        cp, group = self.parallelism.context, self.group(stage)
        if cp <= len(group):
            return group[:cp], 1
        return group, cp // len(group)

    def expert_data_group(self, stage: int) -> tuple[tuple[int, ...], int]:
        """Stage ``stage``'s expert-data-parallel group (the GPUs holding the same experts:
        every context GPU of every ``ep``-th expert coordinate of the stage's group) on the
        simulated servers and the servers it spans; the data-parallel group itself without
        expert parallelism."""
        cp, ep, group = self.parallelism.context, self.parallelism.expert, self.group(stage)
        if cp * ep <= len(group):
            return tuple(g for i, g in enumerate(group) if (i // cp) % ep == 0), self.across
        return group[:cp], self.across // (cp * ep // len(group))

    def tensor_group(self, stage: int) -> tuple[int, ...]:
        """Stage ``stage``'s tensor-parallel group in replica 0, in ring order."""
        return self.tp_groups[0][stage] if self.tp_groups else (self.gpu_of[stage],)


def _keep_everything(job: Job) -> Layout:
    spec, topo = job.spec, job.spec.topology
    par = spec.parallelism
    if (par.stage_gpus > 1 or par.virtual_stages > 1) and job.gpu_of_stage is not None:
        raise MpsimError("a stage-to-GPU map places one GPU a stage; with data, tensor or interleaved pipeline "
                         "parallelism mpsim places the GPUs")
    v = par.virtual_stages
    n_stages = len(job.stages) if job.stages and par.pipeline is None and v == 1 else spec.model_stages
    if job.stages:
        stages = list(job.stages)
    else:
        times = cost_model(stage_trace(spec, job.runtime) or spec.trace, topo.spec.gpu).layer_times
        stages = compute_balanced(np.asarray(times.fwd_s + times.bwd_s), n_stages)
    validate_stages(stages, spec.trace.n_layers)
    if len(stages) != n_stages:
        raise MpsimError(f"the partition has {len(stages)} stages but {n_stages} were asked for")
    p = n_stages // v
    if par.pipeline != p:
        spec = spec.but(parallelism=par.model_copy(update={"pipeline": p}))
    laid = lay(spec, job.runtime)
    n_gpus = (laid.view or topo).n_gpus
    gpus = job.gpu_of_stage or laid.first
    if len(gpus) != n_stages or len(set(gpus)) != p or any(not 0 <= g < n_gpus for g in gpus):
        raise MpsimError(f"the stage-to-GPU map {list(gpus)} must name {n_stages} distinct GPUs of "
                         f"0..{n_gpus - 1}")
    return Layout(spec, stages, tuple(gpus), tuple({} for _ in stages), ("gpu",) * n_stages, ("gpu",) * n_stages,
                  ((),) * n_stages, spec.strategy, job.runtime, laid=laid)


def interleaved(per_replica: tuple[tuple[T, ...], ...], v: int) -> tuple[tuple[T, ...], ...]:
    """Per replica, each of the p stages' entries repeated for every virtual stage: virtual
    stage c * p + g runs on the GPU (group) of stage g (``schedule.interleaved_gpu_order``)."""
    return tuple(tuple(stages[s % len(stages)] for s in range(len(stages) * v)) for stages in per_replica)


def layout_of_plan(plan: PlanFile, job: JobSpec, *, checked: bool = False, runtime: Runtime = "mpress",
                   laid: Laid | None = None) -> Layout:
    """The layout a plan describes for ``job`` (its server, trace, schedule and
    microbatches: the plan's); ``checked`` says the plan is known valid for them (made by
    ``make_plan``), otherwise its rules are checked here. ``laid``: the job as its planner
    laid it (``Ctx.laid``), which a plan the planner made keeps, so nothing is derived again;
    otherwise the replicas and groups are the plan's own."""
    if not checked:
        if plan.microbatch != job.trace.microbatch:
            raise MpsimError(f"the plan is for microbatch {plan.microbatch} but the trace is at "
                             f"{job.trace.microbatch}")
        check_plan(plan, job.topology, job.trace)
        if (plan.schedule, plan.microbatches, len(plan.stages)) != (job.schedule, job.microbatches,
                                                                    job.model_stages):
            raise MpsimError(f"the plan is for {plan.schedule}, {plan.microbatches} microbatches and "
                             f"{len(plan.stages)} stages but the job is {job.schedule}, {job.microbatches} and "
                             f"{job.model_stages}")
        if parallelism_of_plan(plan) != job.parallelism.model_copy(update={"pipeline": job.n_stages}):
            raise MpsimError(f"the plan's layout is {parallelism_of_plan(plan).describe(len(plan.stages))} but "
                             f"the job's is {job.layout_name}")
    dp = plan.data_parallel
    return Layout(job, [st.layers for st in plan.stages], tuple(st.gpu for st in plan.stages),
                  tuple(plan.action_of(s) for s in range(len(plan.stages))),
                  tuple(st.optimizer for st in plan.stages), tuple(st.stash for st in plan.stages),
                  tuple(host_optimizer_layers(st) for st in plan.stages),
                  plan.strategy, runtime, plan.swap_timing, plan.recompute_checkpoints,
                  dp is not None and dp.offload_params, dp.offload_device if dp is not None else "host",
                  laid if laid is not None else _laid_by_plan(plan, job, runtime))


def _laid_by_plan(plan: PlanFile, job: JobSpec, runtime: Runtime) -> Laid:
    """The replicas and tensor groups a plan file names, with the job's shard and, on a
    cluster, its view."""
    dp, tp = plan.data_parallel, plan.tensor_parallel
    replicas = tuple(tuple(r) for r in dp.replicas) if dp is not None and dp.degree > 1 else ()
    groups = tuple(tuple(tuple(g) for g in r) for r in tp.groups) if tp is not None else ()
    view, across = None, 1
    if job.cluster is not None:
        placed = place_job(job, job.n_stages)
        view, across = placed.topology, placed.across
    return Laid(replicas, groups, stage_trace(job, runtime), view, across, tuple(st.gpu for st in plan.stages))


def resolve(job: Job) -> Layout:
    """Check a job and resolve it into the layout the engine runs."""
    if job.plan is None:
        return _keep_everything(job)
    return layout_of_plan(job.plan, job.spec, runtime=job.runtime)
