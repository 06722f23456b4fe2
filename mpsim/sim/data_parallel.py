"""A stage's data-parallel group: gradient reduction, ZeRO's sharded states and the
collectives that move them, on the simulated network.

Replicas are symmetric: the engine simulates replica 0's pipeline only, and each
collective of a stage runs over that stage's whole group (its GPU in every replica) as
fused ring flows (``collectives.ring_transfer``), so it shares links with replica 0's
sends and swaps. What the other replicas' own sends and swaps put on the links is not
simulated (on an NVSwitch server they use other ports; on the DGX-1 they may share a
ring's links).

What each ZeRO stage does (Rajbhandari et al. 2020, sections 5 and 7; PyTorch DDP's
bucketed all-reduce, Li et al. 2020, section 3.2; FSDP2 for stage 3):

- 0 (DDP): gradients are cut into buckets of ``bucket_mib`` in backward order; in the
  iteration's last backward of the stage each bucket's all-reduce starts as soon as its
  last layer's backward ends and overlaps the rest (earlier microbatches accumulate
  locally, no synchronisation); the update waits until every bucket has landed. Under a
  runtime profile without gradient-reduce overlap (Megatron-Core's default DDP config,
  DeepSpeed's ZeRO-1) the buckets' reductions all start after the backward instead.
- 1: the same buckets reduce-scattered instead; after the update (1/N of the states),
  the stage's updated parameters are all-gathered before the iteration ends.
- 2: gradients are sharded too, so every microbatch's backward reduce-scatters each
  bucket, and a layer's full gradient is freed when its bucket lands; then as stage 1.
- 3 (FSDP): parameters are sharded too: each layer's are all-gathered before its forward
  and before its backward (prefetching the next layer's when a layer starts), freed after
  it (``reshard_after_forward``; when off they stay gathered from the first forward to
  the iteration's last backward), and its gradient is reduce-scattered when its backward
  ends. No gather after the update.

All-gathers and reductions run on two lanes (FSDP's all-gather and reduce-scatter
streams; DDP's one), each in issue order as NCCL runs one communicator's collectives.
A group of one GPU moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import simpy

from mpsim.hardware.cluster import ClusterView
from mpsim.sim.collectives import ring_transfer, two_level_transfer
from mpsim.sim.context import RunContext
from mpsim.sim.program import Piece, Sharding
from mpsim.sim.result import Span
from mpsim.sim.simpy_fast import call_in, sleep
from mpsim.sim.spawn import spawn
from mpsim.timing.runtime import profile_named
from mpsim.units import MiB

_LANES = ("gather", "reduce")


class DataParallel:
    """The data-parallel side of one stage (module doc)."""

    def __init__(self, run: RunContext, stage: int, sharding: Sharding) -> None:
        layout = run.layout
        self.run = run
        self.stage = stage
        self.sharding = sharding
        self.gpu = layout.gpu_of[stage]
        self.ring = layout.group(stage)
        """The group in ring order: replica order (``placement`` puts each group in its
        best ring order; a plan file's replicas are taken in the order written). On a
        cluster, its GPUs on the simulated server."""
        self.across = layout.across
        """Servers the group spans: its collectives run at two levels (``two_level_transfer``)."""
        self.view = run.topo if isinstance(run.topo, ClusterView) else None
        """The cluster's simulated servers (None on one server)."""
        self.hsdp = layout.parallelism.hsdp
        a, b = layout.stages[stage]
        self.rows = {j: layout.trace.layers[j] for j in range(a, b)}
        self.buckets = _buckets(self.rows, layout.parallelism.bucket_mib * MiB)
        self.bucket_of = {j: i for i, members in enumerate(self.buckets) for j in members}
        self._ready: dict[tuple[int, int], int] = {}
        """(microbatch, bucket) -> layers of the bucket whose gradients are ready."""
        self._tails: dict[str, simpy.Event | None] = dict.fromkeys(_LANES)
        self._reductions: list[simpy.Event] = []
        self._gathers: dict[tuple[object, ...], simpy.Event | None] = {}
        self._held_bytes = 0
        """Gathered parameter bytes that stay until the iteration's last backward."""
        self._buffer_bytes = 0
        """HSDP's all-reduce buffers held (``_hold_all_reduce_buffer``)."""
        self._held_before_last: set[int] = set()
        """Microbatches whose backward is not the stage's last of the iteration."""
        self._buffer_layers: set[int] = set()
        """Layers whose HSDP all-reduce buffer is held."""
        self.overlap_grads = profile_named(layout.job.runtime_profile).grad_reduce_overlap
        """DDP's and ZeRO-1's bucket reductions start as each bucket is ready (overlapping the
        rest of the backward); off: all of them after the backward, before the update
        (``mpsim.timing.runtime``)."""
        self._deferred: list[tuple[int, tuple[int, ...]]] = []
        """(microbatch, layers) of the reductions held for the update (``overlap_grads`` off)."""
        self.expert_ring, self.expert_across = layout.expert_data_group(stage)
        """The expert-data-parallel group (GPUs on the simulated servers, servers spanned):
        with expert parallelism, what the routed experts' gradients are reduced over."""
        self.expert_grad_bytes = {j: r.expert_part(r.grad_bytes) for j, r in self.rows.items()}
        """Per layer, its routed experts' gradient bytes on this GPU (0 without experts)."""

    @property
    def moves(self) -> bool:
        return len(self.ring) > 1 or self.across > 1

    @property
    def experts_move(self) -> bool:
        """Whether the expert-data-parallel group has more than this GPU."""
        return len(self.expert_ring) > 1 or self.expert_across > 1

    def _transfer(self, op: str, n_bytes: int, experts: bool = False) -> simpy.Event:
        """``op`` over the group started now: one ring inside a server, or two levels
        across servers (HSDP: a reduce-scatter inside and an all-reduce across for
        gradients, parameters gathered inside only); ``experts``: over the
        expert-data-parallel group instead."""
        run = self.run
        ring, across = (self.expert_ring, self.expert_across) if experts else (self.ring, self.across)
        if self.view is None or across == 1:
            return ring_transfer(run.net, run.topo, ring, op, n_bytes)
        inter: str | None = op
        if self.hsdp:
            inter = "all-reduce" if op == "reduce-scatter" else None
        return two_level_transfer(run.net, self.view, ring, op, across, inter, n_bytes)

    # -- gradients -------------------------------------------------------------------------
    def backward_piece_started(self, mb: int, piece: Piece, last_backward: bool) -> None:
        """A backward piece starts: its layers' gradients become ready at their offsets."""
        if self.sharding.zero_stage < 2 and not last_backward:
            return  # DDP and ZeRO-1 accumulate locally until the iteration's last backward
        env = self.run.env
        if not last_backward:
            self._held_before_last.add(mb)
        for offset_s, j in piece.grads_done:
            call_in(env, offset_s, self._on_ready(mb, j))

    def _on_ready(self, mb: int, j: int) -> Callable[[simpy.Event], None]:
        def ready(_e: simpy.Event) -> None:
            self._gradient_ready(mb, j)

        return ready

    def _gradient_ready(self, mb: int, j: int) -> None:
        if self.sharding.per_layer:
            self._reduce(mb, (j,))
            return
        b = self.bucket_of[j]
        done = self._ready.get((mb, b), 0) + 1
        self._ready[(mb, b)] = done
        if done < len(self.buckets[b]):
            return
        if self.overlap_grads or self.sharding.zero_stage >= 2:
            self._reduce(mb, self.buckets[b])
        else:
            self._deferred.append((mb, self.buckets[b]))

    def _reduce(self, mb: int, layers: tuple[int, ...]) -> None:
        expert_bytes = sum(self.expert_grad_bytes[j] for j in layers)
        if expert_bytes:
            self._reduce_experts(mb, layers, expert_bytes)
        n_bytes = sum(self.rows[j].grad_bytes for j in layers) - expert_bytes
        op = "all-reduce" if self.sharding.zero_stage == 0 else "reduce-scatter"
        frees = n_bytes if self.sharding.zero_stage >= 2 else 0
        label = f"{op} of layers {layers[-1]}-{layers[0]} gradients, microbatch {mb}"
        memory = self.run.memory[self.gpu]
        if not self.moves:  # one GPU: the gradient is its own shard
            if frees:
                memory.change([(-frees, "grads", f"layers {layers[-1]}-{layers[0]} gradient accumulated")])
            if self.sharding.offload_grads:
                self._reductions.append(self._to_host(None, n_bytes, label))
            return
        if frees:
            memory.begin_free()
        landed = self._collective("reduce", op, n_bytes, label)

        def free(_e: simpy.Event) -> None:
            if frees:
                memory.end_free([(-frees, "grads", f"{label}: full gradient freed")])

        landed.callbacks.append(free)
        if self.hsdp and self.across > 1 and mb in self._held_before_last:
            landed.callbacks.append(self._hold_all_reduce_buffer(layers, n_bytes))
        self._reductions.append(landed)
        if self.sharding.offload_grads:  # ZeRO-Offload: the reduced shard goes to the host as it lands
            self._reductions.append(self._to_host(landed, self.sharding.shard(n_bytes), label))

    def _reduce_experts(self, mb: int, layers: tuple[int, ...], n_bytes: int) -> None:
        """The routed experts' gradients of ``layers`` all-reduced (ZeRO-1: reduce-scattered)
        over the expert-data-parallel group (Megatron-Core's expert-data-parallel buckets;
        ZeRO-2 and 3 with expert parallelism are refused by the layout)."""
        if self.experts_move:
            op = "all-reduce" if self.sharding.zero_stage == 0 else "reduce-scatter"
            label = f"{op} of layers {layers[-1]}-{layers[0]} expert gradients, microbatch {mb}"
            self._reductions.append(self._collective("reduce", op, n_bytes, label, experts=True))

    def _hold_all_reduce_buffer(self, layers: tuple[int, ...], n_bytes: int) -> Callable[[simpy.Event], None]:
        """HSDP as torch 2.13's FSDP2 runs it: the buffer a layer's gradient shard is
        all-reduced across servers in stays until the layer's next backward, so from its
        first backward to the iteration's last one each layer holds one more gradient
        shard (measured on 4 gloo processes, ``reports/validation_hsdp_cpu.md``)."""

        def hold(_e: simpy.Event) -> None:
            fresh = [j for j in layers if j not in self._buffer_layers]
            if fresh:
                self._buffer_layers.update(fresh)
                held = self.sharding.shard(n_bytes) * len(fresh) // len(layers)
                self._buffer_bytes += held
                self.run.memory[self.gpu].change([(held, "grads", f"HSDP all-reduce buffer of layers {fresh} held")])

        return hold

    def _to_host(self, after: simpy.Event | None, n_bytes: int, label: str) -> simpy.Event:
        """Copy ``n_bytes`` of reduced gradient shard to the host once ``after`` fires (None:
        now)."""
        done = self.run.env.event()

        def copy() -> Generator[simpy.Event, object, None]:
            if after is not None and not after.processed:
                yield after
            yield from self.run.host_copy(self.gpu, n_bytes, True, f"{label}: shard to host")
            done.succeed()

        spawn(self.run.env, copy())
        return done

    # -- parameters (ZeRO-3) ---------------------------------------------------------------
    def gather(self, mb: int, phase: str, j: int) -> simpy.Event | None:
        """Start gathering layer ``j``'s parameters for ``phase`` (``F`` or ``B``) of
        microbatch ``mb`` unless started; the event of its landing (None: nothing to wait
        for)."""
        key: tuple[object, ...] = (j,) if not self.sharding.reshard_after_forward else (mb, phase, j)
        if key in self._gathers:
            return self._gathers[key]
        row = self.rows.get(j)
        n_extra = 0 if row is None else self.sharding.gathered(row)
        if row is None or not n_extra:
            self._gathers[key] = None
            return None
        label = f"all-gather of layer {j} parameters ({'forward' if phase == 'F' else 'backward'}, microbatch {mb})"
        self.run.memory[self.gpu].change([(n_extra, "params", label)])
        if not self.sharding.reshard_after_forward:
            self._held_bytes += n_extra
        fetch = self.sharding.shard(row.param_bytes) if self.sharding.offload_params else 0
        if not fetch and not self.moves:  # one GPU: the copy into the gathered buffer takes no modelled time
            self._gathers[key] = None
            return None
        event = self._gathers[key] = self._collective("gather", "all-gather", row.param_bytes, label, fetch)
        return event

    def wait_for_gather(self, mb: int, phase: str, j: int) -> Generator[simpy.Event, object, None]:
        """Before layer ``j``'s piece: its parameters gathered, the next layer's started."""
        event = self.gather(mb, phase, j)
        self.gather(mb, phase, j + 1 if phase == "F" else j - 1)
        if event is not None and not event.processed:
            yield from self._wait(event)

    def after_last_backward(self) -> None:
        """Parameters kept gathered (``reshard_after_forward`` off) and HSDP's held
        all-reduce buffers are freed."""
        if self._held_bytes:
            self.run.memory[self.gpu].change([(-self._held_bytes, "params", "gathered parameters resharded")])
            self._held_bytes = 0
        if self._buffer_bytes:
            self.run.memory[self.gpu].change([(-self._buffer_bytes, "grads", "HSDP all-reduce buffers freed")])
            self._buffer_bytes = 0

    # -- the update ------------------------------------------------------------------------
    def before_update(self) -> Generator[simpy.Event, object, None]:
        """The reductions held for the update start (in the order their buckets were
        ready), and the update waits for every reduction issued."""
        for mb, layers in self._deferred:
            self._reduce(mb, layers)
        self._deferred.clear()
        for event in self._reductions:
            if not event.processed:
                yield from self._wait(event)

    def after_update(self) -> Generator[simpy.Event, object, None]:
        """ZeRO-1 and 2: each GPU's updated shard is all-gathered into the parameters."""
        if self.sharding.zero_stage in (1, 2) and self.moves:
            expert = sum(r.expert_part(r.param_bytes) for r in self.rows.values())
            n_bytes = sum(r.param_bytes for r in self.rows.values()) - expert
            yield from self._wait(self._collective("gather", "all-gather", n_bytes, "all-gather of updated parameters"))
            if expert and self.experts_move:
                yield from self._wait(self._collective("gather", "all-gather", expert,
                                                       "all-gather of updated expert parameters", experts=True))

    # -- plumbing --------------------------------------------------------------------------
    def _wait(self, event: simpy.Event) -> Generator[simpy.Event, object, None]:
        start = self.run.env.now
        yield event
        self.run.costs.add(self.gpu, "dp_wait_s", self.run.env.now - start)

    def _collective(self, lane: str, op: str, n_bytes: int, label: str, fetch_bytes: int = 0,
                    experts: bool = False) -> simpy.Event:
        """``op`` on the group's ring (``experts``: the expert-data-parallel group's) once
        the lane's previous collective has landed, after fetching ``fetch_bytes`` of
        offloaded shard (``_fetch``)."""
        previous = self._tails[lane]
        if (previous is None or previous.processed) and not fetch_bytes and (self.moves or experts):
            landed = self._tails[lane] = self._transfer(op, n_bytes, experts)
            landed.callbacks.append(self._span(label, self.run.env.now))  # the common case: no process
            return landed
        done = self._tails[lane] = self.run.env.event()
        spawn(self.run.env, self._run(previous, op, n_bytes, label, done, fetch_bytes, experts))
        return done

    def _span(self, label: str, start_s: float) -> Callable[[simpy.Event], None]:
        def record(_e: simpy.Event) -> None:
            self.run.spans.append(Span(self.gpu, "nccl", label, start_s, self.run.env.now))

        return record

    def _fetch(self, n_bytes: int) -> Generator[simpy.Event, object, None]:
        """An offloaded shard to the GPU: read from NVMe (its bandwidth shared by every
        replica) when it lives there, then over PCIe from pinned host memory."""
        run = self.run
        if run.offload is run.nvme:
            yield sleep(run.env, run.nvme_seconds(n_bytes, write=False))
        yield from run.host_copy(self.gpu, n_bytes, False, "parameter shard from host")

    def _run(self, previous: simpy.Event | None, op: str, n_bytes: int, label: str,
             done: simpy.Event, fetch_bytes: int, experts: bool = False) -> Generator[simpy.Event, object, None]:
        run = self.run
        if previous is not None and not previous.processed:
            yield previous
        if fetch_bytes:
            yield from self._fetch(fetch_bytes)
        start = run.env.now
        if self.moves or experts:
            yield self._transfer(op, n_bytes, experts)
        run.spans.append(Span(self.gpu, "nccl", label, start, run.env.now))
        done.succeed()


def _buckets(rows: dict, bucket_bytes: float) -> list[tuple[int, ...]]:
    """The stage's layers in backward order cut into buckets of at least ``bucket_bytes``
    of gradients (the last may be smaller); each bucket lists its layers last first."""
    out: list[tuple[int, ...]] = []
    members: list[int] = []
    filled = 0
    for j in sorted(rows, reverse=True):
        members.append(j)
        filled += rows[j].grad_bytes
        if filled >= bucket_bytes:
            out.append(tuple(members))
            members, filled = [], 0
    if members:
        out.append(tuple(members))
    return out
