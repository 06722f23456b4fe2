"""The SimPy model of one pipeline-parallel training job on one server, wired from its
components (in the manner of desmod and ns.py: a class per physical thing, its process a
method):

- ``ComputeStream`` (``stream``): a stage's tasks on its GPU's compute stream;
- ``Swapper`` (``swapper``): swaps to the host and to peer GPUs, stashes, streamed
  optimizer states;
- ``PeerChannels`` (``channels``): activations and gradients between stages;
- ``Updater`` (``update``): the optimizer step where the plan puts the states;
- ``DeviceMemory`` (``memory``): the one owner of each GPU's and the host's memory;
- ``Network`` and ``CopyEngines``: links shared max-min fairly, DMA engines.

The engine's only input is a resolved, checked ``Layout`` (``layout``); ``simulate_job``
resolves a ``Job`` first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mpsim.caches import Lru
from mpsim.models.expert_parallel import busiest_times, experts_line, shard_info
from mpsim.models.finetune import trainable_share
from mpsim.models.trace import LayerRow, Trace
from mpsim.plans.mesh import layout_name
from mpsim.plans.schedule import PIPEDREAM_MEASURED, interleaved_turn_orders, weight_versions
from mpsim.sim.channels import PeerChannels
from mpsim.sim.context import RunContext
from mpsim.sim.context_group import ContextGroup
from mpsim.sim.data_parallel import DataParallel
from mpsim.sim.expert_group import ExpertGroup
from mpsim.sim.layer_groups import LayerGroups
from mpsim.sim.layout import Job, Layout, resolve
from mpsim.sim.memory import CATEGORIES, GpuMemory
from mpsim.sim.program import NOT_SHARDED, Sharding, StageProgram, SwapIn, build_program, received_bytes, static_bytes
from mpsim.sim.result import GpuResult, SimResult
from mpsim.sim.simpy_fast import Detached, gc_paused, run_until_empty
from mpsim.sim.stream import ComputeStream
from mpsim.sim.swapper import STASH, Swapper
from mpsim.sim.tensor_group import TensorGroup
from mpsim.sim.turns import GpuTurns
from mpsim.sim.update import Updater
from mpsim.timing.costs import CostModel, LayerTimes, cost_model
from mpsim.timing.runtime import RuntimeProfile, dispatch_bound, profile_named

__all__ = ["Job", "Layout", "simulate_job", "simulate_layout"]

PROGRAMS = 256
"""Stage programs remembered per process (``_stage_program``)."""
_PROGRAMS: Lru[tuple[object, ...], StageProgram] = Lru(PROGRAMS)


@dataclass
class _StageRun:
    program: StageProgram
    stream: ComputeStream
    updater: Updater


def simulate_job(job: Job) -> SimResult:
    """Check and resolve a job, then simulate it (fits or not; see ``SimResult``)."""
    return simulate_layout(resolve(job))


def simulate_layout(layout: Layout) -> SimResult:
    """Simulate one checked layout and return its result: with the cyclic garbage
    collector paused until the run's own objects are freed (``simpy_fast.gc_paused``)."""
    with gc_paused():
        return _simulate(layout)


