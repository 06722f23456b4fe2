"""A training job as a launcher states it (issue 52): the framework-neutral middle between
mpsim's plans and the frameworks' own configurations (``mpsim.launch.megatron``,
``torchtitan``, ``deepspeed``, ``accelerate``).

A ``LaunchJob`` holds what every framework's flags say and mpsim simulates: the model and
its sequence and recipe, the mesh's degrees (data with its ZeRO stage or HSDP, tensor with
sequence parallelism, pipeline with virtual stages, context and its attention, expert), the
microbatch and the microbatches each replica runs, activation recomputation as the
frameworks name it (none; selective, the attention core, Korthikanti et al. 2022 section
4.2; full, every layer, or the first N layers of each stage: Megatron-LM's
``--recompute-method block``), optimizer and parameter offload (ZeRO-Offload/Infinity),
the gradient bucket, FSDP's resharding, and the runtime profile (which communication the
framework overlaps). ``from_planned`` reads it off a plan mpsim made; ``simulate`` runs it
again; a plan no framework can state (recomputed layers that are not the first of each
stage, swaps to host or peers, split layers) is refused in one line naming what."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from mpsim.datafile import FileModel
from mpsim.errors import MpsimError
from mpsim.models.context_parallel import ContextAttention
from mpsim.models.trace import RECIPES
from mpsim.plans.job import JobSpec
from mpsim.plans.mesh import DEFAULT_BUCKET_MIB, Parallelism
from mpsim.plans.plan import PlanFile
from mpsim.sim.result import SimResult
from mpsim.timing.runtime import DEFAULT_PROFILE, PROFILES

Recompute = Literal["none", "selective", "full"]
Offload = Literal["none", "optimizer", "params"]
"""ZeRO-Offload (optimizer states and step on the host) and ZeRO-Infinity (parameters too)."""


class Prediction(FileModel):
    """What mpsim predicted for the job, written beside a launcher's configuration."""

    fits: bool
    peak_gib: float = Field(ge=0)
    iteration_s: float = Field(gt=0)
    samples_per_s: float = Field(ge=0)


