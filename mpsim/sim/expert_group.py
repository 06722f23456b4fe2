"""A stage's expert-parallel group: each MoE layer's all-to-alls, on the critical path.

Every GPU of the group runs the same shard (``mpsim.models.expert_parallel``: the dense part
whole, 1/e of the routed experts), the simulated one the busiest under the job's expert
load. After each MoE layer's pass the stream runs its all-to-alls and waits for them
(``Piece.collectives``, op ``all-to-all``): the forward's dispatch (each token's routed
copies to their experts' GPUs) and combine (the experts' outputs back), the backward's
two in reverse, a recomputed forward's two again. Megatron-Core's default MoE layer runs
them synchronously between the router and the experts and after the experts, so they are
not hidden behind compute here (an overlapped runtime, DualPipe-style, is not modelled).

Each runs as NCCL's flat all-to-all (``collectives.all_to_all_transfer``; across servers
``all_to_all_two_level``, the shares for other servers through each GPU's NIC), every GPU
of the group sending ``LayerRow.dispatch_bytes`` (the busiest GPU's volume: the load
factor is already in the shard's bytes), sharing links with the data-parallel reductions,
pipeline sends and swaps.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import simpy

from mpsim.hardware.cluster import ClusterView
from mpsim.sim.collectives import all_to_all_transfer, all_to_all_two_level
from mpsim.sim.context import RunContext
from mpsim.sim.result import Span


class ExpertGroup:
    """The all-to-alls of one stage's expert-parallel group (module doc)."""

    def __init__(self, run: RunContext, group: Sequence[int], across: int = 1) -> None:
        self.run = run
        self.gpu = group[0]
        self.group = tuple(group)
        self.across = across
        """Servers the group spans (its ``group`` GPUs on each)."""
        self.view = run.topo if isinstance(run.topo, ClusterView) else None

    def _transfer(self, n_bytes: int) -> simpy.Event:
        run = self.run
        if self.across > 1:
            assert self.view is not None
            return all_to_all_two_level(run.net, self.view, self.group, self.across, n_bytes)
        return all_to_all_transfer(run.net, run.topo, self.group, n_bytes)

    def communicate(self, collectives: Sequence[tuple[str, int]], label: str) -> Generator[simpy.Event, object, None]:
        """Run the piece's all-to-alls (op, bytes) one after another and wait for the last."""
        start = self.run.env.now
        for _op, n_bytes in collectives:
            yield self._transfer(n_bytes)
        self.run.costs.add(self.gpu, "ep_comm_s", self.run.env.now - start)
        self.run.spans.append(Span(self.gpu, "nccl", f"expert parallel: {label}", start, self.run.env.now))
