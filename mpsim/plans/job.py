"""The job as one type: what every study simulates, declared once and checked once.

A ``JobSpec`` is a server, a trace already at its microbatch size, a pipeline schedule, the
number of microbatches per iteration, a parallel layout (``Parallelism``), the partition
rule and the memory-saving strategy. ``simulate``, ``plan``, ``fits``, ``sweep``,
``choose``, ``reproduce``, ``validate`` and the web page each build one and pass it on;
none of them re-declares these fields or re-checks them.

The parallel layout names every degree the next releases model (Megatron-LM's order:
tensor-parallel groups innermost, then data parallel, then pipeline; ZeRO's stages of
sharded model states, Rajbhandari et al. 2020). The engine simulates data parallelism
(DDP, ZeRO-1/2/3, FSDP2), Megatron-LM's tensor parallelism with or without sequence
parallelism, and a pipeline (``mpsim.models.tensor_parallel``), plain or interleaved (virtual
stages, ``mpsim.plans.schedule.interleaved_gpu_order``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster
from mpsim.hardware.topology import Topology
from mpsim.models.context_parallel import check_context_parallel
from mpsim.models.expert_parallel import UNIFORM, ExpertLoad, check_expert_parallel
from mpsim.models.tensor_parallel import check_shardable
from mpsim.models.trace import Trace
from mpsim.plans.cluster_placement import place_on_cluster
from mpsim.plans.mesh import (  # noqa: F401 - the layout's names, read from the job as before
    DEFAULT_BUCKET_MIB,
    DP_NAMES,
    PIPELINE_ONLY,
    Parallelism,
    data_parallel,
    pipeline,
)
from mpsim.plans.partition import PARTITIONS, check_partition
from mpsim.plans.schedule import check_interleaved, check_schedule
from mpsim.plans.strategies import strategy_named
from mpsim.timing.runtime import DEFAULT_PROFILE, profile_named

DEFAULT_SERVER = "dgx1-v100"
"""The server a command uses when none is named: MPress's DGX-1 (papers/mpress.txt IV-A)."""
DEFAULT_MODEL = "gpt-5.3b"
"""The model a command simulates, and a trace preset starts from, when none is named:
MPress's GPT-5.3B."""
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_MICROBATCHES = 16
"""Microbatches per iteration when none is given (the papers' pipelines run 16)."""


def partitions_of(parallelism: Parallelism) -> tuple[str, ...]:
    """The partitions a search tries for a layout: both, or compute-balanced only under
    interleaved 1F1B (the memory-balanced one does not model its held microbatches) and
    with one stage (both put every layer on it: the same job twice)."""
    return ("compute",) if parallelism.virtual_stages > 1 or parallelism.pipeline == 1 else PARTITIONS


def check_strategy(strategy: str) -> None:
    """The one check of a strategy name, against the registry (``mpsim.plans.strategies``)."""
    strategy_named(strategy)


