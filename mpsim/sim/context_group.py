"""A stage's context-parallel group: each attention layer's communication.

Every GPU of the group runs the same shard (``mpsim.models.context_parallel``), so the
engine simulates the first. Its layers' context collectives (``Collective.axis`` context)
run here:

- ``send-recv``: a ring step of ring attention. Every GPU sends its successor the same
  bytes at once, so one step loads each hop of the ring with ``n_bytes``; the ``steps``
  steps of a pass run fused, as one flow per hop of ``steps x n_bytes`` after ``steps``
  hop latencies (the step-by-step time on an idle ring). Across servers the ring leaves
  each server once through a NIC: the flow of the simulated server's last GPU to its
  counterpart on the next server (``ClusterView.mirror_route``) carries the same bytes.
  The stream runs them beside the last (c-1)/c of the layer's attention
  (``Piece.overlap_s``): hidden while the blocks take longer than the sends, exposed by
  the difference when not (Liu et al. 2023, section 3: the overlap holds while a block's
  compute outlasts its send).
- ``all-gather`` and ``reduce-scatter`` (Llama 3's all-gather attention): one ring over the
  group, or two levels across servers (``collectives.two_level_transfer``), on the
  critical path.
- ``all-to-all`` (DeepSpeed-Ulysses): NCCL's flat all-to-all over the group
  (``GroupComm.all_to_all``), on the critical path.

They share links with the data-parallel reductions, pipeline sends and swaps.
"""

from __future__ import annotations

from collections.abc import Sequence

import simpy

from mpsim.sim.collectives import ring_routes, ring_transfer, two_level_transfer
from mpsim.sim.context import RunContext
from mpsim.sim.group_comm import GroupComm
from mpsim.sim.program import CONTEXT_PREFIX


class ContextGroup(GroupComm):
    """The context collectives of one stage's context group (module doc)."""

    COST = "cp_comm_s"
    LABEL = "context parallel"

    def __init__(self, run: RunContext, group: Sequence[int], across: int = 1) -> None:
        super().__init__(run, group, across)
        hops = ring_routes(run.topo, self.group)[0] if len(self.group) > 1 else []
        if self.view is not None and across > 1:  # the wrap-around hop leaves the server
            hops = [*hops[:-1], self.view.mirror_route(self.group[-1])]
        self.ring_hops = hops
        """The flows of one ring step: each GPU's send to its successor (across servers,
        the last local GPU's to the next server)."""
        self.hop_latency_s = max((r.latency_s for r in hops), default=0.0)

    def _transfer(self, key: str, n_bytes: int) -> simpy.Event:
        op, _, steps = key[len(CONTEXT_PREFIX):].partition("/")
        if op == "send-recv":
            k = int(steps)
            return self.run.net.transfer_all(self.ring_hops, [k * n_bytes] * len(self.ring_hops),
                                             k * self.hop_latency_s)
        if op == "all-to-all":
            return self.all_to_all(n_bytes)
        if self.view is not None and self.across > 1:
            return two_level_transfer(self.run.net, self.view, self.group, op, self.across, op, n_bytes)
        return ring_transfer(self.run.net, self.run.topo, self.group, op, n_bytes)
