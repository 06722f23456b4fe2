"""The SimPy model of one pipeline-parallel training job on one server.

One process per stage walks its task list (``mpsim.schedule``) on its GPU's compute
stream; the process is the stream, so tasks of a GPU never overlap. A stage's forward or
backward is one simulation event, its per-layer memory registered from a template
(``mpsim.sim.templates``). Activations and gradients cross stage boundaries as transfers
over the route between the two GPUs (``mpsim.sim.network``), on a per-peer channel that
keeps sends to one peer in order, as NCCL does, and on one of the sender's peer copy
engines (``mpsim.sim.copy_engine``); the receiver's buffer is allocated when the send
starts and the sender's freed when it lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from mpsim.errors import MpsimError
from mpsim.partition import Stages, compute_balanced, validate_stages
from mpsim.schedule import PIPEDREAM_MEASURED, check_schedule, stage_tasks, weight_versions
from mpsim.sim.copy_engine import CopyEngines
from mpsim.sim.memory import CATEGORIES, MemoryLog
from mpsim.sim.network import Network
from mpsim.sim.result import GpuResult, SimResult, Span
from mpsim.sim.templates import backward_template, forward_template, static_bytes, update_seconds
from mpsim.topology import Topology
from mpsim.trace import Trace


class _CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts the events it schedules (for benchmarks)."""

    scheduled = 0

    def schedule(self, event, priority=1, delay=0):  # type: ignore[no-untyped-def]
        self.scheduled += 1
        super().schedule(event, priority, delay)


@dataclass(frozen=True)
class Job:
    """What to simulate. ``trace`` is already at the wanted microbatch size."""

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


@dataclass
class _Run:
    env: simpy.Environment
    net: Network
    mem: MemoryLog
    spans: list[Span] = field(default_factory=list)
    events: dict[tuple[str, int, int], simpy.Event] = field(default_factory=dict)
    tails: dict[tuple[int, int], simpy.Event] = field(default_factory=dict)

    def arrival(self, kind: str, stage: int, mb: int) -> simpy.Event:
        key = (kind, stage, mb)
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = self.env.event()
        return ev


def _resolve_layout(job: Job, stage_cost: np.ndarray) -> tuple[Stages, tuple[int, ...]]:
    topo = job.topology
    if job.n_stages is not None:
        n_stages = job.n_stages
    else:
        n_stages = len(job.stages) if job.stages else topo.n_gpus
    if n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    if n_stages > topo.n_gpus:
        raise MpsimError(f"{n_stages} stages need {n_stages} GPUs but {topo.name} has {topo.n_gpus}")
    stages = job.stages or compute_balanced(stage_cost, n_stages)
    validate_stages(stages, job.trace.n_layers)
    if len(stages) != n_stages:
        raise MpsimError(f"the partition has {len(stages)} stages but {n_stages} were asked for")
    gpus = job.gpu_of_stage or tuple(range(n_stages))
    if len(gpus) != n_stages or len(set(gpus)) != n_stages or any(not 0 <= g < topo.n_gpus for g in gpus):
        raise MpsimError(f"the stage-to-GPU map {list(gpus)} must name {n_stages} distinct GPUs of 0..{topo.n_gpus - 1}")
    return stages, gpus


