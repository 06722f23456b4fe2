"""Collectives over a group of GPUs as NCCL's ring algorithm runs them, as flows on the
fair-share :class:`~mpsim.sim.network.Network` (so they contend with swaps and sends).

The model (NCCL's ring algorithm; the step counts and the bus-bandwidth factors are the
ones nccl-tests' ``doc/PERFORMANCE.md`` gives):

- The buffer of ``n_bytes`` is cut into n chunks (n = GPUs in the group). In every step
  each GPU of the ring sends one chunk to its successor, so a step is n concurrent flows.
- all-reduce: 2(n-1) steps (n-1 of reduce-scatter, then n-1 of all-gather).
  reduce-scatter and all-gather: n-1 steps. ``n_bytes`` is the whole buffer, as
  nccl-tests counts it (for all-gather the gathered output, for reduce-scatter the input).
- broadcast: a pipelined chain from the ring's first GPU along n-1 hops of the ring. The
  buffer is cut into k chunks of about ``BROADCAST_CHUNK_BYTES`` (at most
  ``MAX_BROADCAST_CHUNKS``, which bounds the simulated events); in step s hop j forwards
  chunk s-j, so the chain takes k + n - 2 steps.
- All-reduce, reduce-scatter and all-gather run fused: each hop of the ring is one flow
  carrying every chunk it sends over all steps, the n flows start together after the
  steps' latency (steps x the ring's largest route latency, ``Route.latency_s``) and the
  collective ends when the last lands. On an idle ring this is the step-by-step time
  exactly (every step is bounded by the same bottleneck hop); under contention a hop
  that another transfer slows finishes later on its own instead of holding back each
  step of the others. It costs n flows per collective, not n per step, which keeps
  bucketed and per-layer collectives cheap to simulate inside searches.
- Broadcast steps synchronize: a step starts when every send of the previous one has
  landed; each send pays its route's setup latency (charged by ``Network.transfer``).

Alone on an idle server where every ring hop has its own links of B bytes/s and latency
L, all-reduce therefore takes 2(n-1) (L + n_bytes/(n B)), reduce-scatter and all-gather
(n-1) (L + n_bytes/(n B)), broadcast (k + n - 2) (L + n_bytes/(k B)).

All-reduce also runs as NCCL's double binary tree (``algorithm="tree"``; NCCL runs no
other collective on trees): two binary trees over the group, the second the first's order
reversed, so that a GPU inner in one is near a leaf in the other; each tree reduces half
the buffer up to its root and broadcasts it back down, pipelined, so every tree edge
carries half the buffer each way at once, fused like the ring's hops, after 2 x depth
steps of latency. Inside a server the ring is faster (each edge of a tree carries more
than a ring hop), which is why NCCL picks rings there; trees pay off across servers.

Over several tiers (a server's ring, then rails across servers, then further tiers) a
collective runs NCCL's hierarchical algorithm, every level's flows fused at once
(:func:`tiered_transfer` over a :class:`Level` each; :func:`two_level_transfer` is the
server-and-fabric case the engine runs): the latency steps of every level plus the
slowest level's bytes over its bandwidth on an idle fabric.

Algorithm bandwidth is n_bytes / time; bus bandwidth is algbw x 2(n-1)/n for all-reduce,
x (n-1)/n for reduce-scatter and all-gather, x 1 for broadcast (nccl-tests'
PERFORMANCE notes): on an idle ring it equals the ring's bottleneck link bandwidth, less
the latency.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import simpy

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import ClusterView
from mpsim.hardware.topology import Route, Topology
from mpsim.sim.network import Network
from mpsim.units import MiB

Op = Literal["all-reduce", "reduce-scatter", "all-gather", "broadcast"]
OPS: Final[tuple[str, ...]] = get_args(Op)
Algorithm = Literal["ring", "tree"]
ALGORITHMS: Final[tuple[str, ...]] = get_args(Algorithm)

BROADCAST_CHUNK_BYTES: Final = 4 * MiB
"""Target chunk of the pipelined broadcast: NCCL's default ``NCCL_BUFFSIZE`` (4 MiB)."""
MAX_BROADCAST_CHUNKS: Final = 64
"""Above 64 x 4 MiB the chunks grow instead of multiplying (bounds the simulated events)."""
EXHAUSTIVE_RING_MAX: Final = 8
"""Groups up to this size get the best ring over all orders; larger ones keep their order."""

