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

All-to-all (:func:`all_to_all_transfer`) runs no ring: NCCL has no all-to-all algorithm,
each rank issues a send and a receive per peer in one group, and those point-to-point
sends run at once; here every rank's n-1 shares of 1/n of its buffer start together
after one step of latency, one flow per ordered pair, or per GPU out and in on a switch.
Across servers (:func:`all_to_all_two_level`) it stays flat: the remote shares leave
through each GPU's NIC (its mirror route) while the local ones cross the server.

Algorithm bandwidth is n_bytes / time; bus bandwidth is algbw x 2(n-1)/n for all-reduce,
x (n-1)/n for reduce-scatter, all-gather and all-to-all, x 1 for broadcast (nccl-tests'
PERFORMANCE notes and ``alltoall_perf``): on an idle ring it equals the ring's bottleneck
link bandwidth, less the latency; for all-to-all on a switch, each GPU's link bandwidth
less the latency.
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
from mpsim.hardware.topology import Link, Route, Topology
from mpsim.sim.network import Network
from mpsim.units import MiB

Op = Literal["all-reduce", "reduce-scatter", "all-gather", "broadcast", "all-to-all"]
OPS: Final[tuple[str, ...]] = get_args(Op)
RING_OPS: Final[tuple[str, ...]] = ("all-reduce", "reduce-scatter", "all-gather")
"""The ops that run fused on a ring (``ring_transfer``) and at a level of a hierarchical
collective (``Level``); broadcast runs as a chain, all-to-all as point-to-point sends."""
Algorithm = Literal["ring", "tree"]
ALGORITHMS: Final[tuple[str, ...]] = get_args(Algorithm)

BROADCAST_CHUNK_BYTES: Final = 4 * MiB
"""Target chunk of the pipelined broadcast: NCCL's default ``NCCL_BUFFSIZE`` (4 MiB)."""
MAX_BROADCAST_CHUNKS: Final = 64
"""Above 64 x 4 MiB the chunks grow instead of multiplying (bounds the simulated events)."""
EXHAUSTIVE_RING_MAX: Final = 8
"""Groups up to this size get the best ring over all orders; larger ones keep their order."""

_BUS_FACTOR_NUM: Final = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1}


