"""MPress memory compaction planning (papers/mpress.txt III-C, III-D).

1. Simulate the iteration keeping everything; read each layer's live interval (the time
   from its forward to its backward, MPress's live-variable analysis) and each stage's
   end slack (under a flush, later stages finish their backward first and wait).
2. Device mapping (``mpsim.planners.mapping``, Fig. 6) on the memory the plan will leave:
   a stage whose optimizer states can stream to the host inside its end slack counts
   them as spare. Exporters go next to importers over many NVLinks; skipped on
   symmetric servers.
3. Free GPU-CPU swap first: per stage, the optimizer states of as many layers as its
   slack hides while they stream go to the host (kept if the simulated iteration is no
   slower). This makes the later stages of a flushed pipeline importers (Table IV:
   GPU-CPU swap on every stage, D2D from stages 0-3 to 4-7).
4. Initial assignment per GPU that does not fit, cheapest extra time per byte saved
   first: GPU-CPU swap where the swap hides in the live interval (cost 0; the longest
   intervals first), else the least extra time among recomputation, D2D swap into the
   spare memory the last simulation left on NVLink neighbours, and GPU-CPU swap
   (footnote 2); optimizer states and PipeDream's stashed weights compete on the same
   footing, layer by layer. Candidates are taken until the estimated saving covers the
   shortfall, then the iteration is simulated again, until every GPU fits.
5. Tuning rounds: the tensors whose choice costs the most are moved to D2D swap into the
   spare memory of NVLink neighbours (striped in proportion to link bandwidth) where that
   costs less; a round is kept when the simulated iteration fits and is faster, and the
   search stops when a round gains nothing. Then the GPU-CPU swaps of step 4 that the
   simulation shows waiting are tried as recomputation (``host_swaps_to_recompute``).

Steps 3-5 run on DAPPLE's map and on the searched one, each with and without striping
where the variant allows it; the fastest plan that fits is kept (``plan_mpress``).
The per-tensor rule behind steps 4 and 5 is ``choose`` (Table III's reading in IV-D).
Ablations (Fig. 9): without the mapping search (stage i on GPU i, DAPPLE's), without
striping (each swap to its one fastest neighbour), and D2D swap only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mpsim.caches import Lru
from mpsim.models.trace import RECOMPUTABLE, LayerRow
from mpsim.planners.baselines import BASELINES
from mpsim.planners.cache import CACHE_SIZE, cached_plan
from mpsim.planners.context import MAX_ROUNDS, Ctx, Planned, keep_first, over
from mpsim.planners.liveness import end_slack
from mpsim.planners.mapping import Mapping, search_mapping
from mpsim.plans.plan import LayerAction, PlanFile, Stripe, fit_stripes
from mpsim.sim import SimResult
from mpsim.timing.costs import cost_model

MIN_GAIN = 0.001
"""A tuning round must make the iteration this much faster (relative) to be kept."""
SPARE_MARGIN = 0.97
"""Share of a peer's measured spare memory D2D swaps may fill (the rest absorbs timing)."""


def choose(interval_s: float, recompute_s: float, host_swap_s: float, d2d_swap_s: float | None) -> str:
    """MPress's choice for one activation tensor (IV-D on Table III): GPU-CPU swap when
    the interval hides it; otherwise the least extra time among recomputation (its forward
    again), D2D swap and GPU-CPU swap (each: swap time minus live interval, footnote 2);
    on a tie recomputation, which spends no spare GPU memory. ``d2d_swap_s`` None: no
    peer has room. Returns ``host``, ``recompute`` or ``peer``."""
    host_extra = max(0.0, host_swap_s - interval_s)
    if host_extra == 0.0:
        return "host"
    d2d_extra = float("inf") if d2d_swap_s is None else max(0.0, d2d_swap_s - interval_s)
    best = min(recompute_s, d2d_extra, host_extra)
    if recompute_s == best:
        return "recompute"
    return "peer" if d2d_extra == best else "host"


@dataclass(frozen=True)
class Options:
    mapping: bool = True
    striping: bool = True
    d2d_only: bool = False


VARIANTS: dict[str, Options] = {
    "mpress": Options(),
    "mpress-no-mapping": Options(mapping=False),
    "mpress-no-striping": Options(striping=False),
    "mpress-no-mapping-no-striping": Options(mapping=False, striping=False),
    "mpress-d2d-only": Options(d2d_only=True),
}


@dataclass
class _Candidate:
    stage: int
    what: str | int
    """``optimizer`` (the states of layer ``layer``), ``stash`` or a layer index."""
    saves_bytes: int
    """Estimated bytes off the GPU at its peak."""
    extra_s: float
    """Estimated extra time per iteration."""
    action: str
    interval_s: float = 0.0
    instead_of: _Candidate | None = None
    """The queue's candidate this D2D swap replaces (``_Planner.as_taken``)."""
    layer: int = -1
    """For ``optimizer``: the layer whose states it moves."""