@dataclass(frozen=True)
class JobSpec:
    """One training job, checked on construction (one-line ``MpsimError`` on bad input).

    ``trace`` is already at the microbatch size the job runs (``Trace.rescale``)."""

    topology: Topology
    trace: Trace
    schedule: str = DEFAULT_SCHEDULE
    """``gpipe``, ``1f1b`` (DAPPLE) or ``pipedream`` (``mpsim.plans.schedule``)."""
    microbatches: int = DEFAULT_MICROBATCHES
    """Microbatches per iteration (per pipeline, per data-parallel replica)."""
    parallelism: Parallelism = field(default=PIPELINE_ONLY)
    partition: str = "compute"
    """How layers are cut into stages (``PARTITIONS``)."""
    strategy: str = "none"
    """The memory-saving strategy that plans the job (``mpsim.plans.strategies``)."""
    record_link_rates: bool = False
    """Keep every change of link rates (Chrome-trace counters); does not change results."""
    cluster: Cluster | None = None
    """Servers of ``topology``'s type joined by a fabric (``mpsim.hardware.cluster``); None: one server."""
    servers: int = 1
    """Servers the job fills, all of their GPUs (with a cluster)."""
    runtime_profile: str = DEFAULT_PROFILE
    """What the framework does at run time (``mpsim.timing.runtime``): which communication
    hides behind which compute, and the host's dispatch of kernels."""
    expert_load: ExpertLoad = UNIFORM
    """How a mixture-of-experts model's tokens spread over its experts
    (``mpsim.models.expert_parallel``): the busiest expert-parallel GPU is simulated."""

    def __post_init__(self) -> None:
        profile_named(self.runtime_profile)
        why = self.parallelism.unsupported()
        if why is not None:
            raise MpsimError(why)
        self.parallelism.stages_on(self.topology, self.servers, fill=False)  # too few GPUs: said first
        check_shardable(self.trace, self.parallelism.tensor, self.parallelism.sequence_parallel)  # then the model
        check_expert_parallel(self.trace, self.parallelism.expert)
        check_context_parallel(self.trace, self.parallelism.context, self.parallelism.context_attention,
                               self.parallelism.tensor)
        if self.cluster is not None or self.servers != 1:
            self._check_cluster()
        elif self.parallelism.hsdp:
            raise MpsimError("HSDP shards inside a server and replicates across servers: give a cluster")
        check_schedule(self.schedule, self.n_stages, self.microbatches)
        par = self.parallelism
        if par.virtual_stages > 1:
            self._check_interleaved()
        elif self.n_stages > self.trace.n_layers:  # a stage needs a layer (the partition's rule, said here once)
            raise MpsimError(f"cannot split {self.trace.n_layers} layers into {self.n_stages} non-empty stages: use at "
                             f"most {self.trace.n_layers} stages")
        if self.schedule == "pipedream" and (par.stage_gpus > 1 or par.zero_stage):
            raise MpsimError(f"{par.describe(self.n_stages)} with pipedream: not simulated yet (PipeDream updates "
                             "every microbatch); use gpipe or 1f1b")
        check_partition(self.partition)
        check_strategy(self.strategy)

    def _check_cluster(self) -> None:
        """A cluster job fills ``servers`` whole servers of the cluster's type, tensor groups
        inside a server (``cluster_placement.place_on_cluster``), one line each."""
        cluster = self.cluster
        if cluster is None:
            raise MpsimError(f"{self.servers} servers need a cluster (--cluster) to say how they are joined")
        if self.topology.content_hash != cluster.server.content_hash:
            raise MpsimError(f"the cluster {cluster.name} is made of {cluster.server.name}, not {self.topology.name}")
        if not 1 <= self.servers <= cluster.spec.max_servers:
            raise MpsimError(f"{cluster.name} has 1 to {cluster.spec.max_servers} servers, not {self.servers}")
        par = self.parallelism
        p = self.n_stages
        used, total = par.stage_gpus * p, self.servers * self.topology.n_gpus
        if used != total:
            raise MpsimError(f"{self.layout_name} uses {used} GPUs but {self.servers} x {self.topology.name} have "
                             f"{total}: a cluster job fills its servers")
        placed = place_on_cluster(self.topology.n_gpus, par.mesh(p))
        if par.hsdp and placed.across == 1:
            raise MpsimError(f"HSDP x{par.data} stays inside one server: use FSDP (zero stage 3)")

    def _check_interleaved(self) -> None:
        """Interleaved 1F1B (``virtual_stages`` > 1): Megatron-LM's rules, one line each."""
        if self.schedule != "1f1b":
            raise MpsimError(f"virtual stages run the interleaved 1F1B schedule; use --schedule 1f1b, not "
                             f"{self.schedule}")
        if self.partition != "compute":
            raise MpsimError("virtual stages are partitioned by compute time; the memory-balanced partition does "
                             "not model interleaved 1F1B's held microbatches")
        check_interleaved(self.n_stages, self.parallelism.virtual_stages, self.microbatches)
        if self.model_stages > self.trace.n_layers:
            raise MpsimError(f"{self.n_stages} stages x {self.parallelism.virtual_stages} virtual stages need "
                             f"{self.model_stages} layers but {self.trace.name} has {self.trace.n_layers}")

    @property
    def n_stages(self) -> int:
        """Pipeline stages, one GPU (or tensor-parallel group) each, per replica."""
        return self.parallelism.stages_on(self.topology, self.servers)

    @property
    def model_stages(self) -> int:
        """Pieces the model is cut into: the stages times the virtual stages per GPU."""
        return self.n_stages * self.parallelism.virtual_stages

    @property
    def microbatch(self) -> int:
        return self.trace.microbatch

    @property
    def samples_per_iteration(self) -> int:
        """Samples one iteration trains, over every data-parallel replica."""
        return self.parallelism.sample_ways * self.microbatches * self.microbatch

    @property
    def n_gpus(self) -> int:
        """GPUs the job may use: the server's, or every GPU of its servers."""
        return self.topology.n_gpus * self.servers

    @property
    def gpus_used(self) -> int:
        """GPUs the layout uses: its mesh's size (``n_gpus`` or fewer, when the layout's
        pipeline depth was given: ``--stages 4`` on 8 GPUs)."""
        return self.parallelism.stage_gpus * self.n_stages

    @property
    def where(self) -> str:
        """``dgx-h100``, or ``64 x dgx-h100 (dgx-h100-superpod)``."""
        if self.cluster is None:
            return self.topology.name
        return f"{self.servers} x {self.topology.name} ({self.cluster.name})"

    @property
    def layout_name(self) -> str:
        """``DDP x8``, ``FSDP x2 x pipeline x4``, ``pipeline x8`` (``Parallelism.describe``)."""
        return self.parallelism.describe(self.n_stages)

    def but(self, **changes: object) -> JobSpec:
        """The same job with some fields changed (checked again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


class OfJob:
    """Read-through fields for a type that holds a ``job`` (a planner's context, the
    engine's layout, a ``fits`` report): it reads the job's fields instead of declaring
    them again."""

    job: JobSpec

    @property
    def topology(self) -> Topology:
        return self.job.topology

    @property
    def trace(self) -> Trace:
        return self.job.trace

    @property
    def schedule(self) -> str:
        return self.job.schedule

    @property
    def microbatch(self) -> int:
        return self.job.microbatch

    @property
    def microbatches(self) -> int:
        return self.job.microbatches

    @property
    def partition(self) -> str:
        return self.job.partition

    @property
    def record_link_rates(self) -> bool:
        return self.job.record_link_rates


def with_stages(parallelism: Parallelism, n_stages: int | None) -> Parallelism:
    """``parallelism`` with a pipeline of ``n_stages`` where it names none; a layout that
    names its depth keeps it (``ddp2xpp2`` stays two stages), and a different
    ``n_stages`` beside it is refused in one line."""
    if n_stages is None:
        return parallelism
    if parallelism.pipeline is None:
        return parallelism.model_copy(update={"pipeline": pipeline(n_stages).pipeline})
    if parallelism.pipeline != n_stages:
        raise MpsimError(f"the layout {parallelism.describe(parallelism.pipeline)} has {parallelism.pipeline} "
                         f"stage(s) but {n_stages} were asked for: leave the stage count out or make them agree")
    return parallelism


def job_of(server: str | Topology | None, model: str | Trace, *, schedule: str = DEFAULT_SCHEDULE,
           microbatch: int | None = None, microbatches: int = DEFAULT_MICROBATCHES, n_stages: int | None = None,
           strategy: str = "none", partition: str = "compute", record_link_rates: bool = False,
           parallelism: Parallelism | None = None, cluster: str | Cluster | None = None,
           servers: int = 1, runtime_profile: str = DEFAULT_PROFILE, expert_load: ExpertLoad = UNIFORM) -> JobSpec:
    """A job from names or loaded objects: ``microbatch`` rescales the trace (None keeps the
    traced size); ``n_stages`` None means one stage per GPU of each replica;
    ``parallelism`` the layout (``n_stages`` sets its pipeline's depth where the layout
    leaves it open, and may not contradict it: ``with_stages``); ``cluster``
    and ``servers``: that many of the cluster's servers (``server`` None: the cluster's);
    ``runtime_profile``: the framework's run-time rules (``mpsim.timing.runtime``);
    ``expert_load``: how a mixture of experts routes its tokens (``mpsim.models.expert_parallel``)."""
    from mpsim.data.catalog import (  # here: `mpsim --help` reads the defaults only
        load_cluster,
        load_topology,
        load_trace,
    )

    joined = load_cluster(cluster) if isinstance(cluster, str) else cluster
    if server is None:
        server = joined.server if joined is not None else DEFAULT_SERVER
    topo = load_topology(server) if isinstance(server, str) else server
    trace = load_trace(model) if isinstance(model, str) else model
    if microbatch is not None:
        trace = trace.rescale(microbatch)  # checks it (check_microbatch)
    layout = pipeline(n_stages) if parallelism is None else with_stages(parallelism, n_stages)
    return JobSpec(topo, trace, schedule, microbatches, layout, partition, strategy, record_link_rates, joined,
                   servers, runtime_profile, expert_load)
