"""What a GPU's simulated memory reserves through PyTorch's caching allocator, and whether
it is at risk of running out.

The memory log (``mpsim.sim.memory``) records allocated bytes over time as the simulator
sees them: a layer's saved activations, a gradient buffer, a workspace. Replayed through
the caching allocator's model (``mpsim.sim.allocator.replay``) each rise becomes one
request and each fall frees the most recent live request of the same size, else the most
recent ones until it is covered (a partial free frees the block and asks for the rest
again). The blocks are therefore coarser than PyTorch's tensors; what the replay adds is
the allocator's rounding, segment sizes, splitting and the fragmentation that keeps
reserved memory above allocated. The cuBLAS workspaces are requests of their own, made
first (PyTorch allocates them through the allocator and keeps them); the CUDA context and
NCCL's buffers lie outside it (``DeviceOverheads``). A GPU is **at risk** when that total plus the
headroom the user asks for exceeds the device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.sim.allocator import CUBLAS_WORKSPACES_TRAINING, DeviceOverheads, cublas_workspace_bytes, replay
from mpsim.units import GiB


def allocator_events(used_bytes: np.ndarray) -> list[tuple[str, int, int]]:
    """Alloc and free events from a GPU's allocated-bytes series (module doc)."""
    deltas = np.diff(used_bytes, prepend=0).astype(np.int64).tolist()
    events: list[tuple[str, int, int]] = []
    live: dict[int, int] = {}  # id -> size, in allocation order (a dict: a free by size takes its block out in O(1))
    by_size: dict[int, list[int]] = {}
    next_id = 0
    for delta in deltas:
        if delta > 0:
            events.append(("alloc", next_id, delta))
            live[next_id] = delta
            by_size.setdefault(delta, []).append(next_id)
            next_id += 1
        elif delta < 0:
            next_id = _free(-delta, live, by_size, events, next_id)
    return events


def _free(n_bytes: int, live: dict[int, int], by_size: dict[int, list[int]],
          events: list[tuple[str, int, int]], next_id: int) -> int:
    same = by_size.get(n_bytes)
    if same:
        block = same.pop()
        del live[block]
        events.append(("free", block, n_bytes))
        return next_id
    while n_bytes > 0 and live:
        block, size = live.popitem()  # the latest allocation
        of_size = by_size[size]
        if of_size[-1] == block:  # most often: the latest of its size too
            of_size.pop()
        else:
            of_size.remove(block)
        events.append(("free", block, size))
        if size > n_bytes:  # partly freed: the rest stays as a new request
            rest = size - n_bytes
            events.append(("alloc", next_id, rest))
            live[next_id] = rest
            by_size.setdefault(rest, []).append(next_id)
            next_id += 1
        n_bytes -= size
    return next_id


@dataclass(frozen=True)
class ReservedEstimate:
    """One GPU's allocated and reserved peaks, and the memory outside the allocator."""

    allocated_peak_bytes: int
    reserved_peak_bytes: int
    """What the caching allocator holds at its peak (``torch.cuda.max_memory_reserved``)."""
    outside_bytes: dict[str, int]
    """CUDA context and NCCL buffers."""
    device_bytes: int
    """The GPU's memory (``memory_mib``)."""
    expandable_peak_bytes: int | None = None
    """The reserved peak under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (one
    growing segment per pool: less fragmentation), for the same requests; None where that
    replay was not asked for (``estimate``'s ``expandable``)."""

    @property
    def total_bytes(self) -> int:
        return self.reserved_peak_bytes + sum(self.outside_bytes.values())

    def free_bytes(self) -> int:
        return self.device_bytes - self.total_bytes

    def at_risk(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> bool:
        return self.free_bytes() < headroom_gib * GiB

    def expandable_helps(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> bool:
        """At risk, but not with ``expandable_segments:True`` (False where not replayed)."""
        if self.expandable_peak_bytes is None:
            return False
        free = self.free_bytes() + self.reserved_peak_bytes - self.expandable_peak_bytes
        return self.at_risk(headroom_gib) and free >= headroom_gib * GiB

    def to_dict(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> dict:
        return {"allocated_peak_bytes": self.allocated_peak_bytes, "reserved_peak_bytes": self.reserved_peak_bytes,
                "outside_allocator_bytes": dict(self.outside_bytes), "device_bytes": self.device_bytes,
                "free_bytes": self.free_bytes(), "headroom_gib": headroom_gib, "at_risk": self.at_risk(headroom_gib),
                "expandable_segments_reserved_peak_bytes": self.expandable_peak_bytes}


def estimate(used_bytes: np.ndarray, device_bytes: int, compute_capability: float | None,
             nccl_peers: int = 0, expandable: bool = True) -> ReservedEstimate:
    """Replay ``used_bytes`` through the allocator model, the cuBLAS workspaces first, and
    add what lies outside it (module doc); ``expandable``: replay them once more under
    ``expandable_segments:True``."""
    workspace = cublas_workspace_bytes(compute_capability)
    first = [("alloc", -1 - i, workspace) for i in range(CUBLAS_WORKSPACES_TRAINING)]
    events = first + allocator_events(used_bytes)
    result = replay(events, device_bytes)
    expandable_peak = replay(events, device_bytes, expandable_segments=True).reserved_peak_bytes if expandable else None
    outside = DeviceOverheads.of(compute_capability, nccl_peers=nccl_peers)
    outside_bytes = {"cuda_context": outside.cuda_context_bytes, "nccl_buffers": outside.nccl_buffers_bytes}
    return ReservedEstimate(result.allocated_peak_bytes, result.reserved_peak_bytes, outside_bytes, device_bytes,
                            expandable_peak)