_BUS_FACTOR_NUM: Final = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}


@dataclass(frozen=True)
class CollectiveTime:
    """One collective alone on an idle server."""

    op: str
    n_bytes: int
    ring: tuple[int, ...]
    """The GPUs in ring order (each sends to the next, the last to the first)."""
    time_s: float
    algbw: float
    """Algorithm bandwidth, bytes/s: ``n_bytes / time_s``."""
    busbw: float
    """Bus bandwidth, bytes/s: ``algbw`` times the op's factor (nccl-tests' definition)."""


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` GPUs: 2(n-1)/n for all-reduce, (n-1)/n for
    reduce-scatter and all-gather, 1 for broadcast (nccl-tests, doc/PERFORMANCE.md)."""
    check_op(op)
    if op == "broadcast":
        return 1.0
    return _BUS_FACTOR_NUM[op] * (n - 1) / n


def check_op(op: str) -> None:
    if op not in OPS:
        raise MpsimError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")


def check_algorithm(op: str, algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise MpsimError(f"unknown algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    if algorithm == "tree" and op != "all-reduce":
        raise MpsimError(f"the tree algorithm runs all-reduce only (as NCCL's does), not {op}")


def check_group(topo: Topology, gpus: Sequence[int]) -> None:
    """A group is at least two distinct GPUs of ``topo``."""
    for g in gpus:
        if not 0 <= g < topo.n_gpus:
            raise MpsimError(f"GPU {g} is not a GPU of {topo.name} (0..{topo.n_gpus - 1})")
    if len(set(gpus)) != len(gpus):
        raise MpsimError(f"GPUs of a collective must be distinct, got {list(gpus)}")
    if len(gpus) < 2:
        raise MpsimError(f"a collective needs at least 2 GPUs, got {list(gpus)}")


def ring_bottleneck(topo: Topology, ring: Sequence[int]) -> float:
    """Bytes/s each hop of ``ring`` gets when all n hops send at once on an idle server:
    the smallest, over the links the hops' routes cross, of the link's bandwidth over the
    number of hops crossing it (progressive filling's first share, as ``Network`` runs it).
    Without shared links it is the narrowest route's bandwidth."""
    load: dict[str, int] = {}
    width: dict[str, float] = {}
    for a, b in zip(ring, (*ring[1:], ring[0])):
        for link in topo.route(a, b).links:
            load[link.name] = load.get(link.name, 0) + 1
            width[link.name] = link.bandwidth
    return min(width[name] / count for name, count in load.items())


def best_ring(topo: Topology, gpus: Sequence[int]) -> tuple[int, ...]:
    """The ring order of ``gpus`` with the highest :func:`ring_bottleneck`, searched over
    every order (the first GPU fixed: rotations are the same ring) for groups up to
    ``EXHAUSTIVE_RING_MAX``; larger groups keep the order given. Ties keep the earliest
    order in the enumeration, so a group already in a best order keeps it."""
    check_group(topo, gpus)
    first, rest = gpus[0], list(gpus[1:])
    if len(gpus) > EXHAUSTIVE_RING_MAX:
        return tuple(gpus)
    route_bw = {(a, b): topo.route(a, b).bandwidth for a in gpus for b in gpus if a != b}
    best: tuple[int, ...] = tuple(gpus)
    best_bw = -1.0
    for order in itertools.permutations(rest):
        ring = (first, *order)
        hops = zip(ring, (*ring[1:], first))
        if min(route_bw[h] for h in hops) <= best_bw:
            continue  # its narrowest route alone cannot beat the best ring so far
        bw = ring_bottleneck(topo, ring)
        if bw > best_bw:
            best, best_bw = ring, bw
    return best


def split_bytes(n_bytes: int, k: int) -> list[int]:
    """``n_bytes`` in ``k`` whole chunks that differ by at most one byte."""
    base, extra = divmod(n_bytes, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def broadcast_chunks(n_bytes: int) -> int:
    """How many chunks the pipelined broadcast cuts ``n_bytes`` into (see module doc)."""
    return max(1, min(MAX_BROADCAST_CHUNKS, -(-n_bytes // BROADCAST_CHUNK_BYTES)))


def ring_collective(env: simpy.Environment, network: Network, topo: Topology, ring: Sequence[int], op: str,
                    n_bytes: int) -> Generator[simpy.Event, Any, None]:
    """A SimPy process body running ``op`` on ``n_bytes`` over ``ring`` (GPUs in ring
    order; for broadcast the first is the root). Ends when the last step's sends land."""
    check_op(op)
    if op == "broadcast":
        yield from _chain_broadcast(env, network, topo, ring, n_bytes)
        return
    yield ring_transfer(network, topo, ring, op, n_bytes)


def ring_transfer(network: Network, topo: Topology, ring: Sequence[int], op: str, n_bytes: int) -> simpy.Event:
    """All-reduce, reduce-scatter or all-gather of ``n_bytes`` over ``ring`` started now,
    fused (module doc): the event of its last hop's landing."""
    n = len(ring)
    routes, latency_s = ring_routes(topo, tuple(ring))
    per_hop = max_hop_bytes(op, n_bytes, n)  # hops differ by under n bytes: equal flows land in one event
    return network.transfer_all(routes, [per_hop] * n, ring_steps(op, n) * latency_s)


@functools.lru_cache(maxsize=1024)
def ring_routes(topo: Topology, ring: tuple[int, ...]) -> tuple[list[Route], float]:
    """Each GPU's route to its successor in ``ring``, and the largest route latency."""
    routes = [topo.route(a, b) for a, b in zip(ring, (*ring[1:], ring[0]))]
    return routes, max(r.latency_s for r in routes)


@functools.lru_cache(maxsize=4096)
def max_hop_bytes(op: str, n_bytes: int, n: int) -> int:
    """The most bytes any GPU of the ring sends (``hop_bytes``), remembered: a job's
    buckets and layers repeat a few sizes many times."""
    return max(hop_bytes(op, n_bytes, n))


def inter_server_steps(op: str, servers: int) -> int:
    """Latency steps of ``op`` across ``servers``: a ring's, or for all-reduce NCCL's
    double binary tree's 2 x depth when fewer (NCCL's tuner picks the tree for small
    buffers on many nodes; both move the same bytes per NIC in this model)."""
    ring = ring_steps(op, servers)
    return min(ring, 2 * max(1, math.ceil(math.log2(servers)))) if op == "all-reduce" else ring


StepRule = Literal["ring", "ring-or-tree"]
"""How a level counts its latency steps: ``ring`` (:func:`ring_steps`), or ``ring-or-tree``
(:func:`inter_server_steps`: all-reduce's double binary tree when it has fewer steps)."""


@dataclass(frozen=True)
class Level:
    """One level of a hierarchical collective (:func:`tiered_transfer`), innermost first.

    ``size`` GPUs form each of the level's groups (a server's ring, the servers of a rail,
    the racks of a pod); ``routes`` are the flows the simulated GPUs send at this level,
    one each (a ring's hops, or ``ClusterView.mirror_route`` standing for a rail's hop by
    symmetry); each carries what one member of an n-GPU ring sends over all its steps. A
    level without an op moves nothing, but its groups still cut the buffer for the levels
    outside it: every GPU of the group holds its 1/n share of them."""

    op: str | None
    """all-reduce, reduce-scatter or all-gather at this level, or None: nothing moves."""
    size: int
    """n_k: GPUs in each of the level's groups."""
    routes: tuple[Route, ...]
    """The flow of each simulated GPU at this level."""
    step_latency_s: float
    """Latency of one step of the level (its routes' largest setup latency)."""
    steps: StepRule = "ring"
    """How the level counts its latency steps (``StepRule``): across servers NCCL's tuner
    may run all-reduce's latency on a double binary tree."""

    def __post_init__(self) -> None:
        if self.op is not None:
            check_op(self.op)
            if self.op == "broadcast":
                raise MpsimError("a level of a hierarchical collective runs all-reduce, reduce-scatter or "
                                 "all-gather, not broadcast")
        if self.size < 1:
            raise MpsimError(f"a level's group has at least one GPU, got {self.size}")
        if self.step_latency_s < 0 or not math.isfinite(self.step_latency_s):
            raise MpsimError(f"a level's step latency is a finite number of seconds >= 0, got {self.step_latency_s}")

    @property
    def moves(self) -> bool:
        """Whether the level sends anything: an op on a group of two or more."""
        return self.op is not None and self.size > 1

    def latency_steps(self) -> int:
        """Steps of the level's op on its group (0 when it does not move)."""
        if self.op is None or self.size <= 1:
            return 0
        if self.steps == "ring-or-tree":
            return inter_server_steps(self.op, self.size)
        return ring_steps(self.op, self.size)


def level_shares(levels: Sequence[Level], n_bytes: int) -> list[int]:
    """The buffer each level works on: the whole for the innermost, then at level k what
    each GPU holds after the levels inside it, ceil(n_bytes / (n_0 x ... x n_{k-1}))."""
    shares: list[int] = []
    share = n_bytes
    for level in levels:
        shares.append(share)
        share = -(-share // level.size)
    return shares


def tiered_transfer(network: Network, levels: Sequence[Level], n_bytes: int) -> simpy.Event:
    """A hierarchical collective over every level of ``levels`` (innermost first), started
    now: the event of the last flow's landing.

    The hierarchical algorithm (NCCL's; the per-level sizes and bus-bandwidth factors as
    nccl-tests' ``doc/PERFORMANCE.md`` defines them): an all-reduce reduce-scatters at each
    level from the innermost out, so that level k works on the share the levels inside it
    leave each GPU, S_k = S / (n_0 x ... x n_{k-1}), all-reduces that share at the
    outermost level, and all-gathers back level by level inward; the reduce-scatter and
    the all-gather of one level together move what its all-reduce moves. Each level's
    flow per GPU therefore carries ``max_hop_bytes(op_k, S_k, n_k)``, about
    2(n_k - 1)/n_k x S_k for all-reduce and (n_k - 1)/n_k x S_k for reduce-scatter and
    all-gather. NCCL pipelines the levels chunk by chunk, so every level's flows start at
    once (fused, as ``ring_transfer``) after the latency of all levels' steps: alone on
    an idle fabric where each level has links of its own the time is that latency plus
    the slowest level's bytes over its bandwidth; levels that share a link share it as
    the ``Network`` shares any flows. A level of one GPU or without an op adds no flow
    and no latency (its size still divides the share of the levels outside it)."""
    routes: list[Route] = []
    sizes: list[int] = []
    latency_s = 0.0
    for level, share in zip(levels, level_shares(levels, n_bytes)):
        op = level.op
        if op is None or level.size <= 1:
            continue
        routes += level.routes
        sizes += [max_hop_bytes(op, share, level.size)] * len(level.routes)
        latency_s += level.latency_steps() * level.step_latency_s
    return network.transfer_all(routes, sizes, latency_s)


@functools.lru_cache(maxsize=1024)
def ring_level(topo: Topology, ring: tuple[int, ...], op: str | None) -> Level:
    """The level of a ring inside one server: each GPU's hop to its successor (no route
    worked out for a level that does not move)."""
    if op is None or len(ring) <= 1:
        return Level(op, len(ring), (), 0.0)
    hops, hop_latency_s = ring_routes(topo, ring)
    return Level(op, len(ring), tuple(hops), hop_latency_s)


@functools.lru_cache(maxsize=1024)
def mirror_level(view: ClusterView, ring: tuple[int, ...], op: str | None, across: int) -> Level:
    """The level across ``across`` identical servers: every GPU of ``ring`` on its own
    rail through its own NIC (``ClusterView.mirror_route``), latency steps as
    :func:`inter_server_steps` counts them (no route worked out for a level that does
    not move)."""
    if op is None or across <= 1:
        return Level(op, across, (), 0.0, "ring-or-tree")
    mirrors = tuple(view.mirror_route(g) for g in ring)
    return Level(op, across, mirrors, max(r.latency_s for r in mirrors), "ring-or-tree")


def two_level_transfer(network: Network, view: ClusterView, ring: Sequence[int], intra_op: str | None,
                       across: int, inter_op: str | None, n_bytes: int) -> simpy.Event:
    """A collective over a group of ``len(ring)`` GPUs on each of ``across`` identical
    servers, started now: :func:`tiered_transfer` over two levels, ``intra_op`` over the
    server's ring on the whole buffer and ``inter_op`` across servers on each GPU's 1/n
    share of it, every GPU of the ring running its own inter-server ring through its own
    NIC (one ring per rail, as NCCL's channels cross servers), over
    ``ClusterView.mirror_route`` (the other servers are symmetric). On an idle fabric the
    time is the latency steps of both levels plus the slower level's bytes over its
    bandwidth. All-reduce is reduce-scatter inside, all-reduce across, all-gather inside
    (``intra_op`` and ``inter_op`` ``all-reduce``); ZeRO's reduce-scatter and all-gather
    are the same op at both levels; HSDP reduces gradients with a reduce-scatter inside and
    an all-reduce across, and gathers parameters inside only (``inter_op`` None)."""
    group = tuple(ring)
    levels = (ring_level(view, group, intra_op), mirror_level(view, group, inter_op, across))
    return tiered_transfer(network, levels, n_bytes)


def tree_edges(order: Sequence[int]) -> list[tuple[int, int]]:
    """(child, parent) edges of the binary tree laid over ``order`` as a heap: the
    parent of the GPU at position i is the one at (i - 1) // 2."""
    return [(order[i], order[(i - 1) // 2]) for i in range(1, len(order))]


def tree_depth(n: int) -> int:
    """Edges from the deepest GPU of an n-GPU heap-ordered binary tree to its root."""
    return max(0, (n).bit_length() - 1)


def tree_all_reduce(env: simpy.Environment, network: Network, topo: Topology, order: Sequence[int],
                    n_bytes: int) -> Generator[simpy.Event, Any, None]:
    """A SimPy process body: all-reduce of ``n_bytes`` over NCCL's double binary tree
    (module doc): per tree half the buffer up every edge and down again, all at once."""
    half = -(-n_bytes // 2)
    routes = []
    for tree in (tuple(order), tuple(reversed(order))):
        for child, parent in tree_edges(tree):
            routes += [topo.route(child, parent), topo.route(parent, child)]
    latency_s = max(r.latency_s for r in routes)
    yield network.transfer_all(routes, [half] * len(routes), 2 * tree_depth(len(order)) * latency_s)


def ring_steps(op: str, n: int) -> int:
    """Steps of ``op`` on a ring of ``n``: 2(n-1) for all-reduce, n-1 for the others."""
    return 2 * (n - 1) if op == "all-reduce" else n - 1


def hop_bytes(op: str, n_bytes: int, n: int) -> list[int]:
    """Bytes each GPU of the ring sends to its successor over all steps: in step ``t``
    GPU i sends chunk (i - t) mod n, the chunk it reduced (or received) last step. (Hops
    differ by under n bytes; ``ring_collective`` sends the largest on every hop, so that
    equal flows land in one simulation event.)"""
    chunks = split_bytes(n_bytes, n)
    steps = ring_steps(op, n)
    return [sum(chunks[(i - t) % n] for t in range(steps)) for i in range(n)]


def _chain_broadcast(env: simpy.Environment, network: Network, topo: Topology, ring: Sequence[int],
                     n_bytes: int) -> Generator[simpy.Event, Any, None]:
    """Pipelined chain from ``ring[0]``: in step s hop j forwards chunk s - j."""
    hops = [topo.route(a, b) for a, b in zip(ring[:-1], ring[1:])]
    chunks = split_bytes(n_bytes, broadcast_chunks(n_bytes))
    k = len(chunks)
    for step in range(k + len(hops) - 1):
        sends = [network.transfer(route, chunks[step - j]) for j, route in enumerate(hops) if 0 <= step - j < k]
        yield simpy.AllOf(env, sends)


def collective_time(topo: Topology, op: str, n_bytes: int, gpus: Sequence[int] | None = None,
                    algorithm: str = "ring") -> CollectiveTime:
    """``op`` on ``n_bytes`` over ``gpus`` (default: every GPU) alone on an idle server,
    over the best ring (:func:`best_ring`; a tree is laid over the same order);
    bandwidths as nccl-tests defines them."""
    check_op(op)
    check_algorithm(op, algorithm)
    group = list(range(topo.n_gpus)) if gpus is None else list(gpus)
    if n_bytes <= 0:
        raise MpsimError(f"a collective's size must be positive, got {n_bytes} bytes")
    ring = best_ring(topo, group)
    env = simpy.Environment()
    if algorithm == "tree":
        env.process(tree_all_reduce(env, Network(env), topo, ring, n_bytes))
    else:
        env.process(ring_collective(env, Network(env), topo, ring, op, n_bytes))
    env.run()
    time_s = float(env.now)
    algbw = n_bytes / time_s if time_s > 0 else float("inf")
    return CollectiveTime(op, n_bytes, ring, time_s, algbw, algbw * bus_factor(op, len(ring)))