def simulate_job(job: Job) -> SimResult:
    """Simulate one job and return its result (fits or not; see ``SimResult``)."""
    topo, trace = job.topology, job.trace
    if job.strategy != "none":
        raise MpsimError(f"unknown strategy {job.strategy!r}: only 'none' exists in this release")
    gpu = topo.spec.gpu
    times = trace.layer_times(gpu)
    stages, gpu_of = _resolve_layout(job, times.fwd_s + times.bwd_s)
    p, m = len(stages), job.microbatches
    check_schedule(job.schedule, p, m)
    rows = trace.layers
    mem_rate = gpu.memory_bandwidth_gbps * 1e9 * gpu.memory_efficiency

    env = _CountingEnvironment()
    run = _Run(env, Network(env), MemoryLog(topo.n_gpus))
    engines = [CopyEngines(env, g, gpu.peer_copy_engines) for g in range(topo.n_gpus)]
    update_end: list[list[float]] = [[] for _ in range(p)]
    fwd_dur, bwd_dur, upd_dur = [], [], []
    for s, (a, b) in enumerate(stages):
        stage_rows = rows[a:b]
        for cat, n in static_bytes(stage_rows, weight_versions(job.schedule, s, p)).items():
            if n:
                run.mem.event(gpu_of[s], 0.0, n, cat, f"stage {s} {cat} (allocated before the first task)")
        fwd_dur.append(float(times.fwd_s[a:b].sum()))
        bwd_dur.append(float(times.bwd_s[a:b].sum()))
        upd_dur.append(update_seconds(stage_rows, mem_rate))

    def send(kind: str, src_stage: int, dst_stage: int, mb: int, n_bytes: int):  # type: ignore[no-untyped-def]
        src, dst = gpu_of[src_stage], gpu_of[dst_stage]
        done_prev = run.tails.get((src, dst))
        mine = env.event()
        run.tails[(src, dst)] = mine
        if done_prev is not None and not done_prev.processed:
            yield done_prev
        with engines[src].peer.request() as engine:
            yield engine
            start = env.now
            run.mem.event(dst, start, n_bytes, "buffers", f"{kind} of microbatch {mb} from stage {src_stage} (receive buffer)")
            yield run.net.transfer(topo.route(src, dst), n_bytes)
        run.mem.event(src, env.now, -n_bytes, "buffers", f"{kind} of microbatch {mb} sent to stage {dst_stage}")
        run.spans.append(Span(src, "copy", f"{kind} mb{mb} -> gpu{dst}", start, env.now))
        mine.succeed()
        run.arrival(kind, dst_stage, mb).succeed()

    def stage_process(s: int):  # type: ignore[no-untyped-def]
        a, b = stages[s]
        g = gpu_of[s]
        first, last = s == 0, s == p - 1
        tpl_f = forward_template(rows[a:b], times.fwd_s[a:b], a, first, last)
        tpl_b = backward_template(rows[a:b], times.bwd_s[a:b], a, first, last)
        out_bytes = rows[b - 1].output_bytes
        in_grad_bytes = rows[a].input_bytes
        # per task kind: (arrival to wait for, memory template, duration, send after it)
        compute = {
            "F": (None if first else "activation", tpl_f, fwd_dur[s],
                  None if last else ("activation", s + 1, out_bytes), "forward"),
            "B": (None if last else "gradient", tpl_b, bwd_dur[s],
                  None if first else ("gradient", s - 1, in_grad_bytes), "backward"),
        }
        for task in stage_tasks(job.schedule, s, p, m):
            mb = task.microbatch
            if task.kind == "U":
                start = env.now
                yield env.timeout(upd_dur[s])
                run.spans.append(Span(g, "compute", f"U{mb}", start, env.now))
                update_end[s].append(env.now)
                continue
            wait_for, template, duration, then_send, word = compute[task.kind]
            if wait_for:
                yield run.arrival(wait_for, s, mb)
            start = env.now
            run.mem.task(g, start, template, f"{word} of microbatch {mb} on stage {s}:")
            yield env.timeout(duration)
            run.spans.append(Span(g, "compute", f"{task.kind}{mb}", start, env.now))
            if then_send:
                kind, dst_stage, n_bytes = then_send
                env.process(send(kind, s, dst_stage, mb, n_bytes))

    for s in range(p):
        env.process(stage_process(s))
    env.run()

    if job.schedule == "pipedream":
        ends = update_end[0][m - 1 :: m]
        iteration_s = ends[PIPEDREAM_MEASURED] - ends[PIPEDREAM_MEASURED - 1]
    else:
        iteration_s = env.now
    return _result(job, run, stages, gpu_of, iteration_s, fwd_dur, bwd_dur, upd_dur)


def _result(job: Job, run: _Run, stages: Stages, gpu_of: tuple[int, ...], iteration_s: float,
            fwd_dur: list[float], bwd_dur: list[float], upd_dur: list[float]) -> SimResult:
    topo, trace, m = job.topology, job.trace, job.microbatches
    stage_of = {g: s for s, g in enumerate(gpu_of)}
    updates_per_iteration = m if job.schedule == "pipedream" else 1
    gpus: list[GpuResult] = []
    ooms = []
    for g in range(topo.n_gpus):
        analysis = run.mem.analyse(g, topo.capacity_bytes)
        s = stage_of.get(g)
        busy = 0.0 if s is None else m * (fwd_dur[s] + bwd_dur[s]) + updates_per_iteration * upd_dur[s]
        gpus.append(GpuResult(
            gpu=g, stage=s, layers=None if s is None else stages[s], peak_bytes=analysis.peak_bytes,
            capacity_bytes=topo.capacity_bytes, reserved_bytes=topo.reserved_bytes,
            breakdown={k: analysis.breakdown.get(k, 0) for k in CATEGORIES}, compute_s=busy,
            memory_times_s=analysis.times_s, memory_used_bytes=analysis.used_bytes,
        ))
        if analysis.oom:
            ooms.append(analysis.oom)
    oom = min(ooms, key=lambda o: (o["time_s"], o["gpu"])) if ooms else None
    links = {name: {"bytes": int(n), "busy_s": run.net.busy_s_by_link.get(name, 0.0)}
             for name, n in sorted(run.net.bytes_by_link.items())}
    return SimResult(
        server=topo.name, model=trace.name, schedule=job.schedule, strategy=job.strategy,
        microbatch=trace.microbatch, microbatches=m, stages=list(stages), gpu_of_stage=list(gpu_of),
        iteration_s=iteration_s, samples_per_s=m * trace.microbatch / iteration_s,
        model_tflops=3.0 * trace.fwd_flops_total * m / iteration_s / 1e12,
        gpus=gpus, oom=oom, links=links, spans=run.spans, makespan_s=run.env.now,
        sim_events=run.env.scheduled,  # type: ignore[attr-defined]
    )
