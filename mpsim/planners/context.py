"""What every planner shares: the job it plans (``Ctx``), its answer (``Planned``), and
the first step of the swap planners (simulate keeping everything, read live intervals)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from mpsim.caches import Lru
from mpsim.hardware.topology import Topology
from mpsim.models.trace import LayerRow, Trace
from mpsim.planners.liveness import live_intervals
from mpsim.planners.mcap import held_microbatches, mcap_partition
from mpsim.plans.job import JobSpec, OfJob
from mpsim.plans.partition import Stages, compute_balanced
from mpsim.plans.plan import Checkpoints, LayerAction, PlanFile, SwapTiming, make_plan
from mpsim.sim import SimResult, simulate_layout
from mpsim.sim.layout import Laid, OnLaid, data_parallel_plan, lay, layout_of_plan, mesh_plan, tensor_parallel_plan
from mpsim.sim.program import Sharding
from mpsim.timing.costs import cost_model

MAX_ROUNDS = 64
SIMULATIONS = 64
"""Simulated plans remembered per process (``Ctx.simulate``): ``best`` runs every planner
under both partitions, and they simulate many of the same plans (keep everything first,
the same swaps); a run is deterministic, so a plan's result is reused, not recomputed."""
_SIMULATED: Lru[tuple[object, ...], SimResult] = Lru(SIMULATIONS)


@dataclass
class Planned:
    plan: PlanFile
    result: SimResult
    simulations: int = 1


