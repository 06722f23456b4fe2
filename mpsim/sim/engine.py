"""The SimPy model of one pipeline-parallel training job on one server.

One process per stage walks its task list (``mpsim.schedule``) on its GPU's compute
stream; the process is the stream, so tasks of a GPU never overlap. A stage's forward or
backward runs as a few pieces (``mpsim.sim.program``), each one simulation event with a
memory template; a piece waits for room when its highest point does not fit and a free
is under way on its GPU (``LiveMemory``). Activations and gradients cross stage
boundaries as transfers over the route between the two GPUs (``mpsim.sim.network``), on
a per-peer channel that keeps sends to one peer in order, as NCCL does, and on one of
the sender's peer copy engines; the receiver's buffer is allocated when the send starts
and the sender's freed when it lands.

Swaps (``swap_out``/``swap_in`` below) run on copy engines and share links with
everything else. A swap-in is prefetched when the task before the backward that needs it
starts, timed to land when that backward reaches the layer if the copy ran alone on an
idle route (under ``Job.runtime = "torch-pipelining"``, re-timed from the gradient's
arrival when the gradient comes later); it waits for room while frees are under way (swap-outs in flight, or a running piece that
releases memory), and a backward that finds it late waits: that wait is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import simpy

from mpsim.errors import MpsimError
from mpsim.partition import Stages, compute_balanced, validate_stages
from mpsim.plan import LayerAction, PlanFile, check_plan
from mpsim.schedule import PIPEDREAM_ITERATIONS, PIPEDREAM_MEASURED, check_schedule, stage_tasks, weight_versions
from mpsim.sim.copy_engine import CopyEngines
from mpsim.sim.memory import CATEGORIES, LiveMemory, MemoryLog
from mpsim.sim.network import Network
from mpsim.sim.program import (StageProgram, SwapIn, SwapOut, build_program, received_bytes, static_bytes,
                               update_seconds)
from mpsim.sim.result import COSTS, GpuResult, SimResult, Span
from mpsim.topology import HOST, Topology
from mpsim.trace import Trace

STASH = -1
"""Pseudo-layer of a PipeDream weight version kept in host memory."""


class _CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts the events it schedules (for benchmarks)."""

    scheduled = 0

    def schedule(self, event, priority=1, delay=0):  # type: ignore[no-untyped-def]
        self.scheduled += 1
        super().schedule(event, priority, delay)


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
    runtime: Literal["mpress", "torch-pipelining"] = "mpress"
    """The training runtime whose buffer and prefetch policies are modelled.

    ``mpress`` (MPress's and DAPPLE's runtimes): a receive buffer is allocated when its
    transfer starts and freed when the tensor is consumed; a swap-in is prefetched while
    the task before its backward runs. ``torch-pipelining`` (``validate/executor.py`` on
    ``torch.distributed.pipelining``): ``PipelineStage`` allocates one activation and one
    gradient receive buffer per microbatch before the first task and keeps them; a
    swap-in is re-timed from the arrival of its backward's gradient when that comes late
    (the executor restores a layer when the backward reaches the swapped layer above it)."""


@dataclass
class _Run:
    env: simpy.Environment
    net: Network
    mem: MemoryLog
    live: LiveMemory
    spans: list[Span] = field(default_factory=list)
    events: dict[tuple, simpy.Event] = field(default_factory=dict)
    tails: dict[tuple[int, int], simpy.Event] = field(default_factory=dict)
    costs: list[dict[str, float]] = field(default_factory=list)
    chunks_left: dict[tuple, int] = field(default_factory=dict)
    reached: set[tuple[int, int, int]] = field(default_factory=set)
    """(stage, microbatch, layer) whose backward is waiting for its swap-in."""

    def event(self, *key: object) -> simpy.Event:
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


@dataclass(frozen=True)
class _Layout:
    schedule: str
    microbatches: int
    stages: Stages
    gpu_of: tuple[int, ...]
    actions: list[dict[int, LayerAction]]
    optimizer: list[str]
    stash: list[str]


