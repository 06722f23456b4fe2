"""The closed-form tier in front of the simulator: what a job needs at least, with no
simulation, so that searches skip the candidates these floors already decide.

For a job (``JobSpec``: server, trace, schedule, microbatches, layout) under a strategy:

- **Static memory, exact**: the model states each stage allocates before its first task
  (``mpsim.sim.program.static_bytes`` on the keep-everything layout's compute-balanced
  partition: weights, gradients, optimizer states, PipeDream's stashed weights), as the
  engine allocates them.
- **Memory floor**: the weights and gradients of a GPU stay on it from the first task to
  the last under every plan of a strategy that does not offload model states (only the
  ZeRO-Offload and ZeRO-Infinity strategies do; ``Strategy.offloads_model_states``); the
  ledger holds them from time 0, so a GPU whose share exceeds its capacity runs out.
  Under a strategy none of whose plans streams the optimizer states to the host
  (``Strategy.optimizer_on_gpu``: keep, recompute, D2D swap, TSPLIT) they stay too, and
  count with them.
  Every partition puts each layer on some GPU, so the mean over the pipeline's GPUs is
  a floor on the largest: when it exceeds the capacity, no partition fits.
- **Storage floor**: every model state of the simulated rank (weights, gradients,
  optimizer states) lives on a GPU or in host memory (or on NVMe, under ZeRO-Infinity);
  when they exceed all the server's GPU memory plus the rank's share of those, nothing
  fits.
- **Time floor** (1F1B, GPipe and their interleaved forms; not PipeDream, whose
  iteration is a steady-state window): each GPU runs its tasks one at a time on its
  compute stream, and no plan makes a layer's forward or backward shorter than keeping
  everything does (recomputation and splitting add). So the iteration takes at least
  the busiest GPU's ``m x (forward + backward)``, and ``mpsim.plans.partition.compute_balanced``
  minimises that maximum exactly over all partitions (interleaved: the mean over the
  GPUs); and at least one microbatch's forward and backward through every layer (it
  passes them in order).

Each floor is on the right side of the simulator's answer by these arguments; the test
``tests/test_bounds.py`` checks them against simulations of every strategy over random
jobs, and that the searches using them give the same answers as without.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from mpsim.plans.job import JobSpec
from mpsim.plans.schedule import weight_versions
from mpsim.plans.strategies import strategy_named
from mpsim.sim.engine import sharding_of
from mpsim.sim.layout import Job, Layout, resolve
from mpsim.sim.program import NOT_SHARDED, static_bytes
from mpsim.timing.costs import cost_model
from mpsim.units import GiB


@dataclass(frozen=True)
class Floors:
    """One job's closed-form figures (``floors``)."""

    static_bytes: tuple[int, ...]
    """Per stage, what the keep-everything plan allocates before the first task (exact)."""
    resident_floor_bytes: int
    """Mean over the pipeline's GPUs of the model states that stay on them: weights and
    gradients, with the optimizer states under a strategy that keeps them there (0 under a
    strategy that offloads model states)."""
    counts_optimizer: bool
    """Whether ``resident_floor_bytes`` counts the optimizer states (``Strategy.optimizer_on_gpu``)."""
    states_bytes: int
    """The simulated rank's model states: weights, gradients and optimizer states."""
    room_bytes: int
    """Where they may live: every GPU of the server, the rank's host and NVMe shares."""
    capacity_bytes: int
    iteration_floor_s: float | None
    """No plan's iteration is shorter (None: PipeDream)."""

    def cannot_fit(self) -> str:
        """Why no plan of the strategy fits, or ``""`` when the floors do not decide it."""
        if self.resident_floor_bytes > self.capacity_bytes:
            what = "weights, gradients and optimizer states" if self.counts_optimizer else "weights and gradients"
            return (f"{what} alone need {self.resident_floor_bytes / GiB:.2f} GiB per GPU "
                    f"of {self.capacity_bytes / GiB:.2f}")
        if self.states_bytes > self.room_bytes:
            return (f"model states of {self.states_bytes / GiB:.0f} GiB exceed all GPU, host and NVMe memory "
                    f"({self.room_bytes / GiB:.0f} GiB)")
        return ""

    def max_samples_per_s(self, samples_per_iteration: int) -> float:
        """No plan is faster (inf without a time floor)."""
        if not self.iteration_floor_s:
            return float("inf")
        return samples_per_iteration / self.iteration_floor_s


def floors(job: JobSpec) -> Floors:
    """The floors of ``job`` under ``job.strategy`` (a combining one: under every plan it may pick)."""
    layout = resolve(Job(job))
    sharding = sharding_of(layout) or NOT_SHARDED
    rows = layout.trace.layers
    stage_static = tuple(sum(static_bytes(rows[a:b], weight_versions(layout.schedule, s, layout.n_stages), 0,
                                          sharding).values()) for s, (a, b) in enumerate(layout.stages))
    everything = static_bytes(rows, 1, 0, sharding)
    n_gpus = len(set(layout.gpu_of))
    strategy = strategy_named(job.strategy)
    offloads = strategy.offloads_model_states
    states = everything["params"] + everything["grads"] + everything["optimizer"]
    staying = states if strategy.optimizer_on_gpu else everything["params"] + everything["grads"]
    resident = 0 if offloads else staying // n_gpus
    topo = layout.topology
    return Floors(stage_static, resident, strategy.optimizer_on_gpu, states, _room_bytes(layout, offloads),
                  topo.capacity_bytes, _iteration_floor_s(layout))


def _room_bytes(layout: Layout, with_nvme: bool) -> int:
    """Every GPU the engine simulates, and the rank's shares of host memory and, for a
    strategy that offloads model states (ZeRO-Infinity's NVMe), of NVMe
    (``RunContext.host_share_bytes``, ``nvme_share_bytes``)."""
    topo = layout.topology
    nvme = topo.spec.nvme if with_nvme else None
    off_gpu = topo.host_memory_bytes + (0 if nvme is None else int(nvme.capacity_gib * GiB))
    return topo.n_gpus * topo.capacity_bytes + off_gpu * layout.view_servers // layout.host_ways


def _iteration_floor_s(layout: Layout) -> float | None:
    if layout.schedule == "pipedream":
        return None
    times = cost_model(layout.trace, layout.topology.spec.gpu).layer_times
    per_layer = np.asarray(times.fwd_s) + np.asarray(times.bwd_s)
    one_microbatch = float(per_layer.sum())
    if layout.parallelism.virtual_stages > 1:
        busiest = one_microbatch / (layout.parallelism.pipeline or 1)
    else:  # the keep layout's stages are compute_balanced's on these costs (``resolve``)
        busiest = max(float(per_layer[a:b].sum()) for a, b in layout.stages)
    return max(layout.microbatches * busiest, one_microbatch)


_IN_USE: ContextVar[bool] = ContextVar("mpsim_floors_in_use", default=True)


def in_use() -> bool:
    """Whether searches let the floors decide candidates (``without_floors`` turns them off)."""
    return _IN_USE.get()


@contextmanager
def without_floors() -> Iterator[None]:
    """Searches inside the block simulate every candidate (the same-verdict test and
    ``benchmarks/bench_floors.py`` compare the two; worker processes keep the floors)."""
    token = _IN_USE.set(False)
    try:
        yield
    finally:
        _IN_USE.reset(token)