def _simulate(layout: Layout) -> SimResult:
    """``simulate_layout``'s work."""
    run = RunContext(layout)
    channels = PeerChannels(run)
    costs = cost_model(layout.trace, run.topo.spec.gpu)
    sharding = sharding_of(layout)
    v = layout.parallelism.virtual_stages
    turns = (GpuTurns(run.env, interleaved_turn_orders(layout.n_stages // v, v, layout.microbatches))
             if v > 1 else None)
    stages = [_build_stage(run, s, channels, costs, sharding, turns) for s in range(layout.n_stages)]
    streams = [Detached(run.env, st.stream.process()) for st in stages]  # nobody waits on a stream's end
    run_until_empty(run.env)
    stuck = [s for s, stream in enumerate(streams) if stream.alive]
    if stuck:  # an engine bug, never a result: say so instead of returning a silent stall
        raise RuntimeError(f"simulation stalled at {run.env.now:.6f} s with stages {stuck} unfinished")
    if layout.schedule == "pipedream":
        start_s, end_s = _measured_window(stages[0].updater, layout.microbatches)
        result = _result(run, stages, end_s - start_s)
    else:
        result = _result(run, stages, run.env.now)
    result.time_band_pct, result.time_band_source = costs.time_band()
    result.runtime_profile = layout.job.runtime_profile
    result.experts = experts_line(layout.job.trace, layout.parallelism.expert, layout.job.expert_load)
    return result


def _measured_window(updater: Updater, microbatches: int) -> tuple[float, float]:
    """PipeDream's measured iteration on a stage: from the end of its last update of the
    iteration before (``PIPEDREAM_MEASURED``) to the end of the measured one's last."""
    ends = updater.ends_s[microbatches - 1 :: microbatches]
    return ends[PIPEDREAM_MEASURED - 1], ends[PIPEDREAM_MEASURED]


def _stage_program(run: RunContext, s: int, costs: CostModel, sharding: Sharding | None) -> StageProgram:
    """Stage ``s``'s program (``build_program``) under the job's runtime profile (its host
    dispatch bound on each pass, its overlap of tensor-parallel collectives), or the one
    built before in this process for the same trace, server, layers, place in the
    pipeline, runtime, profile and actions: a
    program depends on nothing else, and planners simulate many plans that change the
    actions of a few stages only (``PROGRAMS``)."""
    layout = run.layout
    a, b = layout.stages[s]
    first, last = s == 0, s == layout.n_stages - 1
    actions = layout.actions[s]
    segments = layout.recompute_checkpoints == "segment"
    tensor_parallel = layout.parallelism.tensor > 1 or layout.parallelism.context > 1  # layers communicate
    expert_parallel, load_factor = shard_info(layout.trace)
    profile = profile_named(layout.job.runtime_profile)
    key = (layout.trace.content_hash, run.topo.content_hash, a, b, first, last, run.torch_pipelining, segments,
           sharding, tensor_parallel, profile.name, tuple((j, actions[j].model_dump_json()) for j in sorted(actions)))
    program = _PROGRAMS.get(key)
    if program is not None:
        return program
    rows, times = layout.trace.layers[a:b], costs.layer_times
    fwd_s = dispatch_bound(busiest_times(times.fwd_s[a:b], rows, load_factor, False), times.launches_fwd[a:b], profile)
    bwd_s = dispatch_bound(busiest_times(times.bwd_s[a:b], rows, load_factor, True), times.launches_bwd[a:b], profile)
    overlap = _hidden_behind(layout, rows, times, a, b, profile)
    return _PROGRAMS.put(key, build_program(rows, fwd_s, bwd_s, a, first, last, actions, run.torch_pipelining,
                                            costs.attention_core_s[a:b], segments, sharding, tensor_parallel,
                                            overlap, expert_parallel > 1))


def _overlaps_others(layout: Layout, profile: RuntimeProfile) -> bool:
    """Whether the runtime overlaps the layers' tensor- or expert-parallel communication with GEMMs."""
    expert_parallel, _ = shard_info(layout.trace)
    return bool((profile.tp_comm_overlap and layout.parallelism.tensor > 1)
                or (profile.ep_comm_overlap and expert_parallel > 1))


def _hidden_behind(layout: Layout, rows: list[LayerRow], times: LayerTimes, a: int, b: int,
                   profile: RuntimeProfile) -> tuple[np.ndarray, np.ndarray] | None:
    """Per layer of ``rows`` (model layers a..b), the forward's and the backward's compute
    seconds its collectives may run beside: its GEMMs' under a runtime that overlaps them,
    plus, for a ring attention's sends, the last (c-1)/c of its attention
    (``mpsim.sim.context_group``); None when nothing overlaps."""
    gemm = _overlaps_others(layout, profile)
    steps = [next((c.steps for c in r.fwd_collectives if c.axis == "context" and c.op == "send-recv"), 0)
             for r in rows]
    shares = np.array([k / (k + 1) for k in steps])
    if not gemm and not shares.any():
        return None
    zero = np.zeros(b - a)
    fwd = (times.gemm_fwd_s[a:b] if gemm else zero) + shares * times.attention_fwd_s[a:b]
    bwd = (times.gemm_bwd_s[a:b] if gemm else zero) + shares * times.attention_bwd_s[a:b]
    return fwd, bwd


def sharding_of(layout: Layout) -> Sharding | None:
    """The layout's data parallelism as a stage program sees it; None for one GPU per
    stage without ZeRO (the program then has no gradient hand-off at all)."""
    par = layout.parallelism
    if par.replicas == 1 and par.zero_stage == 0:
        return None
    offload_grads = par.zero_stage >= 2 and bool(layout.host_optimizer) and all(
        opt == "host-update" and len(on_host) == b - a
        for opt, on_host, (a, b) in zip(layout.optimizer, layout.host_optimizer, layout.stages))
    return Sharding(layout.shard_ways, par.zero_stage, par.reshard_after_forward, layout.offload_params,
                    offload_grads, par.expert_shard_ways() if par.expert > 1 else 0)


def _build_stage(run: RunContext, s: int, channels: PeerChannels, costs: CostModel,
                 sharding: Sharding | None, turns: GpuTurns | None = None) -> _StageRun:
    """A stage's program, its static memory (allocated before the first task) and its
    components."""
    layout = run.layout
    a, b = layout.stages[s]
    rows = layout.trace.layers[a:b]
    first, last = s == 0, s == layout.n_stages - 1
    program = _stage_program(run, s, costs, sharding)
    received = layout.microbatches * received_bytes(rows, first, last) if run.torch_pipelining else 0
    versions = weight_versions(layout.schedule, s, layout.n_stages)
    static = static_bytes(rows, versions, received, sharding or NOT_SHARDED,
                          layout.trace.spec.precision.weight_cache_bytes_per_param)
    _allocate_static(run, s, static, sharding)
    swapper = Swapper(run, s, {j: act.split for j, act in program.actions.items()},
                      {j: tuple((x.gpu, x.fraction) for x in act.peers) for j, act in program.actions.items()})
    shards: float = layout.parallelism.optimizer_shards(layout.across)
    if sharding is not None and sharding.expert_replicas and sharding.zero_stage:  # the experts' own ways
        owned = sum(sharding.optimizer_share(r) for r in rows)
        shards = sum(r.optimizer_bytes for r in rows) / owned if owned else shards
    updater = Updater(run, s, swapper, costs, shards, sharding is not None and sharding.offload_grads)
    stash_in = None
    if layout.stash[s] == "host" and versions > 1:
        stash_in = SwapIn(STASH, static["params"], 0, "stash", "host", (), 1, 0.0)
    dp = DataParallel(run, s, sharding) if sharding is not None else None
    par = layout.parallelism
    tp = None
    if par.tensor > 1 or par.expert > 1 or par.context > 1:
        tp = LayerGroups(TensorGroup(run, layout.tensor_group(s)) if par.tensor > 1 else None,
                         ExpertGroup(run, *layout.expert_group(s)) if par.expert > 1 else None,
                         ContextGroup(run, *layout.context_group(s)) if par.context > 1 else None,
                         _overlaps_others(layout, profile_named(layout.job.runtime_profile)))
    stream = ComputeStream(run, s, program, swapper, updater, channels, stash_in, dp, tp, turns)
    return _StageRun(program, stream, updater)


def _allocate_static(run: RunContext, s: int, static: dict[str, int], sharding: Sharding | None) -> None:
    """Weights, gradients, optimizer states, stashes and preallocated buffers at time 0;
    what the plan keeps on the host goes to host memory and the GPU's ledger (this GPU's
    shard of it under ZeRO)."""
    layout, g = run.layout, run.layout.gpu_of[s]
    rows = layout.trace.layers
    on_host = sum(rows[j].optimizer_bytes for j in layout.host_optimizer[s])
    if sharding is not None and sharding.zero_stage >= 1:
        on_host = sharding.shard(on_host)
    if sharding is not None and sharding.offload_grads:  # the gradient shards live with the optimizer
        a, b = layout.stages[s]
        grads = sharding.shard(sum(r.grad_bytes for r in rows[a:b]))
        run.offload.change([(grads, "grads", f"stage {s} gradient shards in host memory")])
    moved = {"optimizer": on_host, "stash": static["stash"] if layout.stash[s] == "host" else 0,
             "params": static["params"] if layout.offload_params else 0}
    for cat, n in static.items():
        on_host = moved.get(cat, 0)
        if on_host:
            target = run.host if cat == "stash" else run.offload
            where = "host memory" if target is run.host else "NVMe"
            target.change([(on_host, cat, f"stage {s} {cat} in {where}")])
            if cat != "params":  # the ledger counts what techniques keep off the GPU; offloaded shards are ZeRO's
                run.memory[g].change([(on_host, f"saved:{cat}", f"stage {s} {cat} kept off the GPU")])
        if n - on_host:
            run.memory[g].change([(n - on_host, cat, f"stage {s} {cat} (allocated before the first task)")])


def _result(run: RunContext, stages: list[_StageRun], iteration_s: float) -> SimResult:
    layout, topo, trace, m = run.layout, run.topo, run.layout.job.trace, run.layout.microbatches
    replicas, samples = layout.parallelism.replicas, layout.parallelism.sample_ways
    analyses = [run.log.analyse(g, topo.capacity_bytes) for g in range(topo.n_gpus)]
    gpus = _replicated([_gpu_result(run, stages, g, analyses[g]) for g in range(topo.n_gpus)], layout)
    ooms = [a.oom for a in analyses if a.oom]
    host = run.log.analyse(topo.n_gpus, run.host_share_bytes)
    if host.oom:
        ooms.append(dict(host.oom, gpu="host"))
    nvme = run.log.analyse(topo.n_gpus + 1, run.nvme_share_bytes)
    if nvme.oom:
        ooms.append(dict(nvme.oom, gpu="nvme"))
    oom = min(ooms, key=lambda o: (o["time_s"], str(o["gpu"]))) if ooms else None
    busy_s = run.net.busy_s_by_link
    links = {name: {"bytes": int(n), "busy_s": busy_s.get(name, 0.0)}
             for name, n in sorted(run.net.bytes_by_link.items())}
    return SimResult(
        server=layout.job.where, model=trace.name, schedule=layout.schedule, strategy=layout.label,
        microbatch=trace.microbatch, microbatches=m, stages=list(layout.stages), gpu_of_stage=list(layout.gpu_of),
        iteration_s=iteration_s, samples_per_s=samples * m * trace.microbatch / iteration_s,
        model_tflops=trace.model_flops_total * m * samples / iteration_s / 1e12,
        gpus=gpus, oom=oom, links=links, spans=run.spans, makespan_s=run.env.now, sim_events=run.events_scheduled(),
        host_peak_bytes=host.peak_bytes * run.replicas // run.servers, host_capacity_bytes=topo.host_memory_bytes,
        host_memory_times_s=host.times_s, host_memory_used_bytes=host.used_bytes * run.replicas // run.servers,
        link_rates=run.net.rate_log, layout=layout.job.layout_name,
        mesh=layout_name(layout.job.parallelism, layout.job.n_stages), replicas=replicas,
        gpus_used=layout.job.gpus_used, gpus_available=layout.job.n_gpus,
        framework=str(trace.spec.model.get("framework", "")), family=str(trace.spec.model.get("family", "")),
        seq_len=trace.seq_len, fine_tune=fine_tune_of(trace), trainable=trainable_of(trace),
    )


def fine_tune_of(trace: Trace) -> str:
    """A fine-tune's adapters (``FineTune.describe``); empty when every parameter trains."""
    return "" if trace.spec.finetune is None else trace.spec.finetune.describe()


def trainable_of(trace: Trace) -> str:
    """A fine-tune's trainable and total parameters, as PEFT prints them; empty otherwise."""
    return "" if trace.spec.finetune is None else trainable_share(trace.trained_params, trace.spec.params)


def _replicated(gpus: list[GpuResult], layout: Layout) -> list[GpuResult]:
    """Every replica's GPUs as replica 0's, every GPU of a tensor-parallel group as the
    group's first (replicas and tensor ranks are symmetric: ``data_parallel``,
    ``tensor_group``)."""
    pairs = {(g, layout.gpu_of[s]) for replica in layout.replicas[1:] for s, g in enumerate(replica)}
    pairs |= {(g, layout.gpu_of[s]) for groups in layout.tp_groups for s, group in enumerate(groups)
              for g in group[1:]}
    for g, simulated in sorted(pairs):
        gpus[g] = replace(gpus[simulated], gpu=g)
    return gpus


def _gpu_result(run: RunContext, stages: list[_StageRun], g: int, analysis: GpuMemory) -> GpuResult:
    """One GPU's peak, breakdown and series, and its costs and compute-stream busy time
    per iteration (PipeDream: those its stage paid within its own measured iteration).
    Under interleaved 1F1B the GPU runs several virtual stages: it is reported as its
    first, its busy time summed over all."""
    layout, topo = run.layout, run.topo
    own = [s for s, gpu in enumerate(layout.gpu_of) if gpu == g]
    s = own[0] if own else None
    window = None
    if s is not None and layout.schedule == "pipedream":
        window = _measured_window(stages[s].updater, layout.microbatches)
    costs = run.costs.total(g, window)
    busy_s = costs["optimizer_s"] if own else 0.0
    updates = layout.microbatches if layout.schedule == "pipedream" else 1
    for k in own:
        prog = stages[k].program
        busy_s += layout.microbatches * (prog.forward_s + prog.backward_s) + updates * stages[k].updater.gpu_update_s
    return GpuResult(
        gpu=g, stage=s, layers=None if s is None else layout.stages[s], peak_bytes=analysis.peak_bytes,
        capacity_bytes=topo.capacity_bytes, reserved_bytes=topo.reserved_bytes,
        breakdown={k: analysis.breakdown.get(k, 0) for k in CATEGORIES}, compute_s=busy_s,
        memory_times_s=analysis.times_s, memory_used_bytes=analysis.used_bytes,
        saved_at_peak=analysis.saved, costs_s=costs, compute_capability=topo.spec.gpu.compute_capability,
        nccl_peers=int(bool(layout.replicas or layout.tp_groups)),
    )