def _layout(job: Job, stage_cost: np.ndarray) -> _Layout:
    plan = job.plan
    if plan is None:
        stages, gpus = _resolve_layout(job, stage_cost)
        p = len(stages)
        return _Layout(job.schedule, job.microbatches, stages, gpus, [{} for _ in range(p)], ["gpu"] * p, ["gpu"] * p)
    if plan.microbatch != job.trace.microbatch:
        raise MpsimError(f"the plan is for microbatch {plan.microbatch} but the trace is at {job.trace.microbatch}")
    check_plan(plan, job.topology, job.trace)
    return _Layout(plan.schedule, plan.microbatches, [tuple(st.layers) for st in plan.stages],  # type: ignore[misc]
                   tuple(st.gpu for st in plan.stages), [plan.action_of(s) for s in range(len(plan.stages))],
                   [st.optimizer for st in plan.stages], [st.stash for st in plan.stages])


def simulate_job(job: Job) -> SimResult:
    """Simulate one job and return its result (fits or not; see ``SimResult``)."""
    topo, trace = job.topology, job.trace
    gpu = topo.spec.gpu
    times = trace.layer_times(gpu)
    lay = _layout(job, times.fwd_s + times.bwd_s)
    stages, gpu_of, schedule, m = lay.stages, lay.gpu_of, lay.schedule, lay.microbatches
    p = len(stages)
    check_schedule(schedule, p, m)
    rows = trace.layers
    mem_rate = gpu.memory_bandwidth_gbps * 1e9 * gpu.memory_efficiency
    host = topo.n_gpus
    cpu_adam_rate = topo.spec.host.cpu_adam_gparams_per_s * 1e9

    env = _CountingEnvironment()
    run = _Run(env, Network(env, job.record_link_rates), MemoryLog(topo.n_gpus + 1),
               LiveMemory(env, topo.n_gpus, topo.capacity_bytes))
    run.costs = [dict.fromkeys(COSTS, 0.0) for _ in range(topo.n_gpus)]
    engines = [CopyEngines(env, g, gpu.peer_copy_engines) for g in range(topo.n_gpus)]
    update_end: list[list[float]] = [[] for _ in range(p)]
    programs: list[StageProgram] = []
    upd_dur: list[float] = []
    stage_params: list[int] = []
    torch_pipelining = job.runtime == "torch-pipelining"
    for s, (a, b) in enumerate(stages):
        g = gpu_of[s]
        stage_rows = rows[a:b]
        programs.append(build_program(stage_rows, times.fwd_s[a:b], times.bwd_s[a:b], a, s == 0, s == p - 1,
                                      lay.actions[s], torch_pipelining))
        received = m * received_bytes(stage_rows, s == 0, s == p - 1) if torch_pipelining else 0
        static = static_bytes(stage_rows, weight_versions(schedule, s, p), received)
        stage_params.append(static["params"])
        moved = {"optimizer": lay.optimizer[s] != "gpu", "stash": lay.stash[s] == "host"}
        for cat, n in static.items():
            if not n:
                continue
            if moved.get(cat):
                run.mem.event(host, 0.0, n, cat, f"stage {s} {cat} in host memory")
                run.mem.event(g, 0.0, n, f"saved:{cat}", f"stage {s} {cat} kept on the host")
            else:
                run.mem.event(g, 0.0, n, cat, f"stage {s} {cat} (allocated before the first task)")
                run.live.used[g] += n
        upd_dur.append(update_seconds(stage_rows, mem_rate))

    # ---- copies --------------------------------------------------------------------------
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
            if not torch_pipelining:
                run.mem.event(dst, start, n_bytes, "buffers", f"{kind} of microbatch {mb} from stage {src_stage} (receive buffer)")
                run.live.used[dst] += n_bytes
            yield run.net.transfer(topo.route(src, dst), n_bytes)
        run.mem.event(src, env.now, -n_bytes, "buffers", f"{kind} of microbatch {mb} sent to stage {dst_stage}")
        run.live.used[src] -= n_bytes
        run.spans.append(Span(src, "copy", f"{kind} mb{mb} -> gpu{dst}", start, env.now))
        mine.succeed()
        run.event(kind, dst_stage, mb).succeed()

    def striped(peers: tuple[tuple[int, float], ...], n_bytes: int) -> list[tuple[int, int]]:
        parts, given = [], 0
        for i, (peer, frac) in enumerate(peers):
            part = n_bytes - given if i == len(peers) - 1 else int(round(n_bytes * frac))
            given += part
            parts.append((peer, part))
        return parts

    def host_copy(g: int, n_bytes: int, to_host: bool, label: str):  # type: ignore[no-untyped-def]
        """A copy between GPU ``g`` and pinned host memory on its d2h or h2d engine."""
        engine = engines[g].d2h if to_host else engines[g].h2d
        with engine.request() as req:
            yield req
            start = env.now
            yield run.net.transfer(topo.route(g, HOST) if to_host else topo.route(HOST, g), n_bytes)
        run.spans.append(Span(g, "d2h" if to_host else "h2d", label, start, env.now))

    def swap_out(s: int, mb: int, so: SwapOut, chunks: int, peers: tuple[tuple[int, float], ...]):  # type: ignore[no-untyped-def]
        """Timing: waits for the engine (d2h for host, peer for D2D), then flows over the
        route(s); the GPU's bytes are freed when the last part lands."""
        g = gpu_of[s]
        n = so.own_bytes + so.input_bytes  # counted as a free under way by the launcher
        label = f"layer {so.layer} microbatch {mb}"
        if so.target == "host":
            yield from host_copy(g, n, True, f"swap-out L{so.layer} mb{mb}")
            run.mem.event(host, env.now, n, "activations", f"swap-out of {label} from GPU {g}")
        else:
            with engines[g].peer.request() as req:
                yield req
                start = env.now
                flows = []
                for peer, part in striped(peers, n):
                    run.mem.event(peer, start, part, "peer_swap", f"D2D swap-in area for GPU {g} {label}")
                    run.live.used[peer] += part
                    flows.append(run.net.transfer(topo.route(g, peer), part))
                yield simpy.AllOf(env, flows)
            run.spans.append(Span(g, "copy", f"D2D swap-out L{so.layer} mb{mb}", start, env.now))
        run.mem.event(g, env.now, -so.own_bytes, "activations", f"{label} saved activations swapped out")
        if so.input_bytes:
            run.mem.event(g, env.now, -so.input_bytes, so.input_cat, f"{label} saved input swapped out")
        run.mem.event(g, env.now, n, f"saved:{so.target}", f"{label} swapped out")
        run.live.free_landed(g, n)
        key = (s, mb, so.layer)
        left = run.chunks_left.get(key, chunks) - 1
        run.chunks_left[key] = left
        if left == 0:
            run.event("out", *key).succeed()

    def swap_in(s: int, mb: int, si: SwapIn, need_at: float):  # type: ignore[no-untyped-def]
        g = gpu_of[s]
        out = run.event("out", s, mb, si.layer)
        if not out.processed:
            yield out
        n = si.n_bytes
        route = topo.route(HOST, g)
        parts = striped(si.peers, n)
        if si.target == "host":
            alone = route.time_alone_s(n)
        else:
            alone = max(topo.route(peer, g).time_alone_s(part) for peer, part in parts)
        if need_at - alone > env.now:
            yield env.timeout(need_at - alone - env.now)
        grad = run.event("gradient", s, mb) if torch_pipelining and s < p - 1 else None
        if grad is not None and not grad.triggered:
            # the backward cannot start before its gradient arrives: re-time to that
            yield grad
            if si.need_offset_s > alone:
                yield env.timeout(si.need_offset_s - alone)
        # a prefetch waits for room while frees are under way or the backward will still
        # release memory before it needs this tensor (TSPLIT eq. 3: M_k + size <= M)
        live = run.live
        while live.used[g] + n > live.capacity and (live.freeing[g] or (s, mb, si.layer) not in run.reached):
            yield live.changed(g)
        label = f"layer {si.layer} microbatch {mb}" if si.layer != STASH else f"weight version of microbatch {mb}"
        engine = engines[g].h2d if si.target == "host" else engines[g].peer
        with engine.request() as req:
            yield req
            start = env.now
            if si.layer == STASH:
                run.mem.event(g, start, n, "stash", f"{label} swapped in")
                run.mem.event(g, start, -n, "saved:stash", f"{label} swapped in")
            else:
                run.mem.event(g, start, si.own_bytes, "activations", f"{label} saved activations swapped in")
                if si.input_bytes:
                    run.mem.event(g, start, si.input_bytes, si.input_cat, f"{label} saved input swapped in")
                run.mem.event(g, start, -n, f"saved:{si.target}", f"{label} swapped in")
            run.live.used[g] += n
            if si.target == "host":
                yield run.net.transfer(route, n)
            else:
                yield simpy.AllOf(env, [run.net.transfer(topo.route(peer, g), part) for peer, part in parts])
        if si.target == "host":
            run.mem.event(host, env.now, -n, "activations" if si.layer != STASH else "stash", f"{label} back on GPU {g}")
            run.spans.append(Span(g, "h2d", f"swap-in {'W' if si.layer == STASH else f'L{si.layer}'} mb{mb}", start, env.now))
        else:
            for peer, part in parts:
                run.mem.event(peer, env.now, -part, "peer_swap", f"D2D swap area of GPU {g} {label} released")
                run.live.used[peer] -= part
            run.spans.append(Span(g, "copy", f"D2D swap-in L{si.layer} mb{mb}", start, env.now))
        run.event("in", s, mb, si.layer).succeed()

    def stash_out(s: int, mb: int):  # type: ignore[no-untyped-def]
        """PipeDream weight version to host memory after the forward (nothing to free on
        the GPU: the live weights stay)."""
        g = gpu_of[s]
        n = stage_params[s]
        yield from host_copy(g, n, True, f"stash W mb{mb}")
        run.mem.event(host, env.now, n, "stash", f"weight version of microbatch {mb} from GPU {g}")
        run.event("out", s, mb, STASH).succeed()

    def optimizer_stream_out(s: int, j: int, n_bytes: int):  # type: ignore[no-untyped-def]
        g = gpu_of[s]
        yield from host_copy(g, n_bytes, True, f"optimizer states out L{j}")
        run.mem.event(g, env.now, -n_bytes, "optimizer", f"layer {j} optimizer states streamed out")
        run.mem.event(g, env.now, n_bytes, "saved:optimizer", f"layer {j} optimizer states streamed out")
        run.live.free_landed(g, n_bytes)

    # ---- the compute stream ---------------------------------------------------------------
    def update(s: int):  # type: ignore[no-untyped-def]
        """Optimizer step. gpu: memory-bound Adam on the GPU. host-update: gradients to the
        host, Adam on the CPU, weights back (ZeRO-Offload), the stream idle meanwhile.
        host-stream: layer by layer, states in, Adam on the GPU, states out (the out copy
        overlaps the next layer's; the in copy does not overlap the update)."""
        g = gpu_of[s]
        a, b = stages[s]
        mode = lay.optimizer[s]
        start = env.now
        if mode == "gpu":
            yield env.timeout(upd_dur[s])
        elif mode == "host-update":
            stage_rows = rows[a:b]
            yield from host_copy(g, sum(r.grad_bytes for r in stage_rows), True, "gradients to host")
            yield env.timeout(sum(r.params for r in stage_rows) / cpu_adam_rate)
            yield from host_copy(g, stage_params[s], False, "weights from host")
        else:
            for j in range(a, b):
                n_opt = rows[j].optimizer_bytes
                if not n_opt:
                    continue
                yield from run.live.wait_for_room(g, n_opt)
                run.mem.event(g, env.now, n_opt, "optimizer", f"layer {j} optimizer states streamed in")
                run.mem.event(g, env.now, -n_opt, "saved:optimizer", f"layer {j} optimizer states streamed in")
                run.live.used[g] += n_opt
                yield from host_copy(g, n_opt, False, f"optimizer states in L{j}")
                yield env.timeout(update_seconds(rows[j:j + 1], mem_rate))
                run.live.freeing[g] += 1
                env.process(optimizer_stream_out(s, j, n_opt))
        if mode != "gpu":
            run.costs[g]["optimizer_s"] += env.now - start - upd_dur[s]

    def stage_process(s: int):  # type: ignore[no-untyped-def]
        a, b = stages[s]
        g = gpu_of[s]
        prog = programs[s]
        first, last = s == 0, s == p - 1
        out_bytes = rows[b - 1].output_bytes
        in_grad_bytes = rows[a].input_bytes
        stash_host = lay.stash[s] == "host" and weight_versions(schedule, s, p) > 1
        stash_in = SwapIn(STASH, stage_params[s], 0, "stash", "host", (), 1, 0.0)
        costs = run.costs[g]
        peers_of = {j: tuple((x.gpu, x.fraction) for x in act.peers) for j, act in prog.actions.items()}
        chunks_of = {j: act.split for j, act in prog.actions.items()}
        est = {"F": prog.forward_s, "B": prog.backward_s, "U": upd_dur[s]}
        tasks = stage_tasks(schedule, s, p, m)
        def prefetch_for(idx: int) -> None:
            """Swap-ins of the backward after task ``idx``, launched as that task starts."""
            nxt = tasks[idx + 1] if idx + 1 < len(tasks) else None
            if nxt is not None and nxt.kind == "B":
                need_base = env.now + est[tasks[idx].kind]
                for si in prog.swap_ins:
                    env.process(swap_in(s, nxt.microbatch, si, need_base + si.need_offset_s))
                if stash_host:
                    env.process(swap_in(s, nxt.microbatch, stash_in, need_base))

        for idx, task in enumerate(tasks):
            mb = task.microbatch
            if task.kind == "U":
                prefetch_for(idx)
                start = env.now
                yield from update(s)
                run.spans.append(Span(g, "compute", f"U{mb}", start, env.now))
                update_end[s].append(env.now)
                continue
            if task.kind == "F":
                if not first:
                    yield run.event("activation", s, mb)
                pieces = prog.forward
            else:
                if not last:
                    yield run.event("gradient", s, mb)
                if stash_host:
                    stash_ev = run.event("in", s, mb, STASH)
                    run.reached.add((s, mb, STASH))
                    run.live.poke(g)
                    if not stash_ev.processed:
                        t0 = env.now
                        yield stash_ev
                        costs["swap_wait_s"] += env.now - t0
                pieces = prog.backward
            prefetch_for(idx)
            start = env.now
            word = "forward" if task.kind == "F" else "backward"
            for piece in pieces:
                if piece.wait_for is not None:
                    ev = run.event("in", s, mb, piece.wait_for)
                    run.reached.add((s, mb, piece.wait_for))
                    run.live.poke(g)
                    if not ev.processed:
                        t0 = env.now
                        yield ev
                        target = prog.actions[piece.wait_for].action
                        costs["swap_wait_s" if target == "host" else "peer_wait_s"] += env.now - t0
                tpl = piece.template
                if run.live.freeing[g] and run.live.used[g] + tpl.peak_bytes > run.live.capacity:
                    costs["memory_wait_s"] += yield from run.live.wait_for_room(g, tpl.peak_bytes)
                run.mem.task(g, env.now, tpl, f"{word} of microbatch {mb} on stage {s}:")
                run.live.used[g] += tpl.peak_bytes
                frees = tpl.net_bytes < 0  # a piece that releases memory is a free under way
                if frees:
                    run.live.freeing[g] += 1
                if piece.duration_s:
                    yield env.timeout(piece.duration_s)
                run.live.used[g] += tpl.net_bytes - tpl.peak_bytes
                if frees:
                    run.live.free_landed(g, 0)
                if piece.swap_out is not None:
                    j = piece.swap_out.layer
                    run.live.freeing[g] += 1  # before the next piece asks for room
                    env.process(swap_out(s, mb, piece.swap_out, chunks_of[j], peers_of[j]))
            run.spans.append(Span(g, "compute", f"{task.kind}{mb}", start, env.now))
            if task.kind == "F":
                costs["split_s"] += prog.split_forward_s
                if stash_host:
                    env.process(stash_out(s, mb))
                if not last:
                    env.process(send("activation", s, s + 1, mb, out_bytes))
            else:
                costs["recompute_s"] += prog.recompute_s
                costs["split_s"] += prog.split_backward_s
                if stash_host:
                    run.mem.event(g, env.now, -stage_params[s], "stash", f"weight version of microbatch {mb} released")
                    run.mem.event(g, env.now, stage_params[s], "saved:stash", f"weight version of microbatch {mb} released")
                    run.live.used[g] -= stage_params[s]
                if not first:
                    env.process(send("gradient", s, s - 1, mb, in_grad_bytes))

    streams = [env.process(stage_process(s)) for s in range(p)]
    env.run()
    stuck = [s for s, proc in enumerate(streams) if proc.is_alive]
    if stuck:  # an engine bug, never a result: say so instead of returning a silent stall
        raise RuntimeError(f"simulation stalled at {env.now:.6f} s with stages {stuck} unfinished")

    if schedule == "pipedream":
        ends = update_end[0][m - 1 :: m]
        iteration_s = ends[PIPEDREAM_MEASURED] - ends[PIPEDREAM_MEASURED - 1]
        iterations = PIPEDREAM_ITERATIONS
    else:
        iteration_s = env.now
        iterations = 1
    return _result(job, lay, run, programs, upd_dur, iteration_s, iterations)


