"""All-to-all on the fluid network: the closed form on hand-built switches and meshes,
the busiest link's bound on servers whose routes share links, uneven loads (the busiest
rank decides), two levels across servers against every server simulated, nccl-tests'
bus bandwidth, the CLI, and the ring code refusing it."""

from __future__ import annotations

import json

import pytest
import simpy
from helpers import topology_dict

from mpsim.cli import main
from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster, ClusterFile
from mpsim.hardware.topology import Topology, parse_topology
from mpsim.sim.collectives import (
    OPS,
    RING_OPS,
    Level,
    all_to_all_bottleneck,
    all_to_all_routes,
    all_to_all_transfer,
    all_to_all_two_level,
    all_to_all_v_transfer,
    bus_factor,
    collective_time,
    hop_bytes,
    ring_collective,
)
from mpsim.sim.network import Network

GBPS = 1e9


def switch(n: int, gbps: float = 1.0, latency_us: float = 0.0, pcie_gbps: float = 1.0) -> Topology:
    """``n`` GPUs on an NVSwitch: every GPU its own ``gbps`` link in and out."""
    d = topology_dict(n_gpus=n, latency_us=latency_us, pcie_gbps=pcie_gbps)
    del d["nvlink"]
    d["nvswitch"] = {"gpu_bandwidth_gbps": gbps, "links_per_gpu": 1, "latency_us": latency_us}
    return parse_topology(d, "switch.yaml")


def mesh(n: int, gbps: float = 1.0, latency_us: float = 0.0) -> Topology:
    """``n`` GPUs with one NVLink of ``gbps`` between every pair."""
    d = topology_dict(n_gpus=n, nvlink_gbps=gbps, latency_us=latency_us, pcie_gbps=gbps / 10)
    d["nvlink"]["pairs"] = [{"gpus": [a, b], "links": 1} for a in range(n) for b in range(a + 1, n)]
    return parse_topology(d, "mesh.yaml")


def two_switches(gbps: float = 8.0) -> Topology:
    """PCIe only: GPUs 0, 1 below one switch, 2, 3 below another, each uplink ``gbps``."""
    d = topology_dict(n_gpus=4, pcie_gbps=gbps)
    del d["nvlink"]
    d["pcie"]["switches"] = [{"name": "sw0", "socket": 0, "gpus": [0, 1], "uplink_gbps": gbps},
                             {"name": "sw1", "socket": 0, "gpus": [2, 3], "uplink_gbps": gbps}]
    return parse_topology(d, "pcie.yaml")


def _run(make) -> float:
    """The instant the event ``make(network)`` returns fires, on a network idle but for
    what ``make`` starts."""
    env = simpy.Environment()
    net = Network(env)
    event = make(net)
    end: list[float] = []

    def wait():
        yield event
        end.append(float(env.now))

    env.process(wait())
    env.run()
    return end[0]


def _pairs(net: Network, topo: Topology, group, matrix) -> simpy.Event:
    """The same all-to-all as one flow per ordered pair, whatever the topology."""
    routes, sizes = [], []
    for a, i in enumerate(group):
        for b, j in enumerate(group):
            if i != j:
                routes.append(topo.route(i, j))
                sizes.append(matrix[a][b])
    latency_s = max(r.latency_s for r in routes)
    return net.transfer_all(routes, sizes, latency_s)


# -- closed forms ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_switch_takes_latency_plus_the_shares_over_the_gpu_link(n):
    """Each GPU sends S/n to each of n-1 peers over its own link of B after one step of
    latency L: T = L + S (n-1) / (n B); nccl-tests' busbw = S/T x (n-1)/n = B (1 - L/T)."""
    b, lat, size = 2 * GBPS, 3e-6, 24 * 10**6
    r = collective_time(switch(n, gbps=2.0, latency_us=3.0), "all-to-all", size)
    assert r.time_s == pytest.approx(lat + size * (n - 1) / (n * b), rel=1e-12)
    assert r.algbw == pytest.approx(size / r.time_s, rel=1e-12)
    assert r.busbw == pytest.approx(b * (1 - lat / r.time_s), rel=1e-12)
    assert r.ring == tuple(range(n))  # no ring: the group as given


def test_without_latency_busbw_is_the_link_bandwidth():
    r = collective_time(switch(8, gbps=100.0), "all-to-all", 8 * 10**9)
    assert r.busbw == pytest.approx(100 * GBPS, rel=1e-12)
    assert r.algbw == pytest.approx(100 * GBPS * 8 / 7, rel=1e-12)
    assert bus_factor("all-to-all", 8) == 7 / 8


