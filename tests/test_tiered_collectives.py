"""Hierarchical collectives over N levels (``collectives.tiered_transfer``): the closed form
on hand-built links (latency steps of every level plus the slowest level's bytes over its
bandwidth, bytes from nccl-tests' bus factors on each level's share), the two-level case
the engine runs unchanged, levels that move nothing, and properties: time grows with the
bytes, and splitting a level into two never beats what the closed form allows."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import simpy
from helpers import topology_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster, ClusterFile, ClusterView
from mpsim.hardware.topology import Link, Route, parse_topology
from mpsim.sim.collectives import (
    Level,
    inter_server_steps,
    level_shares,
    max_hop_bytes,
    mirror_level,
    ring_level,
    ring_routes,
    ring_steps,
    tiered_transfer,
    two_level_transfer,
)
from mpsim.sim.network import Network

GBPS = 1e9
OPS = ("all-reduce", "reduce-scatter", "all-gather")
_names = itertools.count()


# -- hand-built links ------------------------------------------------------------------------------

def _link(bandwidth: float, latency_s: float = 0.0, tag: str = "l") -> Link:
    """A link of its own: the network numbers links by name across the process, so every
    link a test builds gets a name no other link has."""
    return Link(f"tiered-test/{tag}{next(_names)}", bandwidth, latency_s)


def _own_routes(k: int, bandwidth: float, latency_s: float = 0.0) -> tuple[Route, ...]:
    """``k`` flows, each on a link of its own."""
    return tuple(Route((_link(bandwidth, latency_s),)) for _ in range(k))


def _run(make: Any) -> float:
    """The simulated time at which the event ``make(network)`` returns fires."""
    env = simpy.Environment()
    net = Network(env)

    def wait() -> Any:
        yield make(net)

    env.process(wait())
    env.run()
    return float(env.now)


def _record(make: Any) -> list[tuple[list[Route], list[int], float]]:
    """The arguments of every ``Network.transfer_all`` call that ``make(network)`` makes."""
    calls: list[tuple[list[Route], list[int], float]] = []

    class Recording(Network):
        def transfer_all(self, routes: list[Route], n_bytes: list[int], latency_s: float) -> simpy.Event:
            calls.append((list(routes), list(n_bytes), latency_s))
            return super().transfer_all(routes, n_bytes, latency_s)

    make(Recording(simpy.Environment()))
    return calls


def factor(op: str, n: int) -> float:
    """nccl-tests' bus factor: what one GPU of an n-ring sends, as a share of the buffer."""
    return (2 if op == "all-reduce" else 1) * (n - 1) / n


def closed_form(levels: Sequence[tuple[str | None, int, float, float, int]], n_bytes: int) -> float:
    """(op, n, bandwidth, step latency, steps) per level, innermost first, each level's
    flows on links of their own: the steps' latency of every level plus the slowest
    level's bytes (its bus factor times its share, S / (n_0 ... n_{k-1})) over its bandwidth."""
    latency = sum(steps * lat for op, n, _bw, lat, steps in levels if op is not None and n > 1)
    slowest = 0.0
    share = float(n_bytes)
    for op, n, bw, _lat, _steps in levels:
        if op is not None and n > 1:
            slowest = max(slowest, factor(op, n) * share / bw)
        share /= n
    return latency + slowest


# -- the closed form ------------------------------------------------------------------------------

@pytest.mark.parametrize("bandwidths", [(8 * GBPS, 2 * GBPS, 1 * GBPS), (1 * GBPS, 4 * GBPS, 4 * GBPS),
                                        (8 * GBPS, 1 * GBPS, 8 * GBPS), (4 * GBPS, 4 * GBPS, 4 * GBPS)])
