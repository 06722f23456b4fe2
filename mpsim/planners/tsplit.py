"""TSPLIT's model-guided planning (papers/tsplit.txt IV, Algorithm 2), per pipeline stage.

The operation schedule is a stage's layers; the memory bottleneck is the stage's peak in
a simulated iteration, and the memory to find is how far it exceeds the GPU. Until the
predicted requirement fits, each step takes the choice with the least extra time per
byte saved (Delta T / Delta M):

- step 1, non-split, on tensors that still reside: swap to host (eq. 3: the transfer
  time not hidden behind the computation between the layer and the bottleneck in the
  forward, and between the prefetch and the use in the backward, with the PCIe share
  already taken by chosen swaps, Oc_u, removed from those windows) or recompute (eq. 4:
  the layer's forward again; its input stays as checkpoint, so it saves the rest);
- step 2, split, on the operator at the bottleneck (its input plus output plus
  workspace is the largest of the stage): p micro-ops along a splittable dimension save
  (p - 1) / p x min(input, output) (eq. 5) at the cost of the split slowdown (eq. 6; the
  default 3% per extra micro-op, ``mpsim.plan``), for p in 2, 4, 8;
- step 3: the better of the two.

Delta M of a saved activation counts every microbatch the stage holds at once; Delta T
counts every microbatch of the iteration. After the predicted shortfall is covered the
iteration is simulated again, and planning goes on from the new shortfall until every
GPU fits or no choice is left (TSPLIT's "fail because of no more available tensors").
"""

from __future__ import annotations

from dataclasses import dataclass

from mpsim.costs import cost_model
from mpsim.plan import LayerAction
from mpsim.planners.context import MAX_ROUNDS, Ctx, Planned, keep_first, over
from mpsim.trace import RECOMPUTABLE

SPLIT_COUNTS = (2, 4, 8)


@dataclass
class _Choice:
    layer: int
    action: str
    """``host``, ``recompute`` or ``split``."""
    delta_m: float
    delta_t: float
    split: int = 1
    dim: str | None = None

    @property
    def ratio(self) -> float:
        return self.delta_t / self.delta_m


def swap_cost_s(n_bytes: float, bandwidth: float, forward_window_s: float, backward_window_s: float,
                occupancy: float) -> float:
    """TSPLIT eq. 3 for one microbatch: the swap-out not hidden by the forward window, plus
    the swap-in not hidden by the backward window, each window shrunk by the PCIe share
    (``occupancy``) other swaps already use."""
    t = n_bytes / bandwidth
    free = max(0.0, 1.0 - occupancy)
    return max(t - forward_window_s * free, 0.0) + max(t - backward_window_s * free, 0.0)


def split_saving(input_bytes: int, output_bytes: int, p: int) -> float:
    """TSPLIT eq. 5: bytes a p-way split saves at its operator."""
    return (p - 1) / p * min(input_bytes, output_bytes)


class _Stage:
    def __init__(self, ctx: Ctx, s: int) -> None:
        self.ctx, self.s = ctx, s
        a, b = ctx.stages[s]
        self.layers = range(a, b)
        times = cost_model(ctx.trace, ctx.topo.spec.gpu).layer_times
        self.fwd, self.bwd = times.fwd_s, times.bwd_s
        self.bw = ctx.topo.route(ctx.gpus[s], "host").bandwidth
        self.period_s = float(self.fwd[a:b].sum() + self.bwd[a:b].sum())
        self.held = ctx.held_microbatches(s)
        self.m = ctx.microbatches
        self.pcie_busy_s = 0.0
        self.actions: dict[int, LayerAction] = {}

    def candidates(self) -> list[_Choice]:
        rows = self.ctx.trace.layers
        b = self.layers.stop
        occ = min(1.0, self.pcie_busy_s / self.period_s) if self.period_s else 1.0
        out: list[_Choice] = []
        for j in self.layers:  # step 1: tensors that still reside
            r = rows[j]
            if j in self.actions or not r.act_bytes:
                continue
            fwd_window = float(self.fwd[j + 1:b].sum())  # computation after j, before the bottleneck
            bwd_window = float(self.bwd[j + 1:b].sum())  # backward of later layers, before j's
            t = swap_cost_s(r.act_bytes, self.bw, fwd_window, bwd_window, occ)
            out.append(_Choice(j, "host", r.act_bytes * self.held, t * self.m))
            own = r.act_bytes - (r.input_bytes if r.saves_input else 0)
            if r.kind in RECOMPUTABLE and own > 0:
                out.append(_Choice(j, "recompute", own * self.held, float(self.fwd[j]) * self.m))
        # step 2: split the operator at the bottleneck, the largest transient not yet split
        open_ = [j for j in self.layers if rows[j].split_dims and self.actions.get(j, LayerAction(layer=j)).split == 1]
        if open_:
            j = max(open_, key=lambda k: (rows[k].input_bytes + rows[k].output_bytes + rows[k].workspace_bytes, -k))
            r = rows[j]
            for p in SPLIT_COUNTS:
                dm = split_saving(r.input_bytes, r.output_bytes, p)
                if dm <= 0:
                    continue
                slow = LayerAction(layer=j, split=p).slowdown()
                dt = (slow - 1.0) * float(self.fwd[j] + self.bwd[j]) * self.m
                out.append(_Choice(j, "split", dm, dt, p, r.split_dims[0]))
        return [c for c in out if c.delta_m > 0]

    def take(self, c: _Choice) -> None:
        rows = self.ctx.trace.layers
        prev = self.actions.get(c.layer, LayerAction(layer=c.layer))
        if c.action == "split":
            self.actions[c.layer] = prev.model_copy(update={"split": c.split, "split_dim": c.dim})
        else:
            self.actions[c.layer] = prev.model_copy(update={"action": c.action})
            if c.action == "host":
                self.pcie_busy_s += 2 * rows[c.layer].act_bytes / self.bw

    def reduce(self, shortfall: float) -> bool:
        """Algorithm 2's inner loop: choices until ``shortfall`` bytes are covered."""
        moved = False
        while shortfall > 0:
            cands = self.candidates()
            if not cands:
                break
            best = min(cands, key=lambda c: (c.ratio, c.layer, c.action))
            self.take(best)
            shortfall -= best.delta_m
            moved = True
        return moved


def plan_tsplit(ctx: Ctx) -> Planned:
    planned, _ = keep_first(ctx, "tsplit")
    if planned.result.fits:
        return planned
    result, plan, sims = planned.result, planned.plan, 1
    stages = [_Stage(ctx, s) for s in range(len(ctx.stages))]
    for _ in range(MAX_ROUNDS):
        moved = False
        for st, g in zip(stages, ctx.gpus):
            short = over(result, g)
            if short > 0:
                moved |= st.reduce(short)
        if not moved:
            break
        plan = ctx.plan("tsplit", {st.s: sorted(st.actions.values(), key=lambda x: x.layer) for st in stages})
        result = ctx.simulate(plan)
        sims += 1
        if result.fits:
            break
    return Planned(plan, result, sims)