@pytest.mark.parametrize("n", [3, 4])
def test_a_full_mesh_sends_each_share_on_its_own_link(n):
    """A link per pair: the n-1 sends do not share, T = L + S / (n B)."""
    size = 12 * 10**6
    t = collective_time(mesh(n, gbps=2.0, latency_us=3.0), "all-to-all", size).time_s
    assert t == pytest.approx(3e-6 + size / (n * 2 * GBPS), rel=1e-12)


def test_the_flows_a_call_costs():
    """A switch: one flow out and one in per GPU (2n); otherwise one per ordered pair,
    n(n-1); two GPUs on a switch are a pair each way. The 72-GPU rack: 144, not 5,112."""
    assert all_to_all_routes(switch(8), tuple(range(8))).switched
    assert len(all_to_all_routes(switch(8), tuple(range(8))).routes) == 16
    assert len(all_to_all_routes(switch(2), (0, 1)).routes) == 2
    assert len(all_to_all_routes(mesh(4), (0, 1, 2, 3)).routes) == 12
    assert len(all_to_all_routes(two_switches(), (0, 1, 2, 3)).routes) == 12
    assert len(all_to_all_routes(load_topology("dgx1-v100"), tuple(range(8))).routes) == 56
    rack = all_to_all_routes(load_topology("gb200-nvl72"), tuple(range(72)))
    assert rack.switched and len(rack.routes) == 144


@pytest.mark.parametrize("matrix", [
    [[0, 5, 5, 5], [5, 0, 5, 5], [5, 5, 0, 5], [5, 5, 5, 0]],
    [[0, 9, 1, 3], [2, 0, 8, 1], [7, 7, 0, 7], [1, 1, 1, 0]],
])
def test_per_gpu_flows_on_a_switch_land_when_pair_flows_do(matrix):
    """On a switch the per-GPU flows carry each link's bytes: alone, the same end as one
    flow per pair (the busiest row or column over B)."""
    topo, group = switch(4, gbps=1e-6), (0, 1, 2, 3)  # 1,000 bytes/s
    m = [[x * 1000 for x in row] for row in matrix]
    per_gpu = _run(lambda net: all_to_all_v_transfer(net, topo, group, m))
    pairs = _run(lambda net: _pairs(net, topo, group, m))
    busiest = max(max(sum(row) - row[a] for a, row in enumerate(m)),
                  max(sum(row[b] for row in m) - m[b][b] for b in range(4)))
    assert per_gpu == pytest.approx(pairs, rel=1e-12)
    assert per_gpu == pytest.approx(busiest / 1000, rel=1e-12)


# -- routes that share links -------------------------------------------------------------------

def _busiest_link_s(topo: Topology, group, chunk: int) -> float:
    """The busiest link's bytes over its bandwidth when each pair sends ``chunk``."""
    load: dict[str, float] = {}
    width: dict[str, float] = {}
    for i in group:
        for j in group:
            if i != j:
                for link in topo.route(i, j).links:
                    load[link.name] = load.get(link.name, 0) + chunk
                    width[link.name] = link.bandwidth
    return max(load[k] / width[k] for k in load)


@pytest.mark.parametrize("topo", [load_topology("dgx1-v100"), load_topology("titanrtx-x4-pcie"), two_switches()],
                         ids=["dgx1-v100", "titanrtx-x4-pcie", "two-pcie-switches"])