_Routes = dict[tuple[int, int], tuple[list[Stripe] | None, float]]
"""D2D routes found in one state of the spare memory: per (stage, bytes per microbatch),
the stripes (None: no room) and the swap-out plus swap-in seconds over them."""

_PoolEntry = tuple[str | int, int, float, float, int]
"""A candidate before pricing: (what, bytes saved, recompute s, GPU-CPU swap s, layer)."""


@dataclass
class _PricedPool:
    """A stage's pool (``_Planner.candidate_pool``) as arrays, so that each step of
    ``_Planner.stage_queue`` prices every entry at once with ``choose``'s rule (IV-D on
    Table III, without D2D swap) instead of one entry at a time."""

    optimizer: np.ndarray
    """Per entry: the optimizer states of one layer (hidden only by the end slack)."""
    interval_s: np.ndarray
    """Live interval (inf: PipeDream's stash; unused for optimizer states)."""
    recompute_s: np.ndarray
    """Extra seconds of recomputation per microbatch (inf where it cannot be recomputed)."""
    host_s: np.ndarray
    """GPU-CPU swap seconds per microbatch."""
    saves_bytes: np.ndarray
    """Bytes a swap saves (float64; exact below 2**53)."""
    recompute_saves_bytes: np.ndarray
    """Bytes a recomputation saves (its checkpointed input stays)."""
    left: np.ndarray
    """Entries not taken yet."""

    @classmethod
    def of(cls, pool: list[_PoolEntry], intervals: dict[int, float], rows: Sequence[LayerRow],
           held: int) -> _PricedPool:
        def own_bytes(what: str | int) -> int:
            return 0 if isinstance(what, str) else rows[what].own_bytes * held

        return cls(
            optimizer=np.array([e[0] == "optimizer" for e in pool], dtype=bool),
            interval_s=np.array([intervals[e[0]] if isinstance(e[0], int) else
                                 (float("inf") if e[0] == "stash" else 0.0) for e in pool], dtype=float),
            recompute_s=np.array([e[2] for e in pool], dtype=float),
            host_s=np.array([e[3] for e in pool], dtype=float),
            saves_bytes=np.array([e[1] for e in pool], dtype=float),
            recompute_saves_bytes=np.array([own_bytes(e[0]) for e in pool], dtype=float),
            left=np.ones(len(pool), dtype=bool),
        )

    def cheapest(self, budget_s: float, slack_per_microbatch_s: float) -> int | None:
        """Index of the entry left with the least extra time per byte (then the longest
        interval, then the first), given the PCIe budget and the end slack per microbatch
        left; None if none left saves anything. The same IEEE operations as ``choose``
        and ``_Planner.priced`` on each entry."""
        interval = np.where(self.optimizer, slack_per_microbatch_s, self.interval_s)
        hidden = np.where(self.optimizer, slack_per_microbatch_s, np.minimum(self.interval_s, budget_s))
        host_extra = np.maximum(0.0, self.host_s - hidden)
        recompute = (host_extra != 0.0) & (self.recompute_s <= host_extra)
        saves = np.where(recompute, self.recompute_saves_bytes, self.saves_bytes)
        usable = self.left & (saves > 0)
        if not usable.any():
            return None
        idx = np.flatnonzero(usable)
        ratio = np.where(recompute, self.recompute_s, host_extra)[idx] / saves[idx]
        idx = idx[ratio == ratio.min()]
        if len(idx) > 1:
            longest = interval[idx]
            idx = idx[longest == longest.max()]
        return int(idx[0])


