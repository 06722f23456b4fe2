"""Copy engines: the DMA units that move a GPU's data while its compute stream works.

Timing assumptions: a copy waits in FIFO order for a free engine of its kind on the
sending GPU, holds it from the start of its transfer until its last byte lands, and
never occupies the compute stream. Bandwidth is the links' business (``network``); an
engine only bounds how many copies a GPU has in flight at once.
"""

from __future__ import annotations

import simpy


class CopyEngines:
    """The copy engines of one GPU. ``peer``: sends to other GPUs (pipeline activations
    and gradients), ``GpuSpec.peer_copy_engines`` of them."""

    def __init__(self, env: simpy.Environment, gpu: int, peer_engines: int) -> None:
        self.gpu = gpu
        self.peer = simpy.Resource(env, capacity=peer_engines)
