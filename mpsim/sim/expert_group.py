"""A stage's expert-parallel group: each MoE layer's all-to-alls, on the critical path.

Every GPU of the group runs the same shard (``mpsim.models.expert_parallel``: the dense part
whole, 1/e of the routed experts), the simulated one the busiest under the job's expert
load. After each MoE layer's pass the stream runs its all-to-alls and waits for them
(``Piece.collectives``, op ``all-to-all``): the forward's dispatch (each token's routed
copies to their experts' GPUs) and combine (the experts' outputs back), the backward's
two in reverse, a recomputed forward's two again. Megatron-Core's default MoE layer runs
them synchronously between the router and the experts and after the experts, so they are
not hidden behind compute here (an overlapped runtime, DualPipe-style, is not modelled).

Each runs as NCCL's flat all-to-all (``GroupComm.all_to_all``), every GPU
of the group sending ``LayerRow.dispatch_bytes`` (the busiest GPU's volume: the load
factor is already in the shard's bytes), sharing links with the data-parallel reductions,
pipeline sends and swaps.
"""

from __future__ import annotations

import simpy

from mpsim.sim.group_comm import GroupComm


class ExpertGroup(GroupComm):
    """The all-to-alls of one stage's expert-parallel group (module doc)."""

    COST = "ep_comm_s"
    LABEL = "expert parallel"

    def _transfer(self, key: str, n_bytes: int) -> simpy.Event:
        return self.all_to_all(n_bytes)
