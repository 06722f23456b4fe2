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
  (``collectives.all_to_all_transfer``, across servers ``all_to_all_two_level``), on the
  critical path.

They share links with the data-parallel reductions, pipeline sends and swaps.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import simpy

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import ClusterView
from mpsim.sim.collectives import (
    all_to_all_transfer,
    all_to_all_two_level,
    ring_routes,
    ring_transfer,
    two_level_transfer,
)
from mpsim.sim.context import RunContext
from mpsim.sim.program import CONTEXT_PREFIX
from mpsim.sim.result import Span


class ContextGroup:
    """The context collectives of one stage's context group (module doc)."""

    def __init__(self, run: RunContext, group: Sequence[int], across: int = 1) -> None:
        self.run = run
        self.gpu = group[0]
        self.group = tuple(group)
        self.across = across
        """Servers the group spans (its ``group`` GPUs on each)."""
        self.view = run.topo if isinstance(run.topo, ClusterView) else None
        if across > 1 and self.view is None:
            raise MpsimError("a context group across servers needs a cluster")
        hops = list(ring_routes(run.topo, self.group)[0][:-1]) if len(self.group) > 1 else []
        if across > 1:
            assert self.view is not None
            hops.append(self.view.mirror_route(self.group[-1]))
        elif len(self.group) > 1:
            hops = ring_routes(run.topo, self.group)[0]
        self.ring_hops = hops
        """The flows of one ring step: each GPU's send to its successor (across servers,
        the last local GPU's to the next server)."""
        self.hop_latency_s = max((r.latency_s for r in hops), default=0.0)

    def _transfer(self, key: str, n_bytes: int) -> simpy.Event:
        run = self.run
        op, _, steps = key[len(CONTEXT_PREFIX):].partition("/")
        if op == "send-recv":
            k = int(steps)
            return run.net.transfer_all(self.ring_hops, [k * n_bytes] * len(self.ring_hops), k * self.hop_latency_s)
        if op == "all-to-all":
            if self.across > 1:
                assert self.view is not None
                return all_to_all_two_level(run.net, self.view, self.group, self.across, n_bytes)
            return all_to_all_transfer(run.net, run.topo, self.group, n_bytes)
        if self.across > 1:
            assert self.view is not None
            return two_level_transfer(run.net, self.view, self.group, op, self.across, op, n_bytes)
        return ring_transfer(run.net, run.topo, self.group, op, n_bytes)

    def communicate(self, collectives: Sequence[tuple[str, int]], label: str) -> Generator[simpy.Event, object, None]:
        """Run the piece's context collectives (op key, bytes) one after another and wait for the last."""
        start = self.run.env.now
        for key, n_bytes in collectives:
            yield self._transfer(key, n_bytes)
        self.run.costs.add(self.gpu, "cp_comm_s", self.run.env.now - start)
        self.run.spans.append(Span(self.gpu, "nccl", f"context parallel: {label}", start, self.run.env.now))
