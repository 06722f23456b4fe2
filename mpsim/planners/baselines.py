"""Baseline strategies: none, recompute, selective, cpu-swap, d2d (DESIGN "Planners").

- ``none``: every tensor kept, compute-balanced partition, stage i on GPU i.
- ``recompute``: only what must be recomputed for each GPU to fit: transformer layers (blocks
  of a ``--module`` trace) checkpointed (input kept, the rest re-run before the backward)
  one at a time, the most bytes saved per forward FLOP re-run first, until the GPU fits; a
  job that fits recomputes nothing (MPress Fig. 7: at BERT-0.35B every system runs as
  PipeDream does).
- ``recompute-segments``: the same choice of layers, checkpointed as Chen et al. 2016
  (MPress's reference [16] for its recomputation baselines) and GPipe's and DAPPLE's
  re-materialization do: consecutive recomputed layers keep only the first one's input
  and re-run together before the last one's backward (``PlanFile.recompute_checkpoints``),
  so the backward holds the whole run's activations at once. What it cannot fit MPress
  says recomputation cannot (IV-B: BERT-4B and up, GPT beyond 10.3B on the DGX-1).
- ``recompute-all``: every transformer layer checkpointed, each keeping its input.
- ``selective``: every transformer layer whose attention core keeps something recomputes
  that core only (Korthikanti et al. 2022, section 4.2: most of the memory of eager
  attention for a few percent of the FLOPs); with a flash kernel it saves little.
- ``cpu-swap``: MPress IV-B's GPU-CPU swap baseline: GPU-CPU swap of what must go, longest
  live interval first (the stage's optimizer states and PipeDream's stashed weights
  outlive every activation, so they go first, streamed around the update), until each GPU
  fits; swaps on demand, as the runtimes MPress compares with do: the compute waits for
  each swap-out to land and each swap-in starts when the backward reaches its layer, so
  every byte swapped crosses PCIe on the critical path (II-D: swapping 39% of BERT-0.64B's
  stage 0 costs 67% of its throughput).
- ``host-swap``: the same choice of what goes, with the swaps overlapped with the compute
  and each swap-in prefetched to land when its backward needs it.
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
from typing import Literal

from mpsim.models.trace import RECOMPUTABLE, LayerRow
from mpsim.planners.context import MAX_ROUNDS, Ctx, Planned, keep_first, over
from mpsim.plans.plan import Checkpoints, LayerAction, PlanFile, SwapTiming, fit_stripes
from mpsim.sim.result import SimResult


def _rounds(ctx: Ctx, planned: Planned, take: Callable[[int, int], bool], build: Callable[[], PlanFile],
            after: Callable[[SimResult], None] | None = None) -> Planned:
    """The greedy rounds of the module doc: per GPU that does not fit, ``take(stage,
    shortfall)`` adds actions (True if it added any); then one simulation of ``build()``,
    until every GPU fits, nothing is added, or MAX_ROUNDS; ``after`` sees each result.
    A GPU that does not fit and has nothing left to take can never fit, so the round that
    finds one is the last (the others' actions of that round are still simulated); so is
    a round whose plan overflows host memory, since no planner here takes bytes back
    from the host."""
    plan, result, sims = planned.plan, planned.result, 1
    for _ in range(MAX_ROUNDS):
        moved = stuck = False
        for s, g in enumerate(ctx.gpus):
            short = over(result, g)
            if short > 0:
                took = take(s, short)
                moved |= took
                stuck |= not took
        if not moved:
            break
        plan = build()
        result = ctx.simulate(plan)
        sims += 1
        if result.fits or stuck or result.host_peak_bytes > result.host_capacity_bytes:
            break
        if after is not None:
            after(result)
    return Planned(plan, result, sims)


def _none(ctx: Ctx) -> Planned:
    plan = ctx.plan("none")
    return Planned(plan, ctx.simulate(plan))


def _every_transformer_layer(ctx: Ctx, action: Literal["recompute", "selective"], strategy: str) -> Planned:
    """``action`` on every transformer layer that allows it (``selective``: those whose
    attention core keeps something), the plan named by its ``strategy``."""
    rows = ctx.trace.layers
    actions = {s: [LayerAction(layer=j, action=action) for j in range(a, b)
                   if rows[j].kind in RECOMPUTABLE and (action != "selective" or rows[j].attention_core_bytes)]
               for s, (a, b) in enumerate(ctx.stages)}
    plan = ctx.plan(strategy, actions)
    return Planned(plan, ctx.simulate(plan))


def _recompute_all(ctx: Ctx) -> Planned:
    return _every_transformer_layer(ctx, "recompute", "recompute-all")


def recompute_saves(r: LayerRow) -> int:
    """Bytes a checkpointed layer stops holding per microbatch: what it saves, less the input
    the checkpoint keeps (already among its saved tensors, or held for it if not)."""
    return max(0, r.act_bytes - r.input_bytes)


def _recompute_queue(ctx: Ctx, s: int) -> list[tuple[int, int]]:
    """Stage ``s``'s recomputable layers as (layer, estimated bytes saved), the most bytes
    per forward FLOP first (ties: earlier layer first)."""
    a, b = ctx.stages[s]
    rows = ctx.trace.layers
    held = ctx.held_microbatches(s)
    cands = [j for j in range(a, b) if rows[j].kind in RECOMPUTABLE and recompute_saves(rows[j]) > 0]
    cands.sort(key=lambda j: (-recompute_saves(rows[j]) / max(rows[j].fwd_flops, 1.0), j))
    return [(j, recompute_saves(rows[j]) * held) for j in cands]


def _recompute(ctx: Ctx) -> Planned:
    return _recompute_fewest(ctx, "recompute", "layer")


def _recompute_segments(ctx: Ctx) -> Planned:
    return _recompute_fewest(ctx, "recompute-segments", "segment")


def _recompute_fewest(ctx: Ctx, name: str, checkpoints: Checkpoints) -> Planned:
    """Recompute only what each GPU needs to fit (``_recompute_queue`` order), checkpointed
    per layer or per run of consecutive layers (``checkpoints``)."""
    planned, _ = keep_first(ctx, name)
    if planned.result.fits:
        return planned
    queues = [_recompute_queue(ctx, s) for s in range(len(ctx.stages))]
    actions: dict[int, list[LayerAction]] = {s: [] for s in range(len(ctx.stages))}

    def take(s: int, short: int) -> bool:
        moved = False
        while short > 0 and queues[s]:
            j, saves = queues[s].pop(0)
            actions[s].append(LayerAction(layer=j, action="recompute"))
            short -= saves
            moved = True
        return moved

    return _rounds(ctx, planned, take, lambda: ctx.plan(name, actions, recompute_checkpoints=checkpoints))


def _selective(ctx: Ctx) -> Planned:
    return _every_transformer_layer(ctx, "selective", "selective")


def _cpu_swap(ctx: Ctx) -> Planned:
    """MPress IV-B's GPU-CPU swap baseline: host swap with on-demand timing."""
    return _swap_to_host(ctx, "cpu-swap", "on-demand")


def _host_swap(ctx: Ctx) -> Planned:
    """Host swap overlapped with the compute and prefetched (the copy engines' best case)."""
    return _swap_to_host(ctx, "host-swap", "prefetch")


def _swap_to_host(ctx: Ctx, name: str, timing: SwapTiming) -> Planned:
    planned, interval = keep_first(ctx, name)
    if planned.result.fits:
        return planned
    rows = ctx.trace.layers
    # per stage, candidates by live interval, longest first: ("optimizer"|"stash"|layer, estimated bytes saved)
    queues: list[list[tuple[str | int, int]]] = []
    for s, (a, b) in enumerate(ctx.stages):
        held = ctx.held_microbatches(s)
        q: list[tuple[str | int, int]] = [("optimizer", sum(ctx.optimizer_bytes(r) for r in rows[a:b]))]
        if ctx.schedule == "pipedream" and len(ctx.stages) - s > 1:
            q.append(("stash", (len(ctx.stages) - s - 1) * sum(r.param_bytes for r in rows[a:b])))
        layers = sorted((j for j in range(a, b) if rows[j].act_bytes), key=lambda j: (-interval[j], j))
        q += [(j, rows[j].act_bytes * held) for j in layers]
        queues.append([c for c in q if c[1] > 0])
    actions: dict[int, list[LayerAction]] = {s: [] for s in range(len(ctx.stages))}
    optimizer: dict[int, str] = {}
    stash: dict[int, str] = {}

    def take(s: int, short: int) -> bool:
        moved = False
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
        return moved

    return _rounds(ctx, planned, take, lambda: ctx.plan(name, actions, optimizer, stash, timing))


def _d2d(ctx: Ctx) -> Planned:
    planned, interval = keep_first(ctx, "d2d")
    if planned.result.fits:
        return planned
    topo = ctx.topo
    rows = ctx.trace.layers
    spare = ctx.spare(planned.result)
    queues = [sorted((j for j in range(a, b) if rows[j].act_bytes), key=lambda j: (-interval[j], j))
              for a, b in ctx.stages]
    actions: dict[int, list[LayerAction]] = {s: [] for s in range(len(ctx.stages))}

    def take(s: int, short: int) -> bool:
        moved = False
        held = ctx.held_microbatches(s)
        g = ctx.gpus[s]
        while short > 0 and queues[s]:
            j = queues[s][0]
            need = rows[j].act_bytes * held
            stripes = fit_stripes(topo, g, need, spare)
            if stripes is None:
                break
            queues[s].pop(0)
            for x in stripes:
                spare[x.gpu] -= int(need * x.fraction) + 1
            actions[s].append(LayerAction(layer=j, action="peer", peers=stripes))
            short -= need
            moved = True
        return moved

    def overflowed(result: SimResult) -> None:
        for gr in result.gpus:  # a peer that overflowed has no spare left
            if gr.peak_bytes > gr.capacity_bytes and gr.gpu not in ctx.gpus[: len(ctx.stages)]:
                spare[gr.gpu] = 0

    return _rounds(ctx, planned, take, lambda: ctx.plan("d2d", actions), overflowed)


BASELINES = {
    "none": _none,
    "recompute": _recompute,
    "recompute-segments": _recompute_segments,
    "recompute-all": _recompute_all,
    "selective": _selective,
    "cpu-swap": _cpu_swap,
    "host-swap": _host_swap,
    "d2d": _d2d,
}