def test_shared_links_bound_the_time(topo):
    """Routes share links (the DGX-1's hybrid cube mesh sends the pairs without NVLink over
    PCIe and QPI; a PCIe tree's uplinks): no faster than the busiest link's bytes over its
    bandwidth, and busbw no higher than ``all_to_all_bottleneck``."""
    group = list(range(topo.n_gpus))
    n, size = len(group), 10**9
    r = collective_time(topo, "all-to-all", size)
    latency_s = max(topo.route(i, j).latency_s for i in group for j in group if i != j)
    assert r.time_s >= latency_s + _busiest_link_s(topo, group, size // n) * (1 - 1e-12)
    assert r.busbw <= all_to_all_bottleneck(topo, group) * (1 + 1e-12)


def test_two_pcie_switches_take_the_uplink_s_share():
    """Each uplink carries the 4 cross-switch shares of S/4 (2 GPUs x 2 peers): T = S/B."""
    size = 4 * 10**6
    assert collective_time(two_switches(8.0), "all-to-all", size).time_s == pytest.approx(size / (8 * GBPS))
    assert all_to_all_bottleneck(two_switches(8.0), [0, 1, 2, 3]) == pytest.approx(3 * 8 * GBPS / 4)


# -- uneven loads -----------------------------------------------------------------------------

def test_the_busiest_sender_decides():
    """Per-rank send buffers: rank 1 sends 4 S, the others S; T = L + 4 S (n-1) / (n B)."""
    topo, n, size = switch(4, gbps=2.0, latency_us=3.0), 4, 8 * 10**6
    sends = [size, 4 * size, size, size]
    got = _run(lambda net: all_to_all_transfer(net, topo, range(n), sends))
    assert got == pytest.approx(3e-6 + 4 * size * 3 / (4 * 2 * GBPS), rel=1e-12)
    even = _run(lambda net: all_to_all_transfer(net, topo, range(n), size))
    assert even == pytest.approx(_run(lambda net: all_to_all_transfer(net, topo, range(n), [size] * n)), rel=1e-12)
    assert got > even


def test_the_busiest_receiver_decides():
    """Everyone sends GPU 2 (a popular expert at dispatch) 3 units and the rest 1: its link
    in carries 9 units while each link out carries 5."""
    topo, unit = switch(4, gbps=1e-6), 1000
    m = [[0 if a == b else (3 if b == 2 else 1) * unit for b in range(4)] for a in range(4)]
    assert _run(lambda net: all_to_all_v_transfer(net, topo, range(4), m)) == pytest.approx(9.0, rel=1e-12)
    m10 = [[10 * x for x in row] for row in m]
    on_mesh = _run(lambda net: all_to_all_v_transfer(net, mesh(4, gbps=1e-5), range(4), m10))
    assert on_mesh == pytest.approx(3.0, rel=1e-12)  # a link per pair (10,000 bytes/s): the largest share


def test_a_transfer_on_a_gpu_link_slows_the_all_to_all():
    topo, size = switch(4, gbps=1.0), 4 * 10**6
    alone = _run(lambda net: all_to_all_transfer(net, topo, range(4), size))

    def beside(src, dst):
        def make(net):
            net.transfer(topo.route(src, dst), size)
            return all_to_all_transfer(net, topo, range(4), size)
        return make

    assert _run(beside(0, 1)) > alone * 1.1
    assert _run(beside(0, "host")) == pytest.approx(alone, rel=1e-12)  # PCIe shares no switch link


# -- across servers ---------------------------------------------------------------------------

def toy_cluster(m: int = 4, latency_us: float = 0.0, **fabric: object) -> Cluster:
    """``m``-GPU switched servers (8 GB/s per GPU, PCIe 100 GB/s), one 1 GB/s NIC per GPU."""
    base = {"kind": "rail-optimized", "nics_per_server": m, "nic_gbit": 8.0, "efficiency": 1.0,
            "latency_us": latency_us, "source": "hand-built"} | fabric
    spec = ClusterFile.model_validate({"schema": 1, "name": "toy", "server": "unused", "max_servers": 64,
                                       "fabric": base})
    return Cluster(spec, switch(m, gbps=8.0, latency_us=latency_us, pcie_gbps=100.0), "toy.yaml")


@pytest.mark.parametrize("across", [2, 4])
def test_across_servers_the_nic_takes_the_remote_shares(across):
    """n = m x across ranks: each GPU sends (m-1) S/n inside at B = 8 GB/s and m(across-1)
    S/n through its NIC at b = 1 GB/s, at once: T = L + max of the two."""
    m, size = 4, 64 * 10**6
    n = m * across
    view = toy_cluster(m, latency_us=10.0).view(1)
    got = _run(lambda net: all_to_all_two_level(net, view, range(m), across, size))
    assert got == pytest.approx(10e-6 + max((m - 1) * size / n / (8 * GBPS), m * (across - 1) * size / n / GBPS),
                                rel=1e-9)


def test_one_server_is_the_single_server_all_to_all():
    view = toy_cluster(4, latency_us=10.0).view(1)
    size = 64 * 10**6
    assert _run(lambda net: all_to_all_two_level(net, view, range(4), 1, size)) == \
        pytest.approx(_run(lambda net: all_to_all_transfer(net, view, range(4), size)), rel=1e-12)


@pytest.mark.parametrize("fabric", [{}, {"kind": "fat-tree", "oversubscription": 2.0},
                                    {"nic_groups": [{"gpus": [0, 1], "nics": 2}, {"gpus": [2, 3], "nics": 2}]}])
@pytest.mark.parametrize("sends", [[48 * 10**6] * 4, [96 * 10**6, 48 * 10**6, 48 * 10**6, 24 * 10**6]])
def test_mirror_routes_give_what_every_server_simulated_gives(fabric, sends):
    """The simulated server's GPUs with mirror routes (what the engine runs) against every
    server's GPUs in one flat all-to-all over the real routes, each server's rank r
    sending what rank r of the simulated one sends: the same time."""
    m, across = 4, 2
    cluster = toy_cluster(m, latency_us=5.0, **fabric)
    once = _run(lambda net: all_to_all_two_level(net, cluster.view(1), range(m), across, sends))
    every = _run(lambda net: all_to_all_transfer(net, cluster.view(across), range(m * across), sends * across))
    assert once == pytest.approx(every, rel=1e-9)


def test_the_busiest_rank_across_servers_decides():
    """Rank 0 sends 2 S: its NIC out carries m(across-1) x 2S/n = S at b = 1 GB/s."""
    m, across, size = 4, 2, 64 * 10**6
    view = toy_cluster(m).view(1)
    got = _run(lambda net: all_to_all_two_level(net, view, range(m), across, [2 * size, size, size, size]))
    assert got == pytest.approx(size / GBPS, rel=1e-9)


# -- bad input and the ring code --------------------------------------------------------------

@pytest.mark.parametrize("call, says", [
    (lambda net, t: all_to_all_transfer(net, t, range(4), [1, 2, 3]), "4 send sizes"),
    (lambda net, t: all_to_all_transfer(net, t, range(4), [1, 2, 3, -4]), ">= 0"),
    (lambda net, t: all_to_all_v_transfer(net, t, range(4), [[0] * 4] * 3), "4 x 4"),
    (lambda net, t: all_to_all_v_transfer(net, t, range(4), [[0, 0, 0, -1]] * 4), ">= 0"),
])
def test_bad_loads_are_refused_in_one_line(call, says):
    net = Network(simpy.Environment())
    with pytest.raises(MpsimError, match=says) as err:
        call(net, switch(4))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("group, says", [([0], "at least 2"), ([0, 1, 1], "distinct"), ([0, 4], "GPU 4")])
def test_bad_groups_are_refused_in_one_line(group, says):
    with pytest.raises(MpsimError, match=says):
        all_to_all_transfer(Network(simpy.Environment()), switch(4), group, 100)


def test_the_ring_code_is_never_handed_an_all_to_all():
    """all-to-all is an op (``OPS``) but not a ring's (``RING_OPS``): the ring, its hop
    bytes and a level of a hierarchical collective refuse it."""
    assert "all-to-all" in OPS and "all-to-all" not in RING_OPS
    topo = switch(4)
    with pytest.raises(MpsimError, match="does not run on a ring"):
        hop_bytes("all-to-all", 100, 4)
    env = simpy.Environment()
    with pytest.raises(MpsimError, match="does not run on a ring"):
        next(ring_collective(env, Network(env), topo, [0, 1, 2, 3], "all-to-all", 100))
    with pytest.raises(MpsimError, match="not all-to-all"):
        Level("all-to-all", 2, (), 0.0)


# -- the command ------------------------------------------------------------------------------

def _cli(capsys, *argv):
    code = main(["topo", "collective", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_nccl_tests_columns_for_all_to_all(capsys):
    """1 GiB on the 8 GPUs of a DGX H100 (405 GB/s per GPU into the NVSwitch, 10 us):
    10 us + 2^30 x 7/8 / 405e9 s = 2.330 ms, algbw 460.87 GB/s, busbw 403.26 GB/s."""
    code, out, _ = _cli(capsys, "--server", "dgx-h100", "--op", "all-to-all", "--size", "1GiB")
    assert code == 0
    assert "no ring" in out and "busbw 405.0 GB/s" in out
    assert "1073741824  1074  2.330      460.87      403.26" in out
    code, out, _ = _cli(capsys, "-s", "dgx-h100", "--op", "all-to-all", "--size", "1GiB,1MB", "--gpus", "0-3",
                        "--json", "-")
    d = json.loads(out)
    assert code == 0 and d["op"] == "all-to-all" and d["algorithm"] == "p2p" and d["ring"] is None
    assert d["gpus"] == [0, 1, 2, 3] and d["bottleneck_gbps"] == pytest.approx(405.0)
    row = d["sizes"][0]
    assert row["seconds"] == pytest.approx(10e-6 + 2**30 * 3 / 4 / 405e9, rel=1e-12)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 3 / 4)


def test_cli_refuses_the_tree_for_all_to_all_in_one_line(capsys):
    code, out, err = _cli(capsys, "--op", "all-to-all", "--size", "1GB", "--algorithm", "tree")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "point-to-point" in err
