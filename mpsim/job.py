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
parallelism, and a pipeline (``mpsim.tensor_parallel``), plain or interleaved (virtual
stages, ``mpsim.schedule.interleaved_gpu_order``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpsim.cluster import Cluster, place_on_cluster
from mpsim.errors import MpsimError
from mpsim.schedule import check_interleaved, check_schedule
from mpsim.strategies import strategy_named
from mpsim.tensor_parallel import check_shardable
from mpsim.topology import Topology
from mpsim.trace import Trace

DEFAULT_SERVER = "dgx1-v100"
"""The server a command uses when none is named: MPress's DGX-1 (papers/mpress.txt IV-A)."""
DEFAULT_MODEL = "gpt-5.3b"
"""The model a command simulates, and a trace preset starts from, when none is named:
MPress's GPT-5.3B."""
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_MICROBATCHES = 16
"""Microbatches per iteration when none is given (the papers' pipelines run 16)."""
DEFAULT_BUCKET_MIB = 25.0
"""DDP's default gradient bucket (``bucket_cap_mb``)."""
DP_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}
"""How outputs name data parallelism by ZeRO stage (ZeRO-3 as PyTorch's FSDP runs it)."""
PARTITIONS: tuple[str, ...] = ("compute", "memory")
"""``compute``: stages balance compute time (PipeDream, DAPPLE); ``memory``: they balance
the predicted per-GPU peak (mCAP)."""