class LaunchJob(FileModel):
    """One training job as the launchers say it (module doc)."""

    model: str = Field(min_length=1, description="shipped model or trace file the job trains")
    server: str = Field(min_length=1, description="shipped server or topology file")
    cluster: str | None = Field(default=None, description="cluster the servers are joined by; None: one server")
    servers: StrictInt = Field(default=1, ge=1, le=1 << 16)
    seq_len: StrictInt = Field(ge=1, description="tokens per sample")
    recipe: str = Field(description="training precision (mpsim.models.trace.RECIPES)")
    microbatch: StrictInt = Field(ge=1, description="samples per microbatch on each GPU")
    microbatches: StrictInt = Field(ge=1, description="microbatches each replica runs per iteration (gradient "
                                                      "accumulation x pipeline microbatches)")
    data: StrictInt = Field(default=1, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = 0
    hsdp: StrictBool = False
    tensor: StrictInt = Field(default=1, ge=1)
    sequence_parallel: StrictBool = False
    pipeline: StrictInt = Field(default=1, ge=1)
    virtual_stages: StrictInt = Field(default=1, ge=1)
    context: StrictInt = Field(default=1, ge=1)
    context_attention: ContextAttention = "ring"
    expert: StrictInt = Field(default=1, ge=1)
    recompute: Recompute = "none"
    recompute_layers: StrictInt | None = Field(
        default=None, ge=1, description="with full recomputation: the first N layers of each stage (block "
                                        "method); None: every layer")
    offload: Offload = "none"
    offload_device: Literal["host", "nvme"] = "host"
    bucket_mib: float = Field(default=DEFAULT_BUCKET_MIB, gt=0, le=65536)
    reshard_after_forward: StrictBool = True
    runtime: str = DEFAULT_PROFILE
    predicted: Prediction | None = Field(default=None, description="mpsim's prediction, for the comment block")

    @model_validator(mode="after")
    def _known(self) -> LaunchJob:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe {self.recipe!r}: expected one of {', '.join(RECIPES)}")
        if self.runtime not in PROFILES:
            raise ValueError(f"runtime {self.runtime!r}: expected one of {', '.join(PROFILES)}")
        if self.recompute_layers is not None and self.recompute != "full":
            raise ValueError("recompute_layers goes with full recomputation")
        if self.context == 1 and self.context_attention != "ring":
            raise ValueError("context_attention goes with a context axis (context > 1)")
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError("offload needs a ZeRO stage (ZeRO-Offload: 1-3, ZeRO-Infinity: 3)")
        return self

    @property
    def gpus(self) -> int:
        """GPUs of the mesh: mpsim's axes multiply (its data axis leaves out the expert and
        context GPUs, which Megatron-Core counts in its data-parallel size)."""
        return self.data * self.tensor * self.pipeline * self.context * self.expert

    @property
    def sample_ways(self) -> int:
        """Replicas that train different samples: data x expert (a context group shares each sample)."""
        return self.data * self.expert

    @property
    def global_batch(self) -> int:
        """Samples per iteration over all replicas."""
        return self.microbatch * self.microbatches * self.sample_ways

    @property
    def strategy(self) -> str:
        """The mpsim strategy that plans the job: what the recomputation and offload say."""
        if self.offload == "params":
            return "zero-infinity"
        if self.offload == "optimizer":
            return "zero-offload"
        return {"none": "none", "selective": "selective", "full": "recompute-all"}[self.recompute]

    def parallelism(self) -> Parallelism:
        axes = tuple((name, n) for name, n in (("context", self.context), ("expert", self.expert)) if n > 1)
        try:
            return Parallelism(data=self.data, tensor=self.tensor, sequence_parallel=self.sequence_parallel,
                               pipeline=self.pipeline, virtual_stages=self.virtual_stages, zero_stage=self.zero_stage,
                               bucket_mib=self.bucket_mib, reshard_after_forward=self.reshard_after_forward,
                               hsdp=self.hsdp, axes=axes, context_attention=self.context_attention)
        except ValidationError as exc:  # a degree past Parallelism's bounds
            first = exc.errors()[0]
            raise MpsimError(f"{'.'.join(str(x) for x in first['loc']) or 'layout'}: {first['msg']}") from None
        except ValueError as exc:
            raise MpsimError(str(exc).splitlines()[-1]) from None


def from_planned(job: JobSpec, plan: PlanFile, result: SimResult, model: str, server: str) -> LaunchJob:
    """The launch job of a plan mpsim made for ``job`` (its strategy's layers kept,
    recomputed or the attention core recomputed; offloaded states), with ``result`` as
    its prediction. Refused in one line where no framework's flags state the plan."""
    par = job.parallelism
    recompute, layers = _recompute(plan, job)
    offload, device = _offload(plan)
    trace = job.trace
    return LaunchJob(
        model=model, server=server, cluster=job.cluster.name if job.cluster is not None else None,
        servers=job.servers, seq_len=trace.seq_len or 1, recipe=trace.spec.precision.recipe,
        microbatch=trace.microbatch, microbatches=job.microbatches, data=par.data, zero_stage=par.zero_stage,
        hsdp=par.hsdp, tensor=par.tensor, sequence_parallel=par.sequence_parallel, pipeline=job.n_stages,
        virtual_stages=par.virtual_stages, context=par.context, context_attention=par.context_attention,
        expert=par.expert, recompute=recompute, recompute_layers=layers, offload=offload, offload_device=device,
        bucket_mib=par.bucket_mib, reshard_after_forward=par.reshard_after_forward, runtime=job.runtime_profile,
        predicted=Prediction(fits=result.fits, peak_gib=round(result.max_peak_bytes / 2**30, 2),
                             iteration_s=result.iteration_s, samples_per_s=result.samples_per_s))


def _offload(plan: PlanFile) -> tuple[Offload, Literal["host", "nvme"]]:
    """What the plan offloads, read off its own fields (not its strategy's name): every
    stage's optimizer stepped on the host is ZeRO-Offload, with parameter shards off the GPU
    too ZeRO-Infinity; optimizer states streamed tensor by tensor (MPress's swap) or kept on
    the GPU for some layers only are refused in one line."""
    kinds = {stage.optimizer for stage in plan.stages}
    dp = plan.data_parallel
    if kinds == {"gpu"}:
        return "none", "host"
    if kinds != {"host-update"} or dp is None or any(stage.optimizer_layers for stage in plan.stages):
        raise MpsimError("the plan streams optimizer states to the host, or keeps some on the GPU, which no "
                         "framework's configuration states; plan with --strategy zero-offload or zero-infinity")
    return ("params" if dp.offload_params else "optimizer"), dp.offload_device


def _recompute(plan: PlanFile, job: JobSpec) -> tuple[Recompute, int | None]:
    """What the plan recomputes, as the frameworks say it: nothing, the attention core of
    every transformer layer (selective), every layer, or the first N of each stage (full,
    block method). Anything else refused in one line."""
    blocks = {i for i, r in enumerate(job.trace.layers) if r.kind == "transformer"}
    per_stage, selective = _actions(plan)
    if selective:
        if selective != blocks or any(per_stage):
            raise MpsimError("the plan recomputes the attention core of some layers only; frameworks recompute it "
                             "in every layer (--recompute-granularity selective)")
        return "selective", None
    if not any(per_stage):
        return "none", None
    return "full", _block_count(plan, per_stage, blocks)


def _actions(plan: PlanFile) -> tuple[list[list[int]], set[int]]:
    """Per stage the layers recomputed whole, and the layers whose attention core is;
    refused in one line where a layer is swapped or split."""
    per_stage: list[list[int]] = []
    selective: set[int] = set()
    for stage in plan.stages:
        for action in stage.actions:
            if action.split > 1 or action.action in ("host", "peer"):
                raise MpsimError(f"layer {action.layer}: the plan {'splits' if action.split > 1 else 'swaps'} it "
                                 "(TSPLIT, MPress), which no framework's configuration states; plan with "
                                 "--strategy none, selective, recompute-all, zero-offload or zero-infinity")
        per_stage.append(sorted(a.layer for a in stage.actions if a.action == "recompute"))
        selective |= {a.layer for a in stage.actions if a.action == "selective"}
    return per_stage, selective


def _block_count(plan: PlanFile, per_stage: list[list[int]], blocks: set[int]) -> int | None:
    """The N of Megatron-LM's block method (the first N transformer layers of each stage),
    None when every layer is; refused in one line otherwise."""
    counts, every = set(), True
    for stage, done in zip(plan.stages, per_stage, strict=True):
        first, last = stage.layers
        mine = [i for i in range(first, last) if i in blocks]
        if done != mine[:len(done)]:
            raise MpsimError(f"the plan recomputes layers {done} of stage [{first}, {last}), not its first ones; "
                             "frameworks recompute the first N layers of each stage (--recompute-method block)")
        counts.add(len(done))
        every = every and len(done) == len(mine)
    if every:
        return None
    if len(counts) != 1:
        raise MpsimError("the plan recomputes a different number of layers in each stage; frameworks recompute "
                         "the same N in every stage (--recompute-num-layers)")
    return counts.pop()


def job_of_launch(launch: LaunchJob) -> JobSpec:
    """The mpsim job a launch job states: the model retraced at its length and recipe, its
    mesh, microbatches and the strategy its recomputation and offload name."""
    from mpsim.data.catalog import load_trace
    from mpsim.models.retrace import retraced
    from mpsim.plans.job import job_of

    trace = retraced(load_trace(launch.model), launch.seq_len, launch.recipe)
    return job_of(launch.server if launch.cluster is None else None, trace, microbatch=launch.microbatch,
                  microbatches=launch.microbatches, n_stages=launch.pipeline, strategy=launch.strategy,
                  parallelism=launch.parallelism(), cluster=launch.cluster,
                  servers=launch.servers, runtime_profile=launch.runtime)


def simulate(launch: LaunchJob) -> tuple[JobSpec, PlanFile, SimResult]:
    """The launch job planned and simulated as its framework runs it: its strategy's plan,
    and with ``recompute_layers`` the first N transformer layers of each stage recomputed."""
    from mpsim.planners import plan_job
    from mpsim.sim import simulate_job
    from mpsim.sim.layout import job_of_plan

    job = job_of_launch(launch)
    if launch.recompute_layers is None:
        planned = plan_job(job)
        return job, planned.plan, planned.result
    plan = _first_layers_recomputed(plan_job(job.but(strategy="none")).plan, job, launch.recompute_layers)
    return job, plan, simulate_job(job_of_plan(job.topology, job.trace, plan, runtime_profile=job.runtime_profile))


def _first_layers_recomputed(plan: PlanFile, job: JobSpec, n: int) -> PlanFile:
    """``plan`` with the first ``n`` transformer layers of each stage recomputed
    (Megatron-LM's ``--recompute-method block --recompute-num-layers n``)."""
    from mpsim.plans.plan import LayerAction

    kinds = [r.kind for r in job.trace.layers]
    stages = []
    for stage in plan.stages:
        blocks = [i for i in range(*stage.layers) if kinds[i] == "transformer"][:n]
        stages.append(stage.model_copy(update={
            "actions": [LayerAction(layer=i, action="recompute") for i in blocks]}))
    return plan.model_copy(update={"stages": stages, "strategy": f"recompute-first-{n}"})
