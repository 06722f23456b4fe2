"""Baseline strategies: none, recompute, cpu-swap, d2d (DESIGN "Planners").

- ``none``: every tensor kept, compute-balanced partition, stage i on GPU i.
- ``recompute``: every transformer layer checkpointed (its input kept, the rest re-run
  before the backward), as GPipe and DAPPLE do.
- ``cpu-swap``: GPU-CPU swap of what must go, longest live interval first (the stage's
  optimizer states and PipeDream's stashed weights outlive every activation, so they go
  first, streamed around the update), until each GPU fits.
- ``d2d``: D2D swap only (MPress III-C), of activations, longest live interval first,
  into the spare memory of NVLink neighbours, striped in proportion to link bandwidth;
  it fails when the neighbours' spare memory runs out.

The swap planners are greedy and judged by simulation: each round swaps, per GPU that
does not fit, enough candidates to cover its shortfall by an estimate (a layer's bytes
times the microbatches whose activations the stage holds at once), then simulates
again, until every GPU fits or nothing is left to swap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpsim.errors import MpsimError
from mpsim.partition import compute_balanced
from mpsim.plan import LayerAction, PlanFile, Stripe, make_plan, stripes_by_bandwidth
from mpsim.planners.liveness import live_intervals
from mpsim.schedule import check_schedule
from mpsim.sim import Job, SimResult, simulate_job
from mpsim.topology import Topology
from mpsim.trace import Trace

MAX_ROUNDS = 64


@dataclass
class Planned:
    plan: PlanFile
    result: SimResult
    simulations: int = 1


@dataclass(frozen=True)
class _Ctx:
    topo: Topology
    trace: Trace
    schedule: str
    microbatches: int
    stages: list[tuple[int, int]]
    gpus: list[int]
    record_link_rates: bool = False

    def plan(self, strategy: str, actions: dict[int, list[LayerAction]] | None = None,
             optimizer: dict[int, str] | None = None, stash: dict[int, str] | None = None) -> PlanFile:
        return make_plan(self.trace, self.topo, self.schedule, self.microbatches, self.stages, self.gpus, strategy,
                         actions, optimizer, stash)

    def simulate(self, plan: PlanFile) -> SimResult:
        return simulate_job(Job(self.topo, self.trace, strategy=plan.strategy, plan=plan,
                                record_link_rates=self.record_link_rates))

    def held_microbatches(self, s: int) -> int:
        """Microbatches whose activations stage s holds at once (the schedule's bound)."""
        p, m = len(self.stages), self.microbatches
        return m if self.schedule == "gpipe" else min(p - s, m)


def _context(topo: Topology, trace: Trace, schedule: str, microbatches: int, n_stages: int | None,
             record_link_rates: bool) -> _Ctx:
    p = topo.n_gpus if n_stages is None else n_stages
    if p < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {p}")
    if p > topo.n_gpus:
        raise MpsimError(f"{p} stages need {p} GPUs but {topo.name} has {topo.n_gpus}")
    check_schedule(schedule, p, microbatches)
    times = trace.layer_times(topo.spec.gpu)
    stages = compute_balanced(times.fwd_s + times.bwd_s, p)
    return _Ctx(topo, trace, schedule, microbatches, list(stages), list(range(p)), record_link_rates)


def _none(ctx: _Ctx) -> Planned:
    plan = ctx.plan("none")
    return Planned(plan, ctx.simulate(plan))


def _recompute(ctx: _Ctx) -> Planned:
    actions = {s: [LayerAction(layer=j, action="recompute") for j in range(a, b)
                   if ctx.trace.layers[j].kind == "transformer"]
               for s, (a, b) in enumerate(ctx.stages)}
    plan = ctx.plan("recompute", actions)
    return Planned(plan, ctx.simulate(plan))


def _over(result: SimResult, gpu: int) -> int:
    g = result.gpus[gpu]
    return g.peak_bytes - g.capacity_bytes


def _keep_first(ctx: _Ctx, strategy: str) -> tuple[Planned, dict[int, float]]:
    """The plan that keeps everything, simulated, and the live intervals it shows."""
    plan = ctx.plan(strategy)
    result = ctx.simulate(plan)
    return Planned(plan, result), live_intervals(result, ctx.trace.layer_times(ctx.topo.spec.gpu))


def _cpu_swap(ctx: _Ctx) -> Planned:
    planned, interval = _keep_first(ctx, "cpu-swap")
    if planned.result.fits:
        return planned
    plan, result, sims = planned.plan, planned.result, 1
    rows = ctx.trace.layers
    # per stage, candidates by live interval, longest first: ("optimizer"|"stash"|layer, estimated bytes saved)
    queues: list[list[tuple[str | int, int]]] = []
    for s, (a, b) in enumerate(ctx.stages):
        held = ctx.held_microbatches(s)
        q: list[tuple[str | int, int]] = [("optimizer", sum(r.optimizer_bytes for r in rows[a:b]))]
        if ctx.schedule == "pipedream" and len(ctx.stages) - s > 1:
            q.append(("stash", (len(ctx.stages) - s - 1) * sum(r.param_bytes for r in rows[a:b])))
        layers = sorted((j for j in range(a, b) if rows[j].act_bytes), key=lambda j: (-interval[j], j))
        q += [(j, rows[j].act_bytes * held) for j in layers]
        queues.append([c for c in q if c[1] > 0])
    actions: dict[int, list[LayerAction]] = {s: [] for s in range(len(ctx.stages))}
    optimizer: dict[int, str] = {}
    stash: dict[int, str] = {}
    for _ in range(MAX_ROUNDS):
        moved = False
        for s, g in enumerate(ctx.gpus):
            short = _over(result, g)
            while short > 0 and queues[s]:
                what, saves = queues[s].pop(0)
                if what == "optimizer":
                    optimizer[s] = "host-stream"
                elif what == "stash":
                    stash[s] = "host"
                else:
                    actions[s].append(LayerAction(layer=int(what), action="host"))
                short -= saves
                moved = True
        if not moved:
            break
        plan = ctx.plan("cpu-swap", actions, optimizer, stash)
        result = ctx.simulate(plan)
        sims += 1
        if result.fits:
            break
    return Planned(plan, result, sims)


def _d2d(ctx: _Ctx) -> Planned:
    planned, interval = _keep_first(ctx, "d2d")
    if planned.result.fits:
        return planned
    plan, result, sims = planned.plan, planned.result, 1
    topo = ctx.topo
    rows = ctx.trace.layers
    spare = {g.gpu: max(0, g.capacity_bytes - g.peak_bytes) for g in result.gpus}
    queues = [sorted((j for j in range(a, b) if rows[j].act_bytes), key=lambda j: (-interval[j], j))
              for a, b in ctx.stages]
    actions: dict[int, list[LayerAction]] = {s: [] for s in range(len(ctx.stages))}
    for _ in range(MAX_ROUNDS):
        moved = False
        for s, g in enumerate(ctx.gpus):
            short = _over(result, g)
            held = ctx.held_microbatches(s)
            while short > 0 and queues[s]:
                j = queues[s][0]
                need = rows[j].act_bytes * held
                stripes = _fit_stripes(topo, g, need, spare)
                if stripes is None:
                    break
                queues[s].pop(0)
                for x in stripes:
                    spare[x.gpu] -= int(need * x.fraction) + 1
                actions[s].append(LayerAction(layer=j, action="peer", peers=stripes))
                short -= need
                moved = True
        if not moved:
            break
        plan = ctx.plan("d2d", actions)
        result = ctx.simulate(plan)
        sims += 1
        if result.fits:
            break
        for gr in result.gpus:  # a peer that overflowed has no spare left
            if gr.peak_bytes > gr.capacity_bytes and gr.gpu not in ctx.gpus[: len(ctx.stages)]:
                spare[gr.gpu] = 0
    return Planned(plan, result, sims)


def _fit_stripes(topo: Topology, g: int, need: int, spare: dict[int, int]) -> list[Stripe] | None:
    """Bandwidth-weighted stripes over the NVLink neighbours of ``g`` whose spare memory
    takes their part; None when no such neighbour is left."""
    peers = [q for q in range(topo.n_gpus) if q != g and topo.nvlinks_between(g, q) and spare.get(q, 0) > 0]
    while peers:
        stripes = stripes_by_bandwidth(topo, g, peers)
        short = [x.gpu for x in stripes if need * x.fraction > spare[x.gpu]]
        if not short:
            return stripes
        peers = [q for q in peers if q not in short]
    return None


STRATEGIES: dict[str, Callable[[_Ctx], Planned]] = {
    "none": _none,
    "recompute": _recompute,
    "cpu-swap": _cpu_swap,
    "d2d": _d2d,
}


def plan_job(strategy: str, topo: Topology, trace: Trace, schedule: str = "1f1b", microbatches: int = 16,
             n_stages: int | None = None, record_link_rates: bool = False) -> Planned:
    """Plan and simulate ``trace`` on ``topo`` with a named strategy (``record_link_rates``:
    the simulations keep every change of link rates, for Chrome-trace counters)."""
    planner = STRATEGIES.get(strategy)
    if planner is None:
        raise MpsimError(f"unknown strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    return planner(_context(topo, trace, schedule, microbatches, n_stages, record_link_rates))