def test_three_level_all_reduce_takes_its_closed_form(bandwidths):
    """4 GPUs a server, 2 servers a rack, 3 racks; S = 48 MB. Shares 48, 12 and 6 MB; a GPU
    sends 2(3)/4 x 48 = 72 MB inside, 2(1)/2 x 12 = 12 MB across the rack, 2(2)/3 x 6 = 8 MB
    across racks. Latency 6 ring steps of 1 us, 2 of 2 us and, across racks, the double
    binary tree's min(2(3-1), 2 x ceil(log2 3)) = 4 steps of 5 us."""
    b0, b1, b2 = bandwidths
    n_bytes = 48 * 10**6
    levels = [Level("all-reduce", 4, _own_routes(4, b0, 1e-6), 1e-6),
              Level("all-reduce", 2, _own_routes(4, b1, 2e-6), 2e-6),
              Level("all-reduce", 3, _own_routes(4, b2, 5e-6), 5e-6, "ring-or-tree")]
    assert level_shares(levels, n_bytes) == [48 * 10**6, 12 * 10**6, 6 * 10**6]
    assert [max_hop_bytes("all-reduce", s, lv.size) for s, lv in zip(level_shares(levels, n_bytes), levels)] == [
        72 * 10**6, 12 * 10**6, 8 * 10**6]
    expected = 6 * 1e-6 + 2 * 2e-6 + 4 * 5e-6 + max(72e6 / b0, 12e6 / b1, 8e6 / b2)
    assert expected == pytest.approx(closed_form([("all-reduce", 4, b0, 1e-6, 6), ("all-reduce", 2, b1, 2e-6, 2),
                                                  ("all-reduce", 3, b2, 5e-6, 4)], n_bytes), rel=1e-15)
    assert _run(lambda net: tiered_transfer(net, levels, n_bytes)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ops", [("reduce-scatter", "reduce-scatter", "reduce-scatter"),
                                 ("all-gather", "all-gather", "all-gather"),
                                 ("reduce-scatter", "all-reduce", "all-reduce"),
                                 ("all-gather", "all-gather", None)])
def test_three_levels_of_any_op_take_their_closed_form(ops):
    """Each level's bytes are its op's bus factor times its share; sizes 2, 4, 5 at 2, 1 and
    0.5 GB/s with 3, 7 and 11 us a step (ring steps at every level)."""
    sizes, bws, lats = (2, 4, 5), (2 * GBPS, 1 * GBPS, 0.5 * GBPS), (3e-6, 7e-6, 11e-6)
    n_bytes = 40 * 10**6  # divisible by 2, 2 x 4, 2 x 4 x 5: every share and chunk exact
    levels = [Level(op, n, _own_routes(2, bw, lat), lat) for op, n, bw, lat in zip(ops, sizes, bws, lats)]
    spec = [(op, n, bw, lat, ring_steps(op, n) if op else 0) for op, n, bw, lat in zip(ops, sizes, bws, lats)]
    assert _run(lambda net: tiered_transfer(net, levels, n_bytes)) == pytest.approx(closed_form(spec, n_bytes),
                                                                                    rel=1e-12)


def test_an_inner_ring_of_a_server_under_hand_built_outer_levels():
    """The innermost level from a server's ring (``ring_level``: a 4-GPU NVSwitch at 8 GB/s,
    2 us a step: 96 MB at 8 GB/s) under two hand-built levels (16 MB shares, 24 MB at 2 GB/s;
    4 MB shares, 4 MB at 0.25 GB/s, the slowest): still the closed form."""
    d = topology_dict(n_gpus=4)
    del d["nvlink"]
    d["nvswitch"] = {"gpu_bandwidth_gbps": 8.0, "links_per_gpu": 1, "latency_us": 2.0}
    server = parse_topology(d, "switch.yaml")
    inner = ring_level(server, (0, 1, 2, 3), "all-reduce")
    assert inner.size == 4 and len(inner.routes) == 4 and inner.step_latency_s == pytest.approx(2e-6)
    levels = [inner, Level("all-reduce", 4, _own_routes(4, 2 * GBPS), 0.0),
              Level("all-reduce", 2, _own_routes(4, 0.25 * GBPS, 4e-6), 4e-6, "ring-or-tree")]
    n_bytes = 64 * 10**6
    expected = closed_form([("all-reduce", 4, 8 * GBPS, inner.step_latency_s, 6), ("all-reduce", 4, 2 * GBPS, 0.0, 6),
                            ("all-reduce", 2, 0.25 * GBPS, 4e-6, 2)], n_bytes)
    assert expected == pytest.approx(6 * 2e-6 + 2 * 4e-6 + 2 * 1 / 2 * 4e6 / (0.25 * GBPS), rel=1e-12)
    assert _run(lambda net: tiered_transfer(net, levels, n_bytes)) == pytest.approx(expected, rel=1e-12)


