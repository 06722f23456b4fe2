"""The groups a stage's layers communicate over, one dispatcher for the stream.

A piece's collectives (``Piece.collectives``) belong to the tensor-parallel group
(all-reduce, all-gather, reduce-scatter: ``mpsim.sim.tensor_group``), the expert-parallel
group (the MoE all-to-alls: ``mpsim.sim.expert_group``) or the context-parallel group (ops
named ``context/...``: ``mpsim.sim.context_group``). ``communicate`` runs each owner's in
the piece's order, one owner's run after another's; ``split`` says which of them run beside
the piece's compute (``Piece.overlap_s``): a ring attention's sends always do, the others
only under a runtime profile that overlaps their group's communication.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

import simpy

from mpsim.errors import MpsimError
from mpsim.sim.context_group import ContextGroup
from mpsim.sim.expert_group import ExpertGroup
from mpsim.sim.program import CONTEXT_PREFIX, is_ring_step
from mpsim.sim.tensor_group import TensorGroup

Collectives = Sequence[tuple[str, int]]


@dataclass
class LayerGroups:
    """A stage's tensor, expert and context groups (None: the layout has no such axis)."""

    tensor: TensorGroup | None = None
    expert: ExpertGroup | None = None
    context: ContextGroup | None = None
    overlaps_others: bool = False
    """The runtime overlaps the tensor or expert group's communication with GEMMs."""

    def _owner(self, op: str) -> TensorGroup | ExpertGroup | ContextGroup:
        owner = self.context if op.startswith(CONTEXT_PREFIX) else self.expert if op == "all-to-all" else self.tensor
        if owner is None:
            raise MpsimError(f"a layer runs {op} over a group this layout does not have")
        return owner

    def communicate(self, collectives: Collectives, label: str) -> Generator[simpy.Event, object, None]:
        """Run ``collectives`` in order, each run of one owner's fused as that owner runs them."""
        run: list[tuple[str, int]] = []
        for item in collectives:
            if run and self._owner(run[0][0]) is not self._owner(item[0]):
                yield from self._owner(run[0][0]).communicate(run, label)
                run = []
            run.append(item)
        if run:
            yield from self._owner(run[0][0]).communicate(run, label)

    def split(self, collectives: Collectives) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(run beside the piece's compute, run after it): a ring's sends beside, the others
        beside too when the runtime overlaps them."""
        beside: list[tuple[str, int]] = []
        after: list[tuple[str, int]] = []
        for c in collectives:
            (beside if self.overlaps_others or is_ring_step(c[0]) else after).append(c)
        return beside, after
