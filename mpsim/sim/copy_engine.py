"""Copy engines: the DMA units that move a GPU's data while its compute stream works.

Timing assumptions: a copy waits in FIFO order for a free engine of its kind on the GPU
that drives it, holds it from the start of its transfer until its last byte lands, and
never occupies the compute stream. Bandwidth is the links' business (``network``); an
engine only bounds how many copies of a kind a GPU has in flight at once.
"""

from __future__ import annotations

import simpy


class CopyEngines:
    """The copy engines of one GPU.

    ``peer``: copies to and from other GPUs (pipeline sends, D2D swaps), driven by the
    GPU that owns the data, ``GpuSpec.peer_copy_engines`` of them; ``d2h`` and ``h2d``:
    one engine each way to pinned host memory (swap-out and swap-in, optimizer traffic).
    """

    def __init__(self, env: simpy.Environment, gpu: int, peer_engines: int) -> None:
        self.gpu = gpu
        self.peer = simpy.Resource(env, capacity=peer_engines)
        self.d2h = simpy.Resource(env, capacity=1)
        self.h2d = simpy.Resource(env, capacity=1)