# -- the two-level case the engine runs -----------------------------------------------------------

def _cluster(n: int, latency_us: float) -> Cluster:
    """``n``-GPU NVSwitch servers (8 GB/s a GPU, PCIe 100 GB/s), one 1 GB/s NIC a GPU."""
    d = topology_dict(n_gpus=n, pcie_gbps=100.0, latency_us=latency_us)
    del d["nvlink"]
    d["nvswitch"] = {"gpu_bandwidth_gbps": 8.0, "links_per_gpu": 1, "latency_us": latency_us}
    fabric = {"kind": "rail-optimized", "nics_per_server": n, "nic_gbit": 8.0, "efficiency": 1.0,
              "latency_us": 3 * latency_us, "source": "hand-built"}
    spec = ClusterFile.model_validate({"schema": 1, "name": "toy-cluster", "server": "unused", "max_servers": 64,
                                       "fabric": fabric})
    return Cluster(spec, parse_topology(d, "switch.yaml"), "toy.yaml")


def _before(network: Network, view: ClusterView, ring: Sequence[int], intra_op: str | None, across: int,
            inter_op: str | None, n_bytes: int) -> simpy.Event:
    """``two_level_transfer`` as it was written before the levels: the reference the
    engine's results are held to."""
    n = len(ring)
    routes: list[Route] = []
    sizes: list[int] = []
    latency_s = 0.0
    if intra_op is not None and n > 1:
        hops, hop_latency_s = ring_routes(view, tuple(ring))
        routes += hops
        sizes += [max_hop_bytes(intra_op, n_bytes, n)] * n
        latency_s += ring_steps(intra_op, n) * hop_latency_s
    if inter_op is not None and across > 1:
        mirrors = [view.mirror_route(g) for g in ring]
        routes += mirrors
        sizes += [max_hop_bytes(inter_op, -(-n_bytes // n), across)] * n
        latency_s += inter_server_steps(inter_op, across) * max(r.latency_s for r in mirrors)
    return network.transfer_all(routes, sizes, latency_s)


@pytest.mark.parametrize("intra, inter", [("all-reduce", "all-reduce"), ("reduce-scatter", "reduce-scatter"),
                                          ("all-gather", "all-gather"), ("reduce-scatter", "all-reduce"),
                                          ("all-gather", None), (None, "all-reduce")])
@pytest.mark.parametrize("across", [1, 2, 3, 16])
@pytest.mark.parametrize("n_bytes", [1, 10**6 + 7, 64 * 10**6])
def test_two_levels_through_tiered_transfer_are_two_level_transfer_exactly(intra, inter, across, n_bytes):
    """The same flows in the same order, the same sizes, the same latency float and the
    same landing instant: through ``two_level_transfer``, through ``tiered_transfer`` on
    levels built by hand, and as ``two_level_transfer`` was written before (3.7 us a step
    inside, 11.1 us across: latencies whose sums round)."""
    n = 4
    view = _cluster(n, 3.7).view(1)
    ring = (0, 2, 1, 3)
    hops, hop_latency_s = ring_routes(view, ring)
    mirrors = tuple(view.mirror_route(g) for g in ring)
    by_hand = [Level(intra, n, tuple(hops), hop_latency_s),
               Level(inter, across, mirrors, max(r.latency_s for r in mirrors), "ring-or-tree")]
    makers = [lambda net: two_level_transfer(net, view, ring, intra, across, inter, n_bytes),
              lambda net: tiered_transfer(net, by_hand, n_bytes),
              lambda net: _before(net, view, ring, intra, across, inter, n_bytes)]
    calls = [_record(make) for make in makers]
    assert calls[0] == calls[1] == calls[2]
    (routes, _sizes, latency_s), = calls[0]
    assert all(a is b for a, b in zip(routes, calls[2][0][0]))  # the very route objects (the network keys by id)
    times = [_run(make) for make in makers]
    assert times[0] == times[1] == times[2]
    assert latency_s == pytest.approx((ring_steps(intra, n) * 3.7e-6 if intra else 0.0)
                                      + (inter_server_steps(inter, across) * 11.1e-6 if inter and across > 1 else 0.0),
                                      rel=1e-12)


def test_the_built_levels_are_what_the_view_gives():
    view = _cluster(4, 1.0).view(1)
    inside = ring_level(view, (0, 1, 2, 3), "reduce-scatter")
    across = mirror_level(view, (0, 1, 2, 3), "all-reduce", 8)
    assert list(inside.routes) == ring_routes(view, (0, 1, 2, 3))[0] and inside.steps == "ring"
    assert across.routes == tuple(view.mirror_route(g) for g in range(4)) and across.steps == "ring-or-tree"
    assert across.latency_steps() == inter_server_steps("all-reduce", 8) == 6
    assert inside.latency_steps() == 3
    assert ring_level(view, (0,), "all-reduce").routes == () and mirror_level(view, (0, 1), None, 8).routes == ()


# -- levels that move nothing -----------------------------------------------------------------------

def _three(lat: float = 1e-6) -> list[Level]:
    return [Level("all-reduce", 4, _own_routes(4, 4 * GBPS, lat), lat),
            Level("reduce-scatter", 2, _own_routes(4, GBPS, lat), lat),
            Level("all-reduce", 8, _own_routes(4, 0.5 * GBPS, lat), lat, "ring-or-tree")]


@pytest.mark.parametrize("where", [0, 1, 2, 3])
def test_a_level_of_one_gpu_adds_nothing(where):
    """A group of one, with routes and a latency of its own, wherever it sits: the same
    flows, sizes, latency and time."""
    levels = _three()
    one = Level("all-reduce", 1, _own_routes(4, 0.001 * GBPS, 1.0), 1.0)
    with_one = [*levels[:where], one, *levels[where:]]
    n_bytes = 32 * 10**6 + 3
    assert _record(lambda net: tiered_transfer(net, with_one, n_bytes)) == \
        _record(lambda net: tiered_transfer(net, levels, n_bytes))
    assert _run(lambda net: tiered_transfer(net, with_one, n_bytes)) == \
        _run(lambda net: tiered_transfer(net, levels, n_bytes))


def test_a_level_without_an_op_adds_no_flow_and_no_latency():
    """Outermost, a level without an op changes nothing; inside, it still cuts the buffer
    for the levels outside it (each of its GPUs holds 1/n), as HSDP's gather inside a
    server and nothing across does for the other way round."""
    levels = _three()
    n_bytes = 32 * 10**6
    idle = Level(None, 5, _own_routes(4, 0.001 * GBPS, 1.0), 1.0)
    assert _record(lambda net: tiered_transfer(net, [*levels, idle], n_bytes)) == \
        _record(lambda net: tiered_transfer(net, levels, n_bytes))
    inner_idle = Level(None, 4, levels[0].routes, levels[0].step_latency_s)
    outer = levels[1:]
    assert _run(lambda net: tiered_transfer(net, [inner_idle, *outer], n_bytes)) == \
        _run(lambda net: tiered_transfer(net, outer, n_bytes // 4))
    nothing = [Level(None, 4, _own_routes(2, GBPS, 1e-6), 1e-6), Level("all-reduce", 1, (), 0.0)]
    assert _run(lambda net: tiered_transfer(net, nothing, n_bytes)) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"op": "broadcast"}, "not broadcast"),
    ({"op": "all-to-all"}, "not all-to-all"),
    ({"op": "gather"}, "unknown collective"),
    ({"size": 0}, "at least one GPU"),
    ({"step_latency_s": -1.0}, "finite"),
    ({"step_latency_s": math.nan}, "finite"),
])
def test_bad_levels_are_refused_in_one_line(kwargs, message):
    args: dict[str, Any] = {"op": "all-reduce", "size": 2, "routes": (), "step_latency_s": 0.0} | kwargs
    with pytest.raises(MpsimError, match=message) as err:
        Level(**args)
    assert "\n" not in str(err.value)


# -- properties -------------------------------------------------------------------------------------

_level = st.tuples(st.sampled_from((*OPS, None)), st.integers(1, 5), st.sampled_from((1e3, 2e3, 5e3)),
                   st.sampled_from((0.0, 1e-3)), st.sampled_from(("ring", "ring-or-tree")))


def _levels(spec: Sequence[tuple[Any, ...]], shared: bool, flows: int = 3) -> list[Level]:
    """Levels from (op, n, bandwidth, step latency, steps): each level's flows on links of
    their own, or every flow of every level on one link (``shared``) of the first level's
    bandwidth."""
    one = Route((_link(spec[0][2], 0.0),))
    return [Level(op, n, (one,) * flows if shared else _own_routes(flows, bw), lat, steps)
            for op, n, bw, lat, steps in spec]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(spec=st.lists(_level, min_size=1, max_size=4), n_bytes=st.integers(1, 10**5), more=st.integers(1, 10**5),
       shared=st.booleans())
def test_time_grows_with_the_bytes(spec, n_bytes, more, shared):
    """More bytes never land sooner (up to the last bit of a float)."""
    levels = _levels(spec, shared)
    less_s = _run(lambda net: tiered_transfer(net, levels, n_bytes))
    more_s = _run(lambda net: tiered_transfer(net, levels, n_bytes + more))
    assert more_s >= less_s * (1 - 1e-12)
    if not shared:
        steps = [(op, n, bw, lat, Level(op, n, (), lat, rule).latency_steps()) for op, n, bw, lat, rule in spec]
        assert less_s >= closed_form(steps, n_bytes) * (1 - 1e-12)  # whole bytes: at least the exact share


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(op=st.sampled_from(OPS), a=st.integers(2, 6), b=st.integers(2, 6), units=st.integers(1, 50),
       lat=st.sampled_from((0.0, 1e-6, 3e-6)))
def test_splitting_a_level_never_beats_the_closed_form(op, a, b, units, lat):
    """One level of a x b GPUs at B against the same GPUs as a level of a inside a level
    of b, each at B, with S divisible by a x b so every chunk is whole.

    On one bottleneck link shared by both levels the split moves exactly the flat ring's
    bytes through it, f(a) S + f(b) S / a = f(ab) S for every op (f the bus factor), so it
    takes the flat bandwidth time plus its own latency steps: never less. On links of
    their own it takes the slower level's time, max(f(a) S, f(b) S / a) / B, which the
    closed form gives, and never less than that."""
    bw, n_bytes = 1e3, units * a * b * 1000
    flat = _run(lambda net: tiered_transfer(net, [Level(op, a * b, _own_routes(1, bw, lat), lat)], n_bytes))
    assert flat == pytest.approx(ring_steps(op, a * b) * lat + factor(op, a * b) * n_bytes / bw, rel=1e-12)
    split_latency = (ring_steps(op, a) + ring_steps(op, b)) * lat
    link = _link(bw, lat)
    wide = _link(10 * bw, 0.0)
    shared = [Level(op, a, (Route((link,)),), lat), Level(op, b, (Route((wide, link)),), lat)]
    through_one = _run(lambda net: tiered_transfer(net, shared, n_bytes))
    assert through_one == pytest.approx(split_latency + factor(op, a * b) * n_bytes / bw, rel=1e-9)
    assert through_one >= (flat - ring_steps(op, a * b) * lat + split_latency) * (1 - 1e-9)
    apart = [Level(op, a, _own_routes(1, bw, lat), lat), Level(op, b, _own_routes(1, bw, lat), lat)]
    own_links = _run(lambda net: tiered_transfer(net, apart, n_bytes))
    expected = closed_form([(op, a, bw, lat, ring_steps(op, a)), (op, b, bw, lat, ring_steps(op, b))], n_bytes)
    assert own_links == pytest.approx(expected, rel=1e-12)
    assert own_links >= expected * (1 - 1e-12)
