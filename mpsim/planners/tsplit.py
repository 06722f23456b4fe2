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
  default 3% per extra micro-op, ``mpsim.plans.plan``), for p in 2, 4, 8;
- step 3: the better of the two.

Delta M of a saved activation counts every microbatch the stage holds at once; Delta T
counts every microbatch of the iteration. After the predicted shortfall is covered the
iteration is simulated again, and planning goes on from the new shortfall until every
GPU fits or no choice is left (TSPLIT's "fail because of no more available tensors"):
a GPU that does not fit with no choice left fails the plan, so the round that finds one
is the last (the other stages' choices of that round are still simulated), as in the
swap planners' rounds (``baselines._rounds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from mpsim.models.trace import RECOMPUTABLE, LayerRow
from mpsim.planners.context import MAX_ROUNDS, Ctx, Planned, keep_first, over
from mpsim.plans.plan import LayerAction
from mpsim.timing.costs import cost_model

SPLIT_COUNTS = (2, 4, 8)
_Values = TypeVar("_Values", float, np.ndarray)
"""A float, or an array of them priced at once (``_StepOneTable.priced``)."""


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


def swap_cost_s(n_bytes: _Values, bandwidth: float, forward_window_s: _Values, backward_window_s: _Values,
                occupancy: float) -> _Values:
    """TSPLIT eq. 3 for one microbatch: the swap-out not hidden by the forward window, plus
    the swap-in not hidden by the backward window, each window shrunk by the PCIe share
    (``occupancy``) other swaps already use."""
    t = n_bytes / bandwidth
    free = max(0.0, 1.0 - occupancy)
    return np.maximum(t - forward_window_s * free, 0.0) + np.maximum(t - backward_window_s * free, 0.0)


def split_saving(input_bytes: int, output_bytes: int, p: int) -> float:
    """TSPLIT eq. 5: bytes a p-way split saves at its operator."""
    return (p - 1) / p * min(input_bytes, output_bytes)


class _StageSplits:
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
        self.table = _StepOneTable.of(ctx.trace.layers, self.fwd, self.bwd, self.layers)
        rows = ctx.trace.layers
        transient = {j: rows[j].input_bytes + rows[j].output_bytes + rows[j].workspace_bytes for j in self.layers}
        self.splittable = sorted((j for j in self.layers if rows[j].split_dims), key=lambda k: (-transient[k], k))
        """Layers with a splittable dimension, the largest transient (input, output, workspace) first."""

    def occupancy(self) -> float:
        """Oc_u: the share of the stage's period its chosen swaps keep PCIe busy."""
        return min(1.0, self.pcie_busy_s / self.period_s) if self.period_s else 1.0

    def resident(self) -> np.ndarray:
        """Per layer of the stage, whether its tensors still reside (no choice taken on it)."""
        return np.array([j not in self.actions for j in self.layers], dtype=bool)

    def candidates(self) -> list[_Choice]:
        """Every choice of steps 1 and 2 that saves memory, step 1's in layer order."""
        host_dt, host_ok, recompute_ok = self.table.priced(self.resident(), self.bw, self.occupancy(), self.m)
        out: list[_Choice] = []
        for k in np.flatnonzero(host_ok | recompute_ok):
            if host_ok[k]:
                out.append(self.host_choice(int(k), host_dt))
            if recompute_ok[k]:
                out.append(self.recompute_choice(int(k)))
        return out + self.split_choices()

    def cheapest(self) -> _Choice | None:
        """``min(candidates())`` by (Delta T / Delta M, layer, action), priced as arrays: of
        step 1 only each action's cheapest (the first of equals) can be the least."""
        host_dt, host_ok, recompute_ok = self.table.priced(self.resident(), self.bw, self.occupancy(), self.m)
        cands = self.split_choices()
        t = self.table
        if host_ok.any():
            cands.append(self.host_choice(_first_least(host_dt, t.act_bytes * self.held, host_ok), host_dt))
        if recompute_ok.any():
            k = _first_least(t.forward_s * self.m, t.own_bytes * self.held, recompute_ok)
            cands.append(self.recompute_choice(k))
        return min(cands, key=lambda c: (c.ratio, c.layer, c.action), default=None)

    def host_choice(self, k: int, host_dt: np.ndarray) -> _Choice:
        """Step 1's swap of the stage's k-th layer, eq. 3 (``_StepOneTable.priced``)."""
        j = self.layers[k]
        return _Choice(j, "host", self.ctx.trace.layers[j].act_bytes * self.held, float(host_dt[k]))

    def recompute_choice(self, k: int) -> _Choice:
        """Step 1's recomputation of the stage's k-th layer, eq. 4."""
        j = self.layers[k]
        return _Choice(j, "recompute", self.ctx.trace.layers[j].own_bytes * self.held, float(self.fwd[j]) * self.m)

    def split_choices(self) -> list[_Choice]:
        """Step 2: split the operator at the bottleneck, the largest transient not yet split."""
        j = next((k for k in self.splittable if k not in self.actions or self.actions[k].split == 1), None)
        if j is None:
            return []
        r = self.ctx.trace.layers[j]
        out: list[_Choice] = []
        for p in SPLIT_COUNTS:
            dm = split_saving(r.input_bytes, r.output_bytes, p)
            if dm <= 0:
                continue
            slow = LayerAction(layer=j, split=p).slowdown()
            dt = (slow - 1.0) * float(self.fwd[j] + self.bwd[j]) * self.m
            out.append(_Choice(j, "split", dm, dt, p, r.split_dims[0]))
        return out

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
            best = self.cheapest()
            if best is None:
                break
            self.take(best)
            shortfall -= best.delta_m
            moved = True
        return moved


@dataclass
class _StepOneTable:
    """Per layer of a stage, what step 1 prices that does not change as choices are taken
    (eq. 3's windows are summed once, not at every step)."""

    act_bytes: np.ndarray
    """Saved activation bytes per microbatch (float64; exact below 2**53)."""
    own_bytes: np.ndarray
    """What recomputation frees per microbatch: the activations less the input it keeps."""
    recomputable: np.ndarray
    forward_window_s: np.ndarray
    """Computation after the layer, before the bottleneck (the stage's end)."""
    backward_window_s: np.ndarray
    """Backward of later layers, before the layer's own."""
    forward_s: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[LayerRow], fwd: np.ndarray, bwd: np.ndarray, layers: range) -> _StepOneTable:
        b = layers.stop
        return cls(
            act_bytes=np.array([rows[j].act_bytes for j in layers], dtype=float),
            own_bytes=np.array([rows[j].own_bytes for j in layers], dtype=float),
            recomputable=np.array([rows[j].kind in RECOMPUTABLE for j in layers], dtype=bool),
            forward_window_s=np.array([float(fwd[j + 1:b].sum()) for j in layers], dtype=float),
            backward_window_s=np.array([float(bwd[j + 1:b].sum()) for j in layers], dtype=float),
            forward_s=np.array([float(fwd[j]) for j in layers], dtype=float),
        )

    def priced(self, resident: np.ndarray, bandwidth: float, occupancy: float,
               microbatches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per layer: a swap's Delta T over the iteration (``swap_cost_s`` per microbatch), and
        which layers offer a swap and a recomputation (resident, saving bytes)."""
        per_microbatch = swap_cost_s(self.act_bytes, bandwidth, self.forward_window_s, self.backward_window_s,
                                     occupancy)
        host_ok = resident & (self.act_bytes > 0)
        return per_microbatch * microbatches, host_ok, host_ok & self.recomputable & (self.own_bytes > 0)


def _first_least(delta_t: np.ndarray, delta_m: np.ndarray, allowed: np.ndarray) -> int:
    """The first index of the least Delta T / Delta M where ``allowed`` (the ratio of
    ``_Choice``, divided only there)."""
    idx = np.flatnonzero(allowed)
    return int(idx[np.argmin(delta_t[idx] / delta_m[idx])])


def plan_tsplit(ctx: Ctx) -> Planned:
    planned, _ = keep_first(ctx, "tsplit")
    if planned.result.fits:
        return planned
    result, plan, sims = planned.result, planned.plan, 1
    stages = [_StageSplits(ctx, s) for s in range(len(ctx.stages))]
    for _ in range(MAX_ROUNDS):
        moved = stuck = False
        for st, g in zip(stages, ctx.gpus):
            short = over(result, g)
            if short > 0:
                took = st.reduce(short)
                moved |= took
                stuck |= not took
        if not moved:
            break
        plan = ctx.plan("tsplit", {st.s: sorted(st.actions.values(), key=lambda x: x.layer) for st in stages})
        result = ctx.simulate(plan)
        sims += 1
        if result.fits or stuck:
            break
    return Planned(plan, result, sims)