@dataclass(frozen=True)
class Ctx(OfJob, OnLaid):
    """A job with its partition made: what a planner plans."""

    job: JobSpec
    stages: Stages
    gpus: list[int]
    """The GPU of each stage (stage i on GPU i until a planner maps them)."""
    laid: Laid = field(default_factory=lambda: Laid())
    """The job on its hardware (``sim.layout.lay``), handed to every layout this context
    simulates (``simulate``): replicas, tensor groups, the shard, a cluster's view."""

    @property
    def topo(self) -> Topology:
        return self.view if self.view is not None else self.job.topology

    @property
    def trace(self) -> Trace:
        """The trace one GPU of a stage runs (its tensor-parallel shard, if any): what the
        planners size and time."""
        return self.shard if self.shard is not None else self.job.trace

    @property
    def replicated(self) -> bool:
        """Whether the job runs on more GPUs than one a stage (replicas or tensor groups);
        its mapping is then not searched."""
        return len(self.replicas) > 1 or bool(self.tp_groups) or self.job.parallelism.virtual_stages > 1

    def spare(self, result: SimResult, margin: float = 1.0) -> dict[int, float]:
        """Bytes each GPU could take from other GPUs' swaps (capacity over the peak, times
        ``margin``); a replicated pipeline's replicas (and tensor-parallel ranks) need their
        own room, so only GPUs it does not run on have any."""
        busy = self._busy_gpus()
        return {g.gpu: 0.0 if g.gpu in busy else max(0.0, (g.capacity_bytes - g.peak_bytes) * margin)
                for g in result.gpus}

    def _busy_gpus(self) -> set[int]:
        """The GPUs of the replicas and tensor-parallel groups (none for one replica without them)."""
        return {g for r in self.replicas for g in r} | {g for r in self.tp_groups for grp in r for g in grp}

    @property
    def may_lend(self) -> bool:
        """Whether any GPU may take other GPUs' swaps: one that ``spare`` can give room on,
        outside the replicas and tensor groups. False when they cover the whole server: every
        plan's spare memory is then zero, so no D2D swap is possible."""
        busy = self._busy_gpus()
        return any(g not in busy for g in range(self.topo.n_gpus))

    def plan(self, strategy: str, actions: dict[int, list[LayerAction]] | None = None,
             optimizer: dict[int, str] | None = None, stash: dict[int, str] | None = None,
             swap_timing: SwapTiming = "prefetch", optimizer_layers: dict[int, list[int]] | None = None,
             recompute_checkpoints: Checkpoints = "layer", offload_params: bool = False,
             offload_device: Literal["host", "nvme"] = "host") -> PlanFile:
        dp = data_parallel_plan(self.job.parallelism, self.replicas or (tuple(self.gpus),), offload_params,
                                offload_device)
        tp = tensor_parallel_plan(self.job.parallelism, self.tp_groups)
        mesh = mesh_plan(self.job.parallelism, self.job.n_stages)
        return make_plan(self.trace, self.topo, self.schedule, self.microbatches, self.stages, self.gpus, strategy,
                         actions, optimizer, stash, swap_timing, optimizer_layers, recompute_checkpoints, dp, tp,
                         self.job.parallelism.virtual_stages, mesh)

    def simulation_key(self, plan: PlanFile) -> tuple[object, ...]:
        """What a simulated plan's result depends on beyond the plan's own JSON: the server
        and the cluster (with how many servers), the trace, the whole layout (HSDP and
        every mesh axis, which a schema 2-3 plan does not say), the runtime profile, the expert load and
        whether link rates are recorded."""
        job = self.job
        cluster = None if job.cluster is None else (job.cluster.content_hash, job.servers)
        return (self.topo.content_hash, cluster, self.trace.content_hash, self.record_link_rates,
                job.parallelism.model_dump_json(), job.runtime_profile, job.expert_load,
                plan.model_dump_json(exclude={"strategy"}))

    def simulate(self, plan: PlanFile) -> SimResult:
        """Simulate a plan this context made (``make_plan`` output is valid by construction,
        so it is not checked again). A plan simulated before in this process, by any
        planner, is not simulated again (``SIMULATIONS``)."""
        key = self.simulation_key(plan)
        result = _SIMULATED.remember(key, lambda: simulate_layout(
            layout_of_plan(plan, self.job, checked=True, laid=self.laid)))
        return result if result.strategy == plan.strategy else replace(result, strategy=plan.strategy)

    def optimizer_bytes(self, row: LayerRow) -> int:
        """Bytes of ``row``'s optimizer states one GPU holds: its shard under ZeRO-1 and up
        (``Parallelism.optimizer_shards``; rounded up, as the engine's ``Updater`` shards)."""
        par = self.job.parallelism
        if par.expert > 1 and par.zero_stage:  # the dense part over data x expert, the experts' over data
            return Sharding(par.shard_ways(self.across), par.zero_stage,
                            expert_replicas=par.expert_shard_ways()).optimizer_share(row)
        return -(-row.optimizer_bytes // par.optimizer_shards(self.across))

    def held_microbatches(self, s: int) -> int:
        """Microbatches whose activations stage s holds at once (the schedule's bound)."""
        return held_microbatches(self.schedule, s, len(self.stages), self.microbatches)


def make_context(job: JobSpec, keeps: str = "keep") -> Ctx:
    """The job with its partition: ``compute`` balances per-stage compute time (PipeDream,
    DAPPLE), ``memory`` the predicted per-GPU peak (mCAP), predicted as the strategy
    ``keeps`` its activations (``recompute``: every recomputable layer checkpointed,
    ``trace.RECOMPUTABLE``; ``selective``: every attention core recomputed). Stage i on GPU i,
    or with data parallelism where ``place_replicas`` puts replica 0."""
    p = job.model_stages
    laid = lay(job)
    trace = laid.shard or job.trace
    if job.partition == "compute":
        times = cost_model(trace, job.topology.spec.gpu).layer_times
        stages = compute_balanced(times.fwd_s + times.bwd_s, p)
    else:
        stages = mcap_partition(trace, job.schedule, p, job.microbatches, keeps == "recompute",
                                keeps == "selective")
    return Ctx(job, list(stages), list(laid.first), laid)


def over(result: SimResult, gpu: int) -> int:
    """Bytes by which ``gpu``'s peak exceeds its capacity (negative: room left)."""
    g = result.gpus[gpu]
    return g.peak_bytes - g.capacity_bytes


def keep_first(ctx: Ctx, strategy: str) -> tuple[Planned, dict[int, float]]:
    """The plan that keeps everything, simulated, and the live intervals it shows."""
    plan = ctx.plan(strategy)
    result = ctx.simulate(plan)
    return Planned(plan, result), live_intervals(result, cost_model(ctx.trace, ctx.topo.spec.gpu).layer_times)
