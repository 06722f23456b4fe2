"""Copy engines: the DMA units that move a GPU's data while its compute stream works.

Timing assumptions: a copy waits in FIFO order for a free engine of its kind on the GPU
that drives it, holds it from the start of its transfer until its last byte lands, and
never occupies the compute stream. Bandwidth is the links' business (``network``); an
engine only bounds how many copies of a kind a GPU has in flight at once.
"""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import Protocol

import simpy

from mpsim.sim.simpy_fast import call_in, go_on_now, mark_processed


class Holder(Protocol):
    """Who asks for an engine as a callback chain (``EnginePool.take``): ``granted`` is
    called where a request's grant event would have been processed."""

    def granted(self, _event: simpy.Event | None) -> None: ...


class EngineRequest(simpy.Event):
    """A request for one engine of a pool; it fires when the engine is granted and, used
    as a context manager, gives the engine back on leaving the block."""

    def __init__(self, pool: EnginePool) -> None:
        super().__init__(pool.env)
        self.pool = pool

    def __enter__(self) -> EngineRequest:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.triggered:
            self.pool.queue.remove(self)
        if exc_type is not GeneratorExit:
            self.pool.release(self)


class EnginePool:
    """``capacity`` identical engines granted in FIFO order, with the event order of a
    ``simpy.Resource`` (so a run's ties fall as they did with one): a request is granted
    in the instant it is made when an engine is free and nobody queues before it; a
    release frees the engine at once and, through an event of its own processed in turn
    like SimPy's ``Release``, grants the request at the head of the queue. Each grant
    and each release hands over at most one engine, as SimPy's do. It is leaner than a
    ``simpy.Resource``: no put and get events and queues of them around each grant.

    A request granted as it is made is returned already processed, with no event, when
    that event would be the next one processed (``simpy_fast.go_on_now``): every user
    yields its request right after making it, so the copy goes on in the same instant
    and order as it would have through the event.

    A release with nobody queued schedules no hand-over: that event could grant nothing
    (a request made before it is processed finds the engine free and is granted as it
    is made, so the queue is never left waiting beside a free engine), and leaving out
    an event that does nothing moves no other event's place in the queue.

    A holder (``take``: a host copy run as callbacks) is granted without an event:
    as it asks when an engine is free and nobody queues, and by the release itself when
    it heads the queue (instead of the hand-over event and then the grant event). Its
    copy starts earlier in the instant than through those events; the copy's own
    events (its route's latency, then its flow) are then scheduled ahead of those
    scheduled in that instant between the two, which can tell only where one of them
    falls on the very same later instant (a tie of two sums of floats). The engines
    held, the order in which they are granted and every time are the same."""

    def __init__(self, env: simpy.Environment, capacity: int) -> None:
        self.env = env
        self.capacity = capacity
        self.users: list[EngineRequest | Holder] = []
        self.queue: deque[EngineRequest | Holder] = deque()

    def request(self) -> EngineRequest:
        req = EngineRequest(self)
        if not self.queue and len(self.users) < self.capacity and go_on_now(self.env):
            self.users.append(req)
            mark_processed(req)
            return req
        self.queue.append(req)
        self._grant_head()
        return req

    def take(self, holder: Holder) -> bool:
        """``request`` for a caller that runs as callbacks, with no event made: True when
        the engine is granted now (an engine is free and nobody queues), else
        ``holder.granted`` is called when it is granted (by the release that frees it,
        or where a request's grant event would be processed when the engine it gets was
        freed for a request). ``release(holder)`` gives the engine back."""
        if not self.queue and len(self.users) < self.capacity:
            self.users.append(holder)
            return True
        self.queue.append(holder)
        self._grant_head()
        return False

    def release(self, req: EngineRequest | Holder) -> None:
        if req in self.users:
            self.users.remove(req)
        queue = self.queue
        if not queue:
            return
        head = queue[0]
        if not isinstance(head, EngineRequest) and len(self.users) < self.capacity:  # a holder: granted now
            queue.popleft()
            self.users.append(head)
            head.granted(None)
            return
        call_in(self.env, 0.0, self._grant_head)  # where a succeeded hand-over event would go

    def _grant_head(self, _event: simpy.Event | None = None) -> None:
        if self.queue and len(self.users) < self.capacity:
            req = self.queue.popleft()
            self.users.append(req)
            if isinstance(req, EngineRequest):
                req.succeed()
            else:  # where req.succeed() would schedule its grant: now, NORMAL, the next number
                call_in(self.env, 0.0, req.granted)


class CopyEngines:
    """The copy engines of one GPU.

    ``peer``: copies to and from other GPUs (pipeline sends, D2D swaps), driven by the
    GPU that owns the data, ``GpuSpec.peer_copy_engines`` of them; ``d2h`` and ``h2d``:
    one engine each way to pinned host memory (swap-out and swap-in, optimizer traffic).
    """

    def __init__(self, env: simpy.Environment, gpu: int, peer_engines: int) -> None:
        self.gpu = gpu
        self.peer = EnginePool(env, capacity=peer_engines)
        self.d2h = EnginePool(env, capacity=1)
        self.h2d = EnginePool(env, capacity=1)