def _result(job: Job, lay: _Layout, run: _Run, programs: list[StageProgram], upd_dur: list[float],
            iteration_s: float, iterations: int) -> SimResult:
    topo, trace, m = job.topology, job.trace, lay.microbatches
    stage_of = {g: s for s, g in enumerate(lay.gpu_of)}
    updates_per_iteration = m if lay.schedule == "pipedream" else 1
    gpus: list[GpuResult] = []
    ooms = []
    for g in range(topo.n_gpus):
        analysis = run.mem.analyse(g, topo.capacity_bytes)
        s = stage_of.get(g)
        costs = {k: v / iterations for k, v in run.costs[g].items()}
        busy = 0.0 if s is None else (m * (programs[s].forward_s + programs[s].backward_s)
                                      + updates_per_iteration * upd_dur[s] + costs["optimizer_s"])
        gpus.append(GpuResult(
            gpu=g, stage=s, layers=None if s is None else lay.stages[s], peak_bytes=analysis.peak_bytes,
            capacity_bytes=topo.capacity_bytes, reserved_bytes=topo.reserved_bytes,
            breakdown={k: analysis.breakdown.get(k, 0) for k in CATEGORIES}, compute_s=busy,
            memory_times_s=analysis.times_s, memory_used_bytes=analysis.used_bytes,
            saved_at_peak=analysis.saved, costs_s=costs,
        ))
        if analysis.oom:
            ooms.append(analysis.oom)
    host_analysis = run.mem.analyse(topo.n_gpus, topo.host_memory_bytes)
    if host_analysis.oom:
        ooms.append(dict(host_analysis.oom, gpu="host"))
    oom = min(ooms, key=lambda o: (o["time_s"], str(o["gpu"]))) if ooms else None
    links = {name: {"bytes": int(n), "busy_s": run.net.busy_s_by_link.get(name, 0.0)}
             for name, n in sorted(run.net.bytes_by_link.items())}
    return SimResult(
        server=topo.name, model=trace.name, schedule=lay.schedule, strategy=job.strategy,
        microbatch=trace.microbatch, microbatches=m, stages=list(lay.stages), gpu_of_stage=list(lay.gpu_of),
        iteration_s=iteration_s, samples_per_s=m * trace.microbatch / iteration_s,
        model_tflops=3.0 * trace.fwd_flops_total * m / iteration_s / 1e12,
        gpus=gpus, oom=oom, links=links, spans=run.spans, makespan_s=run.env.now,
        sim_events=run.env.scheduled,  # type: ignore[attr-defined]
        host_peak_bytes=host_analysis.peak_bytes, host_capacity_bytes=topo.host_memory_bytes,
        host_memory_times_s=host_analysis.times_s, host_memory_used_bytes=host_analysis.used_bytes,
        link_rates=run.net.rate_log,
    )
