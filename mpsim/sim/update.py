"""A stage's optimizer step, where its optimizer states live (``StagePlan.optimizer``)."""

from __future__ import annotations

import math
from collections.abc import Generator

import simpy

from mpsim.models.trace import LayerRow
from mpsim.sim.context import RunContext
from mpsim.sim.simpy_fast import sleep
from mpsim.sim.swapper import Swapper
from mpsim.timing.costs import CostModel


class Updater:
    """The optimizer step of one stage on its compute stream.

    Timing: ``gpu``: memory-bound Adam on the GPU (``CostModel.update_s``). ``host-update``:
    gradients to the host, Adam on the CPU at the host's rate, weights back
    (ZeRO-Offload), the stream idle meanwhile. ``host-stream``: layer by layer, states
    in, Adam on the GPU, states out; the out copy overlaps the next layer's work, the in
    copy does not overlap the update. Only the layers whose states live on the host
    (``Layout.host_optimizer``) go through the host; the others update on the GPU first.
    Time beyond the GPU update is the optimizer's cost. Under ZeRO stage 1 and above
    (``shards`` > 1) the GPU owns 1/N of the states: every time and byte above is its
    shard's."""

    def __init__(self, run: RunContext, stage: int, swapper: Swapper, costs: CostModel, shards: float = 1,
                 grads_on_host: bool = False) -> None:
        self.run = run
        self.stage = stage
        self.gpu = run.layout.gpu_of[stage]
        self.mode = run.layout.optimizer[stage]
        a, b = run.layout.stages[stage]
        rows = run.layout.trace.layers
        on_host = set(run.layout.host_optimizer[stage])
        self.shards = shards
        self.grads_on_host = grads_on_host
        """The gradient shards are on the host already (``Sharding.offload_grads``)."""
        self.host_rows = [(j, rows[j], costs.update_s([rows[j]]) / shards) for j in range(a, b) if j in on_host]
        """The layers whose optimizer states live on the host: index, row, GPU update seconds."""
        self.gpu_rows_s = costs.update_s([rows[j] for j in range(a, b) if j not in on_host]) / shards
        """The update of the layers whose states stay on the GPU."""
        self.swapper = swapper
        self.gpu_update_s = costs.update_s(rows[a:b]) / shards
        """The whole stage updated on the GPU (the optimizer's cost is the time beyond it)."""
        self.ends_s: list[float] = []
        """When each update ended (PipeDream's iteration is measured between them)."""

    def update(self) -> Generator[simpy.Event, object, None]:
        run = self.run
        start = run.env.now
        if self.mode == "gpu":
            yield sleep(run.env, self.gpu_update_s)
        elif self.mode == "host-update":
            yield from self._on_host()
        else:
            yield from self._streamed()
        if self.mode != "gpu":
            run.costs.add(self.gpu, "optimizer_s", run.env.now - start - self.gpu_update_s)
        self.ends_s.append(run.env.now)

    def _on_gpu(self) -> Generator[simpy.Event, object, None]:
        """The update of the layers whose states stay on the GPU."""
        if self.gpu_rows_s:
            yield sleep(self.run.env, self.gpu_rows_s)

    def _on_host(self) -> Generator[simpy.Event, object, None]:
        run, g = self.run, self.gpu
        yield from self._on_gpu()
        rows = [r for _, r, _ in self.host_rows]
        if not self.grads_on_host:  # ZeRO-Offload sent each gradient shard as its reduction landed
            yield from run.host_copy(g, self._shard(sum(r.grad_bytes for r in rows)), True, "gradients to host")
        yield sleep(run.env, self._host_adam_s(rows))
        if not run.layout.offload_params:  # offloaded shards stay off the GPU until gathered
            yield from run.host_copy(g, self._shard(sum(r.trained_param_bytes for r in rows)), False,
                                     "weights from host")

    def _host_adam_s(self, rows: list[LayerRow]) -> float:
        """Adam on the CPU over this GPU's shard of ``rows``: every replica updates at
        once, so the host's rate is shared ``replicas`` ways; with the states on NVMe the
        step also reads and writes them there, overlapped with the CPU's work (the slower
        of the two)."""
        run = self.run
        params = sum(r.trained_params for r in rows) / self.shards
        cpu_s = params * run.replicas / run.topo.spec.host.adam_params_per_s
        if run.offload is not run.nvme:
            return cpu_s
        states = self._shard(sum(r.optimizer_bytes for r in rows))
        return max(cpu_s, run.nvme_seconds(states, write=False) + run.nvme_seconds(states, write=True))

    def _shard(self, n_bytes: int) -> int:
        return math.ceil(n_bytes / self.shards) if isinstance(self.shards, float) else -(-n_bytes // self.shards)

    def _streamed(self) -> Generator[simpy.Event, object, None]:
        run, g = self.run, self.gpu
        yield from self._on_gpu()
        for j, row, update_s in self.host_rows:
            n_opt = self._shard(row.optimizer_bytes)
            if not n_opt:
                continue
            label = f"layer {j} optimizer states streamed in"
            yield from run.memory[g].acquire([(n_opt, "optimizer", label), (-n_opt, "saved:optimizer", label)])
            yield from run.host_copy(g, n_opt, False, f"optimizer states in L{j}")
            yield sleep(run.env, update_s)
            self.swapper.start_optimizer_out(j, n_opt)
