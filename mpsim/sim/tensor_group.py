"""A stage's tensor-parallel group: the collectives of each layer's shard, on the critical path.

Every GPU of the group runs the same shard (``mpsim.models.tensor_parallel``), so the engine
simulates the group's first GPU; after each piece of its forward or backward the stream
runs the piece's collectives (``Piece.collectives``: Megatron-LM's all-reduces, or under
sequence parallelism its all-gathers and reduce-scatters) over the group's ring and waits
for them (Shoeybi et al. 2019, section 3: the all-reduces are synchronous; their time is
the cost of tensor parallelism). A piece's collectives run fused, as one ring transfer:
each hop of the ring carries the sum of what every one of them sends over it, after the
sum of their steps' latencies (``collectives.ring_transfer``'s model, which on an idle ring
is the step-by-step time exactly). They share links with the stage's data-parallel
collectives, pipeline sends and swaps. The other GPUs of the group are not simulated:
their own sends (the same as the first's, over other links on an NVSwitch) do not load
the links here.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import simpy

from mpsim.sim.collectives import max_hop_bytes, ring_routes, ring_steps
from mpsim.sim.context import RunContext
from mpsim.sim.result import Span


class TensorGroup:
    """The collectives of one stage's tensor-parallel group (module doc)."""

    def __init__(self, run: RunContext, ring: Sequence[int]) -> None:
        self.run = run
        self.gpu = ring[0]
        self.ring = tuple(ring)
        self.routes, self.latency_s = ring_routes(run.topo, self.ring)

    def communicate(self, collectives: Sequence[tuple[str, int]], label: str) -> Generator[simpy.Event, object, None]:
        """Run ``collectives`` (op, bytes) fused over the ring and wait for the last hop."""
        n = len(self.ring)
        per_hop = sum(max_hop_bytes(op, n_bytes, n) for op, n_bytes in collectives)
        latency_s = sum(ring_steps(op, n) for op, _ in collectives) * self.latency_s
        start = self.run.env.now
        yield self.run.net.transfer_all(self.routes, [per_hop] * n, latency_s)
        self.run.costs.add(self.gpu, "tp_comm_s", self.run.env.now - start)
        self.run.spans.append(Span(self.gpu, "nccl", f"tensor parallel: {label}", start, self.run.env.now))
