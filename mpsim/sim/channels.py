"""Pipeline sends between stages: activations forward, gradients back."""

from __future__ import annotations

from collections.abc import Generator

import simpy

from mpsim.sim.context import RunContext
from mpsim.sim.result import Span
from mpsim.sim.spawn import spawn


class PeerChannels:
    """One channel per (sender GPU, receiver GPU) pair, keeping sends to a peer in order
    as NCCL does.

    Timing: a send waits for the previous send on its channel to land, then for one of
    the sender's peer copy engines, then flows over the route between the two GPUs. The
    receive buffer is allocated when the flow starts (under the ``mpress`` runtime; the
    ``torch-pipelining`` runtime preallocates it) and the sender's copy is freed when
    the last byte lands, which makes every send a free under way on the sender."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self._tails: dict[tuple[int, int], simpy.Event] = {}

    def send(self, kind: str, src_stage: int, dst_stage: int, mb: int, n_bytes: int) -> None:
        """Start sending microbatch ``mb``'s ``kind`` (activation or gradient)."""
        gpu_of = self.run.layout.gpu_of
        self.run.memory[gpu_of[src_stage]].begin_free()
        spawn(self.run.env, self._send(kind, src_stage, dst_stage, mb, n_bytes))

    def _send(self, kind: str, src_stage: int, dst_stage: int, mb: int,
              n_bytes: int) -> Generator[simpy.Event, object, None]:
        run = self.run
        src, dst = run.layout.gpu_of[src_stage], run.layout.gpu_of[dst_stage]
        previous = self._tails.get((src, dst))
        mine = self._tails[(src, dst)] = run.env.event()
        if previous is not None and not previous.processed:
            yield previous
        with run.engines[src].peer.request() as engine:
            yield engine
            start = run.env.now
            if not run.torch_pipelining:
                label = f"{kind} of microbatch {mb} from stage {src_stage} (receive buffer)"
                run.memory[dst].change([(n_bytes, "buffers", label)])
            yield run.net.transfer(run.topo.route(src, dst), n_bytes)
        run.spans.append(Span(src, "copy", f"{kind} mb{mb} -> gpu{dst}", start, run.env.now))
        run.memory[src].end_free_last([(-n_bytes, "buffers", f"{kind} of microbatch {mb} sent to stage {dst_stage}")],
                                      mine, run.signals(kind, dst_stage, mb))  # the send's last act
