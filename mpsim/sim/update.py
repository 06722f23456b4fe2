"""A stage's optimizer step, where its optimizer states live (``StagePlan.optimizer``)."""

from __future__ import annotations

from collections.abc import Generator

import simpy

from mpsim.sim.context import RunContext
from mpsim.sim.program import update_seconds
from mpsim.sim.swapper import Swapper


class Updater:
    """The optimizer step of one stage on its compute stream.

    Timing: ``gpu``: memory-bound Adam on the GPU (``update_seconds``). ``host-update``:
    gradients to the host, Adam on the CPU at the host's rate, weights back
    (ZeRO-Offload), the stream idle meanwhile. ``host-stream``: layer by layer, states
    in, Adam on the GPU, states out; the out copy overlaps the next layer's work, the in
    copy does not overlap the update. Time beyond the GPU update is the optimizer's cost."""

    def __init__(self, run: RunContext, stage: int, swapper: Swapper, gpu_update_s: float, param_bytes: int) -> None:
        self.run = run
        self.stage = stage
        self.gpu = run.layout.gpu_of[stage]
        self.mode = run.layout.optimizer[stage]
        a, b = run.layout.stages[stage]
        self.rows = run.layout.trace.layers[a:b]
        self.first_layer = a
        self.swapper = swapper
        self.gpu_update_s = gpu_update_s
        self.param_bytes = param_bytes
        self.ends_s: list[float] = []
        """When each update ended (PipeDream's iteration is measured between them)."""

    def update(self) -> Generator[simpy.Event, object, None]:
        run = self.run
        start = run.env.now
        if self.mode == "gpu":
            yield run.env.timeout(self.gpu_update_s)
        elif self.mode == "host-update":
            yield from self._on_host()
        else:
            yield from self._streamed()
        if self.mode != "gpu":
            run.costs.add(self.gpu, "optimizer_s", run.env.now - start - self.gpu_update_s)
        self.ends_s.append(run.env.now)

    def _on_host(self) -> Generator[simpy.Event, object, None]:
        run, g = self.run, self.gpu
        yield from run.host_copy(g, sum(r.grad_bytes for r in self.rows), True, "gradients to host")
        yield run.env.timeout(sum(r.params for r in self.rows) / (run.topo.spec.host.cpu_adam_gparams_per_s * 1e9))
        yield from run.host_copy(g, self.param_bytes, False, "weights from host")

    def _streamed(self) -> Generator[simpy.Event, object, None]:
        run, g = self.run, self.gpu
        gpu = run.topo.spec.gpu
        memory_rate = gpu.memory_bandwidth_gbps * 1e9 * gpu.memory_efficiency
        for k, row in enumerate(self.rows):
            j, n_opt = self.first_layer + k, row.optimizer_bytes
            if not n_opt:
                continue
            label = f"layer {j} optimizer states streamed in"
            yield from run.memory[g].acquire([(n_opt, "optimizer", label), (-n_opt, "saved:optimizer", label)])
            yield from run.host_copy(g, n_opt, False, f"optimizer states in L{j}")
            yield run.env.timeout(update_seconds([row], memory_rate))
            self.swapper.start_optimizer_out(j, n_opt)