@dataclass(frozen=True)
class CollectiveTime:
    """One collective alone on an idle server."""

    op: str
    n_bytes: int
    ring: tuple[int, ...]
    """The GPUs in ring order (each sends to the next, the last to the first); for
    all-to-all, which runs no ring, the group in the order given."""
    time_s: float
    algbw: float
    """Algorithm bandwidth, bytes/s: ``n_bytes / time_s``."""
    busbw: float
    """Bus bandwidth, bytes/s: ``algbw`` times the op's factor (nccl-tests' definition)."""


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` GPUs: 2(n-1)/n for all-reduce, (n-1)/n for
    reduce-scatter, all-gather and all-to-all, 1 for broadcast (nccl-tests,
    doc/PERFORMANCE.md; all-to-all's as ``alltoall_perf`` computes it)."""
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
    if algorithm == "tree" and op == "all-to-all":
        raise MpsimError("all-to-all runs as point-to-point sends (as NCCL's does), not on a tree")
    if algorithm == "tree" and op != "all-reduce":
        raise MpsimError(f"the tree algorithm runs all-reduce only (as NCCL's does), not {op}")


def check_ring_op(op: str) -> None:
    """``op`` runs on a ring (``RING_OPS``): all-to-all and broadcast do not."""
    if op not in RING_OPS:
        raise MpsimError(f"{op} does not run on a ring: expected one of {', '.join(RING_OPS)}")


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
    check_ring_op(op)
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
            if self.op not in RING_OPS:
                raise MpsimError("a level of a hierarchical collective runs all-reduce, reduce-scatter or "
                                 f"all-gather, not {self.op}")
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


# -- all-to-all ------------------------------------------------------------------------------

Sends = int | Sequence[int]
"""An all-to-all's load: every rank's whole send buffer in bytes (an int), or each rank's
(a sequence in the group's order), each spread evenly over the n ranks."""


@dataclass(frozen=True)
class AllToAllRoutes:
    """The flows an all-to-all over a group puts on the network (:func:`all_to_all_routes`).

    ``switched``: every route i -> j of the group is i's own links out then j's own links
    in (a non-blocking switch: NVSwitch, an NVL72 rack), so GPU i's n-1 sends are one flow
    over its out links and its n-1 receives one flow over its in links: ``routes`` holds
    the n out-routes, then the n in-routes (2n flows). Otherwise one flow per ordered pair
    (i, j), i != j, in row order (n(n-1) flows)."""

    group: tuple[int, ...]
    switched: bool
    routes: tuple[Route, ...]
    latency_s: float
    """One step: the largest setup latency over the group's pair routes."""


def _lcp(routes: Sequence[tuple[Link, ...]]) -> tuple[Link, ...]:
    """The longest common prefix of ``routes``' link tuples."""
    first = routes[0]
    k = 0
    while k < len(first) and all(len(r) > k and r[k] == first[k] for r in routes):
        k += 1
    return first[:k]


def _switched_halves(pairs: dict[tuple[int, int], Route], group: tuple[int, ...]) -> \
        tuple[list[tuple[Link, ...]], list[tuple[Link, ...]]] | None:
    """Each GPU's own out links and own in links, when every pair route is exactly the
    sender's out links then the receiver's in links and no link is in two GPUs' halves
    (so the per-GPU flows cross the same links as the pair flows, each link carrying one
    GPU's sends or receives); None otherwise. Needs three GPUs (with two, a route is its
    own prefix and suffix)."""
    if len(group) < 3:
        return None
    outs = [_lcp([pairs[i, j].links for j in group if j != i]) for i in group]
    ins = [tuple(reversed(_lcp([tuple(reversed(pairs[i, j].links)) for i in group if i != j]))) for j in group]
    for a, i in enumerate(group):
        for b, j in enumerate(group):
            if i != j and pairs[i, j].links != outs[a] + ins[b]:
                return None
    halves = (*outs, *ins)
    if not all(halves):
        return None
    names = [link.name for half in halves for link in half]
    return (outs, ins) if len(names) == len(set(names)) else None


@functools.lru_cache(maxsize=1024)
def all_to_all_routes(topo: Topology, group: tuple[int, ...]) -> AllToAllRoutes:
    """The flows of an all-to-all over ``group`` on ``topo`` (``AllToAllRoutes``), worked
    out once per group: per GPU one flow out and one in on a switched group, else one per
    ordered pair (a group of two or more distinct GPUs of ``topo``, refused in one line
    otherwise). On a switch both carry the same bytes over the same links when the
    all-to-all is alone, so the time is the same; the per-GPU flows keep a 64-GPU group
    (NVL72) at 128 flows instead of 4,032. Sharing links with other traffic, a GPU's
    sends then take one fair share of its link, as a ring collective's hop does, and the
    out and in halves of a byte's path run as separate flows (a simplification)."""
    check_group(topo, group)
    pairs = {(i, j): topo.route(i, j) for i in group for j in group if i != j}
    latency_s = max(r.latency_s for r in pairs.values())
    halves = _switched_halves(pairs, group)
    if halves is None:
        return AllToAllRoutes(group, False, tuple(pairs.values()), latency_s)
    outs, ins = halves
    return AllToAllRoutes(group, True, tuple(Route(links) for links in (*outs, *ins)), latency_s)


def all_to_all_chunks(n_bytes: Sends, n: int) -> list[int]:
    """The bytes each of the ``n`` ranks sends to each peer: its send buffer over n,
    rounded up (an int: every rank's buffer)."""
    if isinstance(n_bytes, int):
        return [-(-n_bytes // n)] * n
    if len(n_bytes) != n:
        raise MpsimError(f"an all-to-all over {n} GPUs needs {n} send sizes, got {len(n_bytes)}")
    if any(b < 0 for b in n_bytes):
        raise MpsimError(f"an all-to-all's send sizes are bytes >= 0, got {list(n_bytes)}")
    return [-(-b // n) for b in n_bytes]


def all_to_all_transfer(network: Network, topo: Topology, group: Sequence[int], n_bytes: Sends) -> simpy.Event:
    """An all-to-all over ``group`` (n GPUs) started now, as NCCL runs it: the event of
    the last flow's landing.

    Every rank sends 1/n of its send buffer (``n_bytes``: every rank's, as nccl-tests'
    ``alltoall_perf`` counts the size, or one per rank for an uneven load, e.g. the
    tokens an expert-parallel rank routes) to each of the n-1 others, all at once: NCCL
    has no all-to-all algorithm of its own; ``alltoall_perf`` (and PyTorch's
    ``all_to_all``) issue n send/recv pairs in one ``ncclGroupStart``/``ncclGroupEnd``,
    which NCCL schedules as point-to-point rounds on their own channels, so with enough
    channels every peer's send runs at once. NCCL's tuner prices no point-to-point
    operation; here each send pays its route's setup latency once, as a copy does, and
    since the sends overlap the flows start together after one step, the largest route
    latency of the group (what one ring step pays). The flows share links
    max-min fairly with everything else on ``network`` (``all_to_all_routes``: per pair,
    or per GPU out and in on a switch). The rank's share to itself stays on the GPU.

    Alone on a switched server where each GPU has its own links of B bytes/s and latency
    L, with S bytes per rank: L + S (n-1) / (n B), so busbw = B less the latency's share.
    With uneven sends the busiest sender or receiver lands last. Not modelled: NCCL's
    channel limit for very large groups (``NCCL_MAX_P2P_NCHANNELS``: beyond
    channels / channels-per-peer peers, rounds wait their turn), hierarchical all-to-all
    (:func:`all_to_all_two_level` models NCCL's flat one)."""
    plan = all_to_all_routes(topo, tuple(group))
    return network.transfer_all(list(plan.routes), _local_sizes(plan, all_to_all_chunks(n_bytes, len(plan.group))),
                                plan.latency_s)


def all_to_all_v_transfer(network: Network, topo: Topology, group: Sequence[int],
                          matrix: Sequence[Sequence[int]]) -> simpy.Event:
    """:func:`all_to_all_transfer` with any load: ``matrix[a][b]`` bytes from the a-th GPU
    of ``group`` to the b-th (nccl-tests' ``alltoallv``; the diagonal stays on the GPU),
    so a rank that receives more (the GPU of a popular expert at dispatch) lands later."""
    plan = all_to_all_routes(topo, tuple(group))
    n = len(plan.group)
    if len(matrix) != n or any(len(row) != n for row in matrix):
        raise MpsimError(f"an all-to-all over {n} GPUs needs an {n} x {n} matrix of bytes")
    if any(b < 0 for row in matrix for b in row):
        raise MpsimError("an all-to-all's matrix holds bytes >= 0")
    if plan.switched:
        sizes = [sum(row) - row[a] for a, row in enumerate(matrix)]
        sizes += [sum(row[b] for row in matrix) - matrix[b][b] for b in range(n)]
    else:
        sizes = [matrix[a][b] for a in range(n) for b in range(n) if a != b]
    return network.transfer_all(list(plan.routes), sizes, plan.latency_s)


@functools.lru_cache(maxsize=1024)
def _mirror_halves(view: ClusterView, gpu: int) -> tuple[Route, Route]:
    """``view.mirror_route(gpu)`` cut into its way out of the server (PCIe up, the NIC's
    transmit link, the spine) and its way in (the same links back, receive side): the
    view builds it as out then in, one link each way per hop, so the halves are equal."""
    links = view.mirror_route(gpu).links
    half = len(links) // 2
    return Route(links[:half]), Route(links[half:])


def all_to_all_two_level(network: Network, view: ClusterView, local_group: Sequence[int], across: int,
                         n_bytes: Sends) -> simpy.Event:
    """A flat all-to-all over m GPUs (``local_group``, on the simulated server) on each of
    ``across`` identical servers (n = m x across ranks), started now: the event of the
    last landing.

    NCCL's all-to-all is flat: every rank sends 1/n of its buffer to each of the n-1
    others directly, the m(across-1) shares for other servers through its NIC
    (GPUDirect RDMA) while the m-1 shares inside the server cross the server's links,
    all at once after one step (the largest latency of either). Inside, the m GPUs run
    :func:`all_to_all_transfer`'s flows on their shares; across, each GPU sends its
    m(across-1) shares over ``ClusterView.mirror_route``, which by symmetry stands for
    what every other server sends it (the other servers run the same ranks with the same
    loads). A per-rank load (``n_bytes`` a sequence, one per GPU of ``local_group``,
    mirrored on every server) makes a GPU's sends and receives across differ, so its
    mirror route runs as two flows, out and back in. Hierarchical all-to-all (gather
    inside a server, then one exchange across per pair of servers), as some frameworks
    run it, is not modelled.

    Alone on an idle fabric with each GPU's own links of B inside and b across: latency +
    max((m-1) S / (n B), m (across-1) S / (n b))."""
    group = tuple(local_group)
    m = len(group)
    if across < 1:
        raise MpsimError(f"an all-to-all spans at least one server, got {across}")
    chunks = _server_chunks(n_bytes, m, across)
    routes: list[Route] = []
    sizes: list[int] = []
    latency_s = 0.0
    if m > 1:
        plan = all_to_all_routes(view, group)
        routes += plan.routes
        sizes += _local_sizes(plan, chunks)
        latency_s = plan.latency_s
    if across > 1:
        even = len(set(chunks)) == 1
        total = sum(chunks)
        for g, c in zip(group, chunks):
            if even:
                routes.append(view.mirror_route(g))
                sizes.append(m * (across - 1) * c)
            else:
                routes += _mirror_halves(view, g)
                sizes += [m * (across - 1) * c, (across - 1) * total]
        latency_s = max(latency_s, max(view.mirror_route(g).latency_s for g in group))
    return network.transfer_all(routes, sizes, latency_s)


def _server_chunks(n_bytes: Sends, m: int, across: int) -> list[int]:
    """What each of the server's ``m`` ranks sends to each of the m x ``across`` ranks."""
    n = m * across
    if isinstance(n_bytes, int):
        return [-(-n_bytes // n)] * m
    if len(n_bytes) != m:
        raise MpsimError(f"the server's {m} GPUs of an all-to-all need {m} send sizes, got {len(n_bytes)}")
    if any(b < 0 for b in n_bytes):
        raise MpsimError(f"an all-to-all's send sizes are bytes >= 0, got {list(n_bytes)}")
    return [-(-b // n) for b in n_bytes]


def _local_sizes(plan: AllToAllRoutes, chunks: list[int]) -> list[int]:
    """Bytes of each of ``plan``'s flows when rank a sends ``chunks[a]`` to each peer."""
    n = len(chunks)
    if plan.switched:
        total = sum(chunks)
        return [(n - 1) * c for c in chunks] + [total - c for c in chunks]
    return [c for c in chunks for _ in range(n - 1)]


def all_to_all_bottleneck(topo: Topology, group: Sequence[int]) -> float:
    """The highest bus bandwidth (bytes/s) an even all-to-all over ``group`` can reach on
    ``topo``: (n-1) x the smallest, over the links the pair routes cross, of the link's
    bandwidth over the number of routes crossing it (the busiest link's bytes over its
    bandwidth bound the time; nccl-tests' busbw = (n-1)/n x size / time). B on a switch
    where each GPU has its own links of B."""
    group = tuple(group)
    load: dict[str, int] = {}
    width: dict[str, float] = {}
    for i in group:
        for j in group:
            if i != j:
                for link in topo.route(i, j).links:
                    load[link.name] = load.get(link.name, 0) + 1
                    width[link.name] = link.bandwidth
    return (len(group) - 1) * min(width[name] / count for name, count in load.items())


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
    equal flows land in one simulation event.) Refuses an op that runs no ring, so that
    ``ring_transfer`` and ``tiered_transfer`` are never handed one (``max_hop_bytes``)."""
    check_ring_op(op)
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
    over the best ring (:func:`best_ring`; a tree is laid over the same order; all-to-all
    runs no ring: :func:`all_to_all_transfer` over the group as given); bandwidths as
    nccl-tests defines them."""
    check_op(op)
    check_algorithm(op, algorithm)
    group = list(range(topo.n_gpus)) if gpus is None else list(gpus)
    if n_bytes <= 0:
        raise MpsimError(f"a collective's size must be positive, got {n_bytes} bytes")
    if op == "all-to-all":
        check_group(topo, group)
        ring = tuple(group)
    else:
        ring = best_ring(topo, group)
    env = simpy.Environment()
    if op == "all-to-all":
        env.process(_wait(all_to_all_transfer(Network(env), topo, ring, n_bytes)))
    elif algorithm == "tree":
        env.process(tree_all_reduce(env, Network(env), topo, ring, n_bytes))
    else:
        env.process(ring_collective(env, Network(env), topo, ring, op, n_bytes))
    env.run()
    time_s = float(env.now)
    algbw = n_bytes / time_s if time_s > 0 else float("inf")
    return CollectiveTime(op, n_bytes, ring, time_s, algbw, algbw * bus_factor(op, len(ring)))


def _wait(event: simpy.Event) -> Generator[simpy.Event, Any, None]:
    """A process body that ends when ``event`` fires."""
    yield event
