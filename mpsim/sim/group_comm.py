"""What the expert- and context-parallel groups share: a group of GPUs on the simulated
servers, repeated on ``across`` servers, whose collectives a piece runs one after another,
their time a cost of the GPU and a span on its ``nccl`` lane; and NCCL's flat all-to-all over
it (``collectives.all_to_all_transfer``; across servers ``all_to_all_two_level``, each GPU's
shares for other servers through its NIC)."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import simpy

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import ClusterView
from mpsim.sim.collectives import all_to_all_transfer, all_to_all_two_level
from mpsim.sim.context import RunContext
from mpsim.sim.result import Span


class GroupComm:
    """A stage's group of ``group`` GPUs on each of ``across`` servers (module doc);
    subclasses say how each collective runs (``_transfer``), the cost it is charged to
    (``COST``) and how spans name it (``LABEL``)."""

    COST = ""
    LABEL = ""

    def __init__(self, run: RunContext, group: Sequence[int], across: int = 1) -> None:
        self.run = run
        self.gpu = group[0]
        self.group = tuple(group)
        self.across = across
        """Servers the group spans (its ``group`` GPUs on each)."""
        self.view = run.topo if isinstance(run.topo, ClusterView) else None
        if across > 1 and self.view is None:
            raise MpsimError(f"a {self.LABEL} group across servers needs a cluster")

    def _transfer(self, key: str, n_bytes: int) -> simpy.Event:
        raise NotImplementedError

    def all_to_all(self, n_bytes: int) -> simpy.Event:
        """NCCL's flat all-to-all over the group, each GPU sending ``n_bytes``, started now."""
        if self.view is not None and self.across > 1:
            return all_to_all_two_level(self.run.net, self.view, self.group, self.across, n_bytes)
        return all_to_all_transfer(self.run.net, self.run.topo, self.group, n_bytes)

    def communicate(self, collectives: Sequence[tuple[str, int]], label: str) -> Generator[simpy.Event, object, None]:
        """Run the piece's collectives (op key, bytes) one after another and wait for the last."""
        start = self.run.env.now
        for key, n_bytes in collectives:
            yield self._transfer(key, n_bytes)
        self.run.costs.add(self.gpu, self.COST, self.run.env.now - start)
        self.run.spans.append(Span(self.gpu, "nccl", f"{self.LABEL}: {label}", start, self.run.env.now))