class _Planner:
    def __init__(self, ctx: Ctx, opts: Options, name: str, slack_s: list[float]) -> None:
        self.ctx, self.opts, self.name = ctx, opts, name
        self.slack_s = slack_s
        """Per stage, the end-of-iteration slack its optimizer streaming may hide in (``end_slack``)."""
        self.times = cost_model(ctx.trace, ctx.topo.spec.gpu).layer_times
        self.actions: dict[int, dict[int, LayerAction]] = {s: {} for s in range(len(ctx.stages))}
        self.host_optimizer: dict[int, set[int]] = {}
        """Per stage, the layers whose optimizer states stream from the host."""
        self.stash: dict[int, str] = {}
        self.sims = 0
        n_stages = len(ctx.stages)
        self.held = [ctx.held_microbatches(s) for s in range(n_stages)]
        """Per stage, the microbatches whose activations it holds at once (invariant: looked up once)."""
        self.host_bytes_per_s = [ctx.topo.route(ctx.gpus[s], "host").bandwidth for s in range(n_stages)]
        """Per stage, its GPU's route to the host in bytes/s."""

    # ---- costs ---------------------------------------------------------------------------
    def host_bw(self, s: int) -> float:
        return self.host_bytes_per_s[s]

    def pcie_sharers(self, s: int) -> int:
        """Stages whose GPU-host route shares a link with stage s's (a PCIe switch uplink)."""
        topo = self.ctx.topo
        mine = {link.name for link in topo.route(self.ctx.gpus[s], "host").links}
        return sum(1 for g in self.ctx.gpus if mine & {link.name for link in topo.route(g, "host").links})

    def stripes(self, s: int, need: int, spare: dict[int, float]) -> list[Stripe] | None:
        """Where ``need`` bytes of stage s go by D2D swap: bandwidth-weighted over NVLink
        neighbours with room, or (no striping) the fastest one with room; None if none."""
        topo, g = self.ctx.topo, self.ctx.gpus[s]
        if self.opts.striping:
            return fit_stripes(topo, g, need, spare)
        fit = [q for q in topo.nvlink_peers(g) if spare.get(q, 0) >= need]
        if not fit:
            return None
        best = max(fit, key=lambda q: (topo.route(g, q).bandwidth, -q))
        return [Stripe(gpu=best, fraction=1.0)]

    def d2d_seconds(self, s: int, n_bytes: int, stripes: list[Stripe]) -> float:
        """Swap-out plus swap-in of ``n_bytes`` over ``stripes``, alone on the links."""
        g = self.ctx.gpus[s]
        return 2 * max(n_bytes * x.fraction / self.ctx.topo.route(g, x.gpu).bandwidth for x in stripes)

    def optimizer_bytes(self, s: int, layers: Iterable[int] | None = None) -> int:
        """Optimizer-state bytes stage s's GPU holds (of ``layers`` only, when given): its
        shard under ZeRO-1 and up (``Ctx.optimizer_bytes``)."""
        rows, ctx = self.ctx.trace.layers, self.ctx
        return sum(ctx.optimizer_bytes(rows[j]) for j in (range(*ctx.stages[s]) if layers is None else layers))

    def optimizer_stream_s(self, s: int, layers: Iterable[int] | None = None) -> float:
        """Streaming stage s's optimizer states (of ``layers``) in around its update
        (``Updater``): the in-copies run one after another, the out-copies overlap them on
        the other direction."""
        return self.optimizer_bytes(s, layers) / self.host_bw(s)

    def free_offloads(self) -> dict[int, list[int]]:
        """Per stage, the layers whose optimizer states stream inside its end slack, the
        first layers first: GPU-CPU swap at no cost, which MPress takes first (IV-D on
        Table III's t1), and which makes the later stages of a flushed pipeline importers
        of D2D swaps (Table IV: GPU-CPU swap on every stage, D2D from stages 0-3 to 4-7).
        None for D2D swap only."""
        if self.opts.d2d_only:
            return {}
        free: dict[int, list[int]] = {}
        rows = self.ctx.trace.layers
        for s, (a, b) in enumerate(self.ctx.stages):
            budget_bytes = self.slack_s[s] * self.host_bw(s)
            for j in range(a, b):
                on_gpu = self.ctx.optimizer_bytes(rows[j])
                if 0 < on_gpu <= budget_bytes:
                    free.setdefault(s, []).append(j)
                    budget_bytes -= on_gpu
        return free

    def layer_costs(self, s: int, j: int, interval: float) -> tuple[int, float, float, float]:
        """Per microbatch for layer j: (bytes a swap moves, recompute s, GPU-CPU swap-out plus
        swap-in s, live interval s)."""
        r = self.ctx.trace.layers[j]
        return r.act_bytes, float(self.times.fwd_s[j]), 2 * r.act_bytes / self.host_bw(s), interval

    # ---- steps ---------------------------------------------------------------------------
    def simulate(self) -> tuple[SimResult, PlanFile]:
        actions = {s: sorted(a.values(), key=lambda x: x.layer) for s, a in self.actions.items()}
        optimizer = {s: "host-stream" for s, layers in self.host_optimizer.items() if layers}
        subsets = {s: sorted(layers) for s, layers in self.host_optimizer.items()
                   if layers and len(layers) < len(range(*self.ctx.stages[s]))}
        plan = self.ctx.plan(self.name, actions, optimizer, self.stash, optimizer_layers=subsets)
        self.sims += 1
        return self.ctx.simulate(plan), plan

    def initial_candidates(self, intervals: dict[int, float]) -> list[list[_Candidate]]:
        """Per stage, candidates in the order the initial assignment takes them.

        The live interval hides a GPU-CPU swap only while the stage's PCIe route has time
        to spare: all its swaps of one microbatch share one pipeline period (the stage's
        forward plus backward time), so once that budget is spent a swap costs its whole
        transfer time. Each step takes the candidate with the least extra time per byte
        given what is left of the budget (TSPLIT's PCIe occupancy, eq. 3, in MPress's
        per-tensor terms)."""
        return [self.d2d_queue(s, intervals) if self.opts.d2d_only else self.stage_queue(s, intervals)
                for s in range(len(self.ctx.stages))]

    def d2d_queue(self, s: int, intervals: dict[int, float]) -> list[_Candidate]:
        """D2D swap only: stage s's layers that save activations, the longest live interval first."""
        rows = self.ctx.trace.layers
        a, b = self.ctx.stages[s]
        held = self.held[s]
        layers = sorted((j for j in range(a, b) if rows[j].act_bytes), key=lambda j: (-intervals[j], j))
        return [_Candidate(s, j, rows[j].act_bytes * held, 0.0, "peer", intervals[j]) for j in layers]

    def candidate_pool(self, s: int, intervals: dict[int, float], streamed: set[int]) -> list[_PoolEntry]:
        """Stage s's candidates before they are priced: the optimizer states of each layer not
        ``streamed`` yet, PipeDream's stashed weights, and each layer's activations."""
        ctx, m = self.ctx, self.ctx.microbatches
        rows = ctx.trace.layers
        a, b = ctx.stages[s]
        held = self.held[s]
        pool: list[_PoolEntry] = []
        # per microbatch: PipeDream updates after every backward, a flushed pipeline once
        updates = m if ctx.schedule == "pipedream" else 1
        pool += [("optimizer", ctx.optimizer_bytes(rows[j]), float("inf"),
                  self.optimizer_stream_s(s, [j]) * updates / m, j)
                 for j in range(a, b) if rows[j].optimizer_bytes and j not in streamed]
        if ctx.schedule == "pipedream" and len(ctx.stages) - s > 1:
            params = sum(r.param_bytes for r in rows[a:b])
            pool.append(("stash", (len(ctx.stages) - s - 1) * params, float("inf"), params / self.host_bw(s), -1))
        for j in range(a, b):
            if rows[j].act_bytes:
                n_bytes, rec_s, host_s, _ = self.layer_costs(s, j, intervals[j])
                pool.append((j, n_bytes * held, rec_s if rows[j].kind in RECOMPUTABLE else float("inf"), host_s, j))
        return pool

    def stage_queue(self, s: int, intervals: dict[int, float]) -> list[_Candidate]:
        """Stage s's candidates, each step the cheapest per byte given what is left of the
        stage's PCIe budget and of its end slack (``cheapest``)."""
        ctx, m = self.ctx, self.ctx.microbatches
        a, b = ctx.stages[s]
        budget = float(self.times.fwd_s[a:b].sum() + self.times.bwd_s[a:b].sum()) / self.pcie_sharers(s)
        streamed = self.host_optimizer.get(s, set())
        slack = max(0.0, self.slack_s[s] - self.optimizer_stream_s(s, streamed))
        pool = self.candidate_pool(s, intervals, streamed)
        priced = _PricedPool.of(pool, intervals, self.ctx.trace.layers, self.held[s])
        updates = m if ctx.schedule == "pipedream" else 1
        q: list[_Candidate] = []
        while (i := priced.cheapest(budget, slack / m)) is not None:
            c, host_s = self.priced(s, pool[i], intervals, budget, slack)
            priced.left[i] = False
            if c.action == "host":  # its transfer takes its share of the stage's PCIe budget
                budget = max(0.0, budget - host_s)
            elif c.what == "optimizer":  # its streaming takes its share of the end slack
                slack = max(0.0, slack - host_s * m / updates)
            q.append(c)
        return q

    def priced(self, s: int, entry: _PoolEntry, intervals: dict[int, float], budget: float,
               slack: float) -> tuple[_Candidate, float]:
        """One pool entry of stage s as a candidate, priced with ``choose`` given the PCIe
        ``budget`` and end ``slack`` left (``_PricedPool.cheapest`` prices them all the same
        way at once), and its GPU-CPU swap seconds."""
        what, saves, rec_s, host_s, layer = entry
        m = self.ctx.microbatches
        if what == "optimizer":  # streamed around the update: only the end slack hides it
            interval = hidden = slack / m
        else:
            interval = float("inf") if what == "stash" else intervals[int(what)]
            hidden = min(interval, budget)
        action = choose(hidden, rec_s, host_s, None)
        if action == "recompute":
            saves = self.ctx.trace.layers[int(what)].own_bytes * self.held[s]
            extra = rec_s
        else:
            action = {"optimizer": "host-stream"}.get(str(what), "host")
            extra = max(0.0, host_s - hidden)
        assert saves > 0, "_PricedPool.cheapest picks only entries that save bytes"
        return _Candidate(s, what, saves, extra * m, action, interval, layer=layer), host_s

    def apply(self, c: _Candidate, spare: dict[int, float]) -> bool:
        if c.what == "optimizer":
            self.host_optimizer.setdefault(c.stage, set()).add(c.layer)
        elif c.what == "stash":
            self.stash[c.stage] = "host"
        elif c.action == "peer":
            held = self.held[c.stage]
            need = self.ctx.trace.layers[int(c.what)].act_bytes * held
            stripes = self.stripes(c.stage, need, spare)
            if stripes is None:
                return False
            for x in stripes:
                spare[x.gpu] -= need * x.fraction
            self.actions[c.stage][int(c.what)] = LayerAction(layer=int(c.what), action="peer", peers=stripes)
        else:
            self.actions[c.stage][int(c.what)] = LayerAction(layer=int(c.what), action=c.action)  # type: ignore[arg-type]
        return True

    def as_taken(self, c: _Candidate, room: dict[int, float],
                 routes: _Routes | None = None) -> tuple[_Candidate, list[Stripe] | None]:
        """``c`` as step 4 takes it given the spare memory ``room``: a layer whose
        recomputation or exposed GPU-CPU swap costs more than a D2D swap into its NVLink
        neighbours' spare memory goes there (``choose`` with D2D in the choice), with the
        stripes it would take. ``routes``: D2D routes already found in this ``room``."""
        d2d = self.cheaper_d2d(c, room, {} if routes is None else routes)
        if d2d is None:
            return c, None
        extra, need, stripes = d2d
        return _Candidate(c.stage, c.what, need, extra, "peer", c.interval_s, instead_of=c), stripes

    def cheaper_d2d(self, c: _Candidate, room: dict[int, float],
                    routes: _Routes) -> tuple[float, int, list[Stripe]] | None:
        """A D2D swap of ``c``'s activations into ``room`` when it costs less than ``c``:
        (extra seconds per iteration, bytes it moves, stripes); else None. ``routes``
        remembers per (stage, bytes per microbatch) the stripes and the swap's seconds, which
        depend only on ``room``: the caller empties it when ``room`` changes."""
        if self.opts.d2d_only or isinstance(c.what, str) or c.extra_s <= 0:
            return None
        n_bytes = self.ctx.trace.layers[c.what].act_bytes
        need = n_bytes * self.held[c.stage]
        key = (c.stage, n_bytes)
        route = routes.get(key)
        if route is None:
            stripes = self.stripes(c.stage, need, room)
            route = routes[key] = (stripes, 0.0 if stripes is None else self.d2d_seconds(c.stage, n_bytes, stripes))
        stripes, d2d_s = route
        if stripes is None:
            return None
        extra = max(0.0, d2d_s - c.interval_s) * self.ctx.microbatches
        if extra >= c.extra_s:
            return None
        return extra, need, stripes

    def take_next(self, queue: list[_Candidate], room: dict[int, float], routes: _Routes | None = None) -> _Candidate:
        """Pop the candidate with the least extra time per byte as it would be taken now
        (``as_taken``), the first of equals; a D2D swap reserves its stripes in ``room``
        (and empties ``routes``, the D2D routes found in ``room``)."""
        routes = {} if routes is None else routes
        best_i, best_ratio = 0, float("inf")
        for k, c in enumerate(queue):
            d2d = self.cheaper_d2d(c, room, routes)
            ratio = c.extra_s / c.saves_bytes if d2d is None else d2d[0] / d2d[1]
            if ratio < best_ratio or k == 0:
                best_i, best_ratio = k, ratio
                if ratio <= 0.0:  # no extra time: nothing later is cheaper
                    break
        c, stripes = self.as_taken(queue.pop(best_i), room, routes)
        if stripes is not None:
            routes.clear()
        for x in stripes or ():
            room[x.gpu] -= c.saves_bytes * x.fraction
        return c

    def spare_of(self, result: SimResult) -> dict[int, float]:
        return self.ctx.spare(result, SPARE_MARGIN)

    def fit(self, result: SimResult, plan: PlanFile, intervals: dict[int, float]) -> tuple[SimResult, PlanFile]:
        """Step 4: rounds of the initial assignment until every GPU fits."""
        queues = self.initial_candidates(intervals)
        spare = self.spare_of(result)
        for _ in range(MAX_ROUNDS):
            if result.fits:
                break
            moved = False
            for s, g in enumerate(self.ctx.gpus):
                short = over(result, g)
                chosen: list[_Candidate] = []
                covered = 0
                room = dict(spare)
                routes: _Routes = {}
                while covered < short and queues[s]:
                    chosen.append(self.take_next(queues[s], room, routes))
                    covered += chosen[-1].saves_bytes
                # the last pick may cover alone what cheaper earlier picks did: drop those
                # no longer needed, the dearest per byte first
                for c in sorted(chosen[:-1], key=lambda c: -c.extra_s / c.saves_bytes):
                    if covered - c.saves_bytes >= short:
                        chosen.remove(c)
                        covered -= c.saves_bytes
                        queues[s].insert(0, c.instead_of or c)
                for c in chosen:
                    moved |= self.apply(c, spare)
            if not moved:
                break
            result, plan = self.simulate()
            spare = self.spare_of(result)  # what the plan leaves
        return result, plan

    def take_free_offloads(self, result: SimResult, plan: PlanFile) -> tuple[SimResult, PlanFile]:
        """Step 3: stream the optimizer states the end slack hides (``free_offloads``).
        Stages sharing a PCIe route may not all hide theirs: the stages stream, the most
        slack first, as many as keep the simulated iteration no slower. All of them are
        tried first; when that is slower, the count is found by doubling from one stage,
        then bisecting (``_most_free``): O(log n) simulations, where dropping one stage
        at a time took up to n. Both find the same count where a stage more never makes
        the iteration faster (it only adds traffic to the routes); where one did, this
        may keep fewer stages streaming."""
        offloads = self.free_offloads()
        free = sorted(offloads, key=lambda s: -self.slack_s[s])
        tried: dict[int, tuple[SimResult, PlanFile] | None] = {0: (result, plan)}

        def trial(k: int) -> bool:
            self.host_optimizer = {s: set(offloads[s]) for s in free[:k]}
            got = self.simulate()
            tried[k] = got if got[0].iteration_s <= result.iteration_s * (1 + MIN_GAIN) else None
            return tried[k] is not None

        k = len(free) if not free or trial(len(free)) else _most_free(trial, len(free))
        self.host_optimizer = {s: set(offloads[s]) for s in free[:k]}
        kept = tried[k]
        assert kept is not None
        return kept

    def host_swaps_to_recompute(self, result: SimResult, plan: PlanFile) -> tuple[SimResult, PlanFile]:
        """Emulator feedback on step 4's GPU-CPU swaps (Fig. 5, step 5): the cost model
        counts a swap as hidden while its stage's PCIe budget lasts, but the simulated
        iteration may wait on it (swap-ins late, swap-outs landing after the memory is
        needed, optimizer streaming on the same route). Try recomputing every
        recomputable layer step 4 swapped to the host instead; where a GPU then overflows
        (a checkpoint keeps the layer's input), stream one more layer's optimizer states,
        else recompute one more layer, until every GPU fits. Kept only when the simulated
        iteration fits and is faster."""
        rows = self.ctx.trace.layers
        swapped = [(s, j) for s, acts in self.actions.items() for j, a in acts.items()
                   if a.action == "host" and rows[j].kind in RECOMPUTABLE]
        if not swapped:
            return result, plan
        saved_actions = {s: dict(a) for s, a in self.actions.items()}
        saved_optimizer = {s: set(v) for s, v in self.host_optimizer.items()}
        for s, j in swapped:
            self.actions[s][j] = LayerAction(layer=j, action="recompute")
        trial, trial_plan = self.simulate()
        for _ in range(MAX_ROUNDS):
            if trial.fits:
                break
            relieved = [self.relieve(s) for s, g in enumerate(self.ctx.gpus) if over(trial, g) > 0]
            if not any(relieved):
                break
            trial, trial_plan = self.simulate()
        if trial.fits and trial.iteration_s < result.iteration_s * (1 - MIN_GAIN):
            return trial, trial_plan
        self.actions, self.host_optimizer = saved_actions, saved_optimizer
        return result, plan

    def relieve(self, s: int) -> bool:
        """One more saving on stage s: the optimizer states of its last layer still on the
        GPU go to the host, else its recomputable layer without an action that saves the
        most is recomputed. False when neither is left."""
        a, b = self.ctx.stages[s]
        rows = self.ctx.trace.layers
        streamed = self.host_optimizer.setdefault(s, set())
        on_gpu = [j for j in range(a, b) if rows[j].optimizer_bytes and j not in streamed]
        if on_gpu:
            streamed.add(on_gpu[-1])
            return True
        free = [j for j in range(a, b) if rows[j].kind in RECOMPUTABLE and j not in self.actions[s]
                and rows[j].act_bytes > rows[j].input_bytes]
        if not free:
            return False
        j = max(free, key=lambda k: (rows[k].act_bytes - rows[k].input_bytes, -k))
        self.actions[s][j] = LayerAction(layer=j, action="recompute")
        return True

    def tune(self, result: SimResult, plan: PlanFile, intervals: dict[int, float]) -> tuple[SimResult, PlanFile]:
        """Step 5: move the costliest choices to D2D swap while that makes the iteration faster."""
        m = self.ctx.microbatches
        for _ in range(MAX_ROUNDS):
            spare = self.spare_of(result)
            cands: list[tuple[float, int, int]] = []
            for s, acts in self.actions.items():
                held = self.held[s]
                for j, act in acts.items():
                    if act.action not in ("recompute", "host"):
                        continue
                    n_bytes, rec_s, host_s, interval = self.layer_costs(s, j, intervals[j])
                    # a host swap that the PCIe budget let through still costs its share of the route
                    now = rec_s if act.action == "recompute" else max(0.0, host_s - interval) + host_s / m
                    stripes = self.stripes(s, n_bytes * held, spare)
                    if stripes is None:
                        continue
                    d2d = max(0.0, self.d2d_seconds(s, n_bytes, stripes) - interval)
                    if now > d2d:  # the simulation judges contention
                        cands.append(((now - d2d) * m, s, j))
            if not cands:
                break
            cands.sort(key=lambda x: (-x[0], x[1], x[2]))
            batch = cands
            accepted = False
            while batch and not accepted:
                saved = {s: dict(a) for s, a in self.actions.items()}
                room = dict(spare)
                for _, s, j in batch:
                    self.apply(_Candidate(s, j, 0, 0.0, "peer"), room)
                trial, trial_plan = self.simulate()
                if trial.fits and trial.iteration_s < result.iteration_s * (1 - MIN_GAIN):
                    result, plan, accepted = trial, trial_plan, True
                else:
                    self.actions = saved
                    batch = batch[: len(batch) // 2]
            if not accepted:
                break
        return result, plan


def _most_free(no_slower: Callable[[int], bool], n: int) -> int:
    """The largest k < n with ``no_slower(k)`` (0 counts as true, n as false), asking
    1, 2, 4, ... until one is false, then bisecting below it (galloping search)."""
    good, bad = 0, n
    k = 1
    while k < bad:
        if not no_slower(k):
            bad = k
            break
        good, k = k, 2 * k
    while bad - good > 1:
        mid = (good + bad) // 2
        if no_slower(mid):
            good = mid
        else:
            bad = mid
    return good


def plan_mpress(ctx: Ctx, opts: Options, name: str) -> Planned:
    """Steps 1-5 on DAPPLE's map (stage i on GPU i) and, with the mapping search, on the
    map it finds; each without striping and, where allowed, with it. The fastest plan
    that fits is kept (Fig. 5's emulator feedback: a configuration is kept when it beats
    the previous runs), so an option the variant allows is used only where it helps."""
    planned, intervals = keep_first(ctx, name)
    if planned.result.fits:
        return planned
    best: Planned | None = None
    sims = 0
    for map_ctx, keep, map_intervals, map_slack, tried in _variants_to_try(ctx, opts, name, planned, intervals):
        planned = _plan_on_map(map_ctx, tried, name, keep, map_intervals, map_slack)
        sims += planned.simulations
        if best is None or _faster(planned.result, best.result):
            best = planned
    assert best is not None
    return replace(best, simulations=sims)


def mpress_fits(ctx: Ctx, opts: Options, name: str) -> bool:
    """Whether ``plan_mpress`` would find a plan that fits, by existence: the variants in
    its order, each through step 4 (and the recomputation it may start step 5 from),
    stopping at the first that fits. Step 5 keeps only rounds that fit, so a variant
    fits after it exactly when it fits before; the tuning is left to the final plan."""
    planned, intervals = keep_first(ctx, name)
    if planned.result.fits:
        return True
    return any(_fits_on_map(map_ctx, tried, name, keep, map_intervals, map_slack)
               for map_ctx, keep, map_intervals, map_slack, tried in
               _variants_to_try(ctx, opts, name, planned, intervals))


_MAPPINGS: Lru[tuple[object, ...], Mapping] = Lru(CACHE_SIZE)
"""Step 2's maps by (server contents, demand, spare): ``mpress_fits`` and ``plan_mpress`` ask
for the same job's (``search_mapping`` is a function of these alone)."""

_Variant = tuple[Ctx, Planned, dict[int, float], list[float], Options]
"""A map's context, keep-everything plan, live intervals and end slack, and the options tried on it."""


def _variants_to_try(ctx: Ctx, opts: Options, name: str, planned: Planned,
                     intervals: dict[int, float]) -> Iterator[_Variant]:
    """Each stage-to-GPU map (DAPPLE's, then the searched one where it differs) with each
    striping option the variant allows, with the map's keep-everything plan, live
    intervals and end slack; the searched map is made only when asked for."""
    # striping only changes where a D2D swap goes: where no GPU can take one (``Ctx.may_lend``)
    # it would repeat the plan without it, and the first of equals is kept anyway
    tries = [replace(opts, striping=False)] + ([opts] if opts.striping and ctx.may_lend else [])
    slack = end_slack(planned.result, ctx.schedule)
    for tried in tries:
        yield ctx, planned, intervals, slack, tried
    if opts.mapping and not ctx.replicated:  # replicas are placed by their rings (``placement``)
        mapping = _mapping(_Planner(ctx, opts, name, slack), planned.result)
        if list(mapping.gpus) != ctx.gpus:
            mapped_ctx = replace(ctx, gpus=list(mapping.gpus))
            mapped_keep, mapped_intervals = keep_first(mapped_ctx, name)
            mapped_slack = end_slack(mapped_keep.result, ctx.schedule)
            for tried in tries:
                yield mapped_ctx, mapped_keep, mapped_intervals, mapped_slack, tried


def _faster(a: SimResult, b: SimResult) -> bool:
    """Whether ``a`` is the better answer: it fits where ``b`` does not, or both fit and it is faster."""
    return (a.fits, -a.iteration_s) > (b.fits, -b.iteration_s)


def _plan_on_map(ctx: Ctx, opts: Options, name: str, keep: Planned, intervals: dict[int, float],
                 slack: list[float]) -> Planned:
    """Steps 3-5 on the stage-to-GPU map of ``ctx``, from its keep-everything simulation."""
    planner = _Planner(ctx, opts, name, slack)
    result, plan = planner.take_free_offloads(keep.result, keep.plan)
    result, plan = planner.fit(result, plan, intervals)
    if not opts.d2d_only:
        planner, result, plan = _recompute_first_if_faster(ctx, opts, name, planner, result, plan)
        if result.fits:
            result, plan = planner.tune(result, plan, intervals)
            result, plan = planner.host_swaps_to_recompute(result, plan)
    return Planned(plan, result, 1 + planner.sims)


def _fits_on_map(ctx: Ctx, opts: Options, name: str, keep: Planned, intervals: dict[int, float],
                 slack: list[float]) -> bool:
    """Whether ``_plan_on_map`` ends with a plan that fits: its steps 3 and 4, and the
    recomputation step 5 may start from (step 5 itself keeps only plans that fit)."""
    planner = _Planner(ctx, opts, name, slack)
    result, plan = planner.take_free_offloads(keep.result, keep.plan)
    result, plan = planner.fit(result, plan, intervals)
    if result.fits or opts.d2d_only:
        return result.fits
    return _recompute_first_if_faster(ctx, opts, name, planner, result, plan)[1].fits


def _mapping(planner: _Planner, keep: SimResult) -> Mapping:
    """Step 2 on the memory the plan will leave, not the memory before planning: a stage
    whose optimizer streaming is free (``free_offloads``) counts those bytes as spare."""
    free = planner.free_offloads()
    need = [over(keep, g) - planner.optimizer_bytes(s, free.get(s, [])) for s, g in enumerate(planner.ctx.gpus)]
    topo = planner.ctx.topo
    demand, spare = tuple(max(0, x) for x in need), tuple(max(0, -x) for x in need)
    return _MAPPINGS.remember((topo.content_hash, demand, spare), lambda: search_mapping(topo, list(demand),
                                                                                       list(spare)))


def _recompute_first_if_faster(ctx: Ctx, opts: Options, name: str, planner: _Planner, result: SimResult,
                               plan: PlanFile) -> tuple[_Planner, SimResult, PlanFile]:
    """III-D's second observation, prioritise recomputation: when recomputing the fewest
    layers that make every GPU fit (``recompute``) is faster than step 4's assignment,
    the tuning rounds start from it instead. The recompute plan comes from the planner
    cache: ``best`` has made it already for the same job."""
    alt = cached_plan("recompute", ctx, BASELINES["recompute"])
    if not alt.result.fits or (result.fits and alt.result.iteration_s >= result.iteration_s):
        return planner, result, plan
    seeded = _Planner(ctx, opts, name, planner.slack_s)
    seeded.sims = planner.sims + alt.simulations
    seeded.actions = {s: {a.layer: a for a in st.actions} for s, st in enumerate(alt.plan.stages)}
    return seeded, *seeded.simulate()


def _variant(name: str):
    return lambda ctx: plan_mpress(ctx, VARIANTS[name], name)


MPRESS_STRATEGIES = {name: _variant(name) for name in VARIANTS}


def _exists(name: str):
    return lambda ctx: mpress_fits(ctx, VARIANTS[name], name)


MPRESS_EXISTS = {name: _exists(name) for name in VARIANTS}
"""Per variant, ``mpress_fits`` (``Strategy.exists``)."""