class Parallelism(BaseModel):
    """How the job's GPUs share the work. Degrees multiply to the GPUs used:
    ``data * tensor * pipeline``. Placement follows Megatron-LM's order: each stage's
    tensor-parallel group innermost, on the fastest links, then the data-parallel
    replicas, then the pipeline (``mpsim.sim.placement``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int = Field(default=1, ge=1, le=65536, description="data-parallel replicas (DDP, ZeRO, FSDP)")
    tensor: int = Field(default=1, ge=1, le=64, description="tensor-parallel degree (Megatron-LM column/row split)")
    sequence_parallel: bool = Field(default=False, description="with tensor > 1: norms and dropout split "
                                                               "along the sequence (Korthikanti et al. 2022)")
    pipeline: int | None = Field(default=None, ge=1, le=1024,
                                 description="pipeline stages; None: one per GPU of the server")
    virtual_stages: int = Field(default=1, ge=1, le=64, description="model chunks per GPU (interleaved 1F1B)")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=0, description="ZeRO stage: 1 shards optimizer states, "
                                                                   "2 also gradients, 3 also parameters")
    bucket_mib: float = Field(default=DEFAULT_BUCKET_MIB, gt=0, le=65536,
                              description="gradient bucket size of DDP and ZeRO-1/2, MiB")
    reshard_after_forward: bool = Field(default=True, description="ZeRO-3 / FSDP2: free gathered parameters "
                                                                  "after each unit's forward")
    hsdp: bool = Field(default=False, description="with ZeRO-3 on a cluster: shard inside each server, replicate "
                                                  "across servers (HSDP)")

    def unsupported(self) -> str | None:
        """What of this layout the engine cannot simulate, or None."""
        if self.sequence_parallel and self.tensor == 1:
            return ("sequence parallel splits what tensor parallelism replicates: it needs a tensor-parallel "
                    "degree of 2 or more")
        if self.hsdp and self.zero_stage != 3:
            return "HSDP shards parameters (ZeRO-3) inside a server and replicates them across: use zero stage 3"
        return None

    def shard_ways(self, across: int = 1) -> int:
        """GPUs a stage's sharded states are split over when its data-parallel group spans
        ``across`` servers: the group, or under HSDP its GPUs on one server."""
        return self.data // across if self.hsdp else self.data

    def optimizer_shards(self, across: int = 1) -> int:
        """Parts one GPU's optimizer states are split into: ``shard_ways`` from ZeRO-1 on
        (ZeRO, Rajbhandari et al. 2020, section 5.1: P_os), else 1."""
        return self.shard_ways(across) if self.zero_stage >= 1 else 1

    def stages_on(self, topo: Topology, servers: int = 1) -> int:
        """The pipeline depth on ``servers`` servers like ``topo``, checked: at least one
        stage, a tensor-parallel group of GPUs for each stage of each data-parallel replica
        (None: the GPUs left per replica)."""
        per_stage = self.data * self.tensor
        n_gpus = topo.n_gpus * servers
        p = max(1, n_gpus // per_stage) if self.pipeline is None else self.pipeline
        if p * per_stage > n_gpus:
            stages = f"{p} stage" + ("s" if p > 1 else "")
            what = stages if self.data == 1 else f"{self.data} replicas of {stages}"
            if self.tensor > 1:
                what += f" of {self.tensor} GPUs each"
            where = topo.name if servers == 1 else f"{servers} x {topo.name}"
            raise MpsimError(f"{what} need {p * per_stage} GPUs but {where} has {n_gpus}")
        return p

    def describe(self, n_stages: int) -> str:
        """The layout of ``n_stages`` as outputs name it: ``pipeline x4``, ``DDP x8``,
        ``ZeRO-2 x4 x pipeline x2``, ``FSDP x8`` (ZeRO-3), ``TP x8``, ``TP x4+SP x pipeline
        x2``, ``FSDP x2 x TP x4`` (Megatron-LM's order read outward: data, tensor, pipeline)."""
        parts = []
        if self.data > 1 or self.zero_stage:
            parts.append(f"{'HSDP' if self.hsdp else DP_NAMES[self.zero_stage]} x{self.data}")
        if self.tensor > 1:
            parts.append(f"TP x{self.tensor}" + ("+SP" if self.sequence_parallel else ""))
        if n_stages > 1 or not parts:
            parts.append(f"pipeline x{n_stages}" + (f" (interleaved x{self.virtual_stages})"
                                                    if self.virtual_stages > 1 else ""))
        return " x ".join(parts)


PIPELINE_ONLY = Parallelism()


def data_parallel(data: int, zero_stage: int = 0, n_stages: int | None = 1, **options: object) -> Parallelism:
    """``data`` replicas of a pipeline of ``n_stages`` (None: the GPUs left per replica),
    states sharded by ZeRO ``zero_stage``; refused in one line when out of range."""
    try:
        return Parallelism(data=data, zero_stage=zero_stage, pipeline=n_stages, **options)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise MpsimError(f"{where}: {err['msg']}, got {err.get('input')!r}") from None


def pipeline(n_stages: int | None) -> Parallelism:
    """A pure pipeline of ``n_stages`` (None: one stage per GPU), refused in one line when
    the count is not a positive number."""
    if n_stages is not None and n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    try:
        return Parallelism(pipeline=n_stages)
    except ValidationError as exc:
        raise MpsimError(f"stages: {exc.errors()[0]['msg']}, got {n_stages}") from None


def partitions_of(parallelism: Parallelism) -> tuple[str, ...]:
    """The partitions a search tries for a layout: both, or compute-balanced only under
    interleaved 1F1B (the memory-balanced one does not model its held microbatches) and
    with one stage (both put every layer on it: the same job twice)."""
    return ("compute",) if parallelism.virtual_stages > 1 or parallelism.pipeline == 1 else PARTITIONS


def check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise MpsimError(f"unknown partition {partition!r}: expected one of {', '.join(PARTITIONS)}")


def check_strategy(strategy: str) -> None:
    """The one check of a strategy name, against the registry (``mpsim.strategies``)."""
    strategy_named(strategy)


@dataclass(frozen=True)
class JobSpec:
    """One training job, checked on construction (one-line ``MpsimError`` on bad input).

    ``trace`` is already at the microbatch size the job runs (``Trace.rescale``)."""

    topology: Topology
    trace: Trace
    schedule: str = DEFAULT_SCHEDULE
    """``gpipe``, ``1f1b`` (DAPPLE) or ``pipedream`` (``mpsim.schedule``)."""
    microbatches: int = DEFAULT_MICROBATCHES
    """Microbatches per iteration (per pipeline, per data-parallel replica)."""
    parallelism: Parallelism = field(default=PIPELINE_ONLY)
    partition: str = "compute"
    """How layers are cut into stages (``PARTITIONS``)."""
    strategy: str = "none"
    """The memory-saving strategy that plans the job (``mpsim.strategies``)."""
    record_link_rates: bool = False
    """Keep every change of link rates (Chrome-trace counters); does not change results."""
    cluster: Cluster | None = None
    """Servers of ``topology``'s type joined by a fabric (``mpsim.cluster``); None: one server."""
    servers: int = 1
    """Servers the job fills, all of their GPUs (with a cluster)."""

    def __post_init__(self) -> None:
        why = self.parallelism.unsupported()
        if why is not None:
            raise MpsimError(why)
        if self.cluster is not None or self.servers != 1:
            self._check_cluster()
        elif self.parallelism.hsdp:
            raise MpsimError("HSDP shards inside a server and replicates across servers: give a cluster")
        check_schedule(self.schedule, self.n_stages, self.microbatches)
        par = self.parallelism
        if par.virtual_stages > 1:
            self._check_interleaved()
        if self.schedule == "pipedream" and (par.data > 1 or par.zero_stage or par.tensor > 1):
            raise MpsimError(f"{par.describe(self.n_stages)} with pipedream: not simulated yet (PipeDream updates "
                             "every microbatch); use gpipe or 1f1b")
        check_partition(self.partition)
        check_strategy(self.strategy)
        check_shardable(self.trace, par.tensor, par.sequence_parallel)

    def _check_cluster(self) -> None:
        """A cluster job fills ``servers`` whole servers of the cluster's type, tensor groups
        inside a server (``cluster.place_on_cluster``), one line each."""
        cluster = self.cluster
        if cluster is None:
            raise MpsimError(f"{self.servers} servers need a cluster (--cluster) to say how they are joined")
        if self.topology.content_hash != cluster.server.content_hash:
            raise MpsimError(f"the cluster {cluster.name} is made of {cluster.server.name}, not {self.topology.name}")
        if not 1 <= self.servers <= cluster.spec.max_servers:
            raise MpsimError(f"{cluster.name} has 1 to {cluster.spec.max_servers} servers, not {self.servers}")
        par = self.parallelism
        p = self.n_stages
        used, total = par.data * par.tensor * p, self.servers * self.topology.n_gpus
        if used != total:
            raise MpsimError(f"{self.layout_name} uses {used} GPUs but {self.servers} x {self.topology.name} have "
                             f"{total}: a cluster job fills its servers")
        placed = place_on_cluster(self.topology.n_gpus, par.data, par.tensor, p)
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
        return self.parallelism.data * self.microbatches * self.microbatch

    @property
    def n_gpus(self) -> int:
        """GPUs the job may use: the server's, or every GPU of its servers."""
        return self.topology.n_gpus * self.servers

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


def job_of(server: str | Topology | None, model: str | Trace, *, schedule: str = DEFAULT_SCHEDULE,
           microbatch: int | None = None, microbatches: int = DEFAULT_MICROBATCHES, n_stages: int | None = None,
           strategy: str = "none", partition: str = "compute", record_link_rates: bool = False,
           parallelism: Parallelism | None = None, cluster: str | Cluster | None = None,
           servers: int = 1) -> JobSpec:
    """A job from names or loaded objects: ``microbatch`` rescales the trace (None keeps the
    traced size); ``n_stages`` None means one stage per GPU of each replica;
    ``parallelism`` the data parallelism (its pipeline depth is ``n_stages``); ``cluster``
    and ``servers``: that many of the cluster's servers (``server`` None: the cluster's)."""
    from mpsim.catalog import load_cluster, load_topology, load_trace  # here: `mpsim --help` reads the defaults only

    joined = load_cluster(cluster) if isinstance(cluster, str) else cluster
    if server is None:
        server = joined.server if joined is not None else DEFAULT_SERVER
    topo = load_topology(server) if isinstance(server, str) else server
    trace = load_trace(model) if isinstance(model, str) else model
    if microbatch is not None:
        trace = trace.rescale(microbatch)  # checks it (check_microbatch)
    layout = pipeline(n_stages)
    if parallelism is not None:
        layout = parallelism.model_copy(update={"pipeline": layout.pipeline})
    return JobSpec(topo, trace, schedule, microbatches, layout, partition, strategy, record_link_rates, joined,
                   servers)
