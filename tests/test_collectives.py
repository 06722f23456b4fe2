"""Ring collectives on the fluid network: closed forms on hand-built servers, nccl-tests'
bus bandwidth, the DGX-1 ring search, contention, and bad input refused in one line."""

from __future__ import annotations

import json

import pytest
import simpy
from helpers import topology_dict

from mpsim.cli import main
from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology, parse_topology
from mpsim.sim.collectives import (
    BROADCAST_CHUNK_BYTES,
    MAX_BROADCAST_CHUNKS,
    best_ring,
    broadcast_chunks,
    bus_factor,
    collective_time,
    hop_bytes,
    ring_bottleneck,
    ring_collective,
    tree_depth,
    tree_edges,
)
from mpsim.sim.network import Network

GBPS = 1e9


def nvswitch_topology(n: int, gbps: float = 1.0, latency_us: float = 0.0) -> Topology:
    """``n`` GPUs on an NVSwitch fabric: every GPU has its own ``gbps`` link in and out."""
    d = topology_dict(n_gpus=n)
    del d["nvlink"]
    d["nvswitch"] = {"gpu_bandwidth_gbps": gbps, "links_per_gpu": 1, "latency_us": latency_us}
    return parse_topology(d, "switch.yaml")


def nvlink_topology(n: int, pairs: list[tuple[int, int]], gbps: float = 1.0, latency_us: float = 0.0) -> Topology:
    """``n`` GPUs joined by one NVLink per listed pair, the rest over one PCIe switch."""
    d = topology_dict(n_gpus=n, nvlink_gbps=gbps, latency_us=latency_us, pcie_gbps=gbps / 10)
    d["nvlink"]["pairs"] = [{"gpus": list(p), "links": 1} for p in pairs]
    return parse_topology(d, "mesh.yaml")


def fully_connected(n: int, gbps: float = 1.0, latency_us: float = 0.0) -> Topology:
    return nvlink_topology(n, [(a, b) for a in range(n) for b in range(a + 1, n)], gbps, latency_us)


# -- closed forms --------------------------------------------------------------------------

@pytest.mark.parametrize("make", [fully_connected, nvswitch_topology])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_ops_take_their_closed_form(make, n):
    """Each step moves size/n bytes per GPU over its own links at B, after latency L:
    all-reduce 2(n-1)(L + size/(nB)), reduce-scatter and all-gather (n-1)(L + size/(nB))."""
    b, lat = 2 * GBPS, 3e-6
    topo = make(n, gbps=2.0, latency_us=3.0)
    size = 12 * 10**6
    step = lat + size / (n * b)
    assert collective_time(topo, "all-reduce", size).time_s == pytest.approx(2 * (n - 1) * step, rel=1e-12)
    assert collective_time(topo, "reduce-scatter", size).time_s == pytest.approx((n - 1) * step, rel=1e-12)
    assert collective_time(topo, "all-gather", size).time_s == pytest.approx((n - 1) * step, rel=1e-12)


def test_uneven_chunks_wait_for_the_hop_that_sends_most():
    """7 bytes on 4 GPUs: chunks 2,2,2,1. Over the 6 steps GPU i sends chunks i, i-1, ...
    (mod 4): 10, 11, 11 and 10 bytes; the fused ring ends when the 11-byte hop lands."""
    topo = nvswitch_topology(4, gbps=1e-6)  # 1000 bytes/s
    assert hop_bytes("all-reduce", 7, 4) == [10, 11, 11, 10]
    assert collective_time(topo, "all-reduce", 7).time_s == pytest.approx(11 / 1000, rel=1e-12)


@pytest.mark.parametrize("size, k", [(10**6, 1), (2 * MAX_BROADCAST_CHUNKS * BROADCAST_CHUNK_BYTES, 64),
                                     (10 * BROADCAST_CHUNK_BYTES, 10)])
def test_broadcast_is_a_pipelined_chain(size, k):
    """k chunks over n-1 hops: (k + n - 2)(L + size/(kB)); one chunk is the plain (n-1) step chain."""
    n, b, lat = 4, 5 * GBPS, 2e-6
    assert broadcast_chunks(size) == k
    got = collective_time(nvswitch_topology(n, gbps=5.0, latency_us=2.0), "broadcast", size).time_s
    assert got == pytest.approx((k + n - 2) * (lat + size / (k * b)), rel=1e-9)


def test_bus_bandwidth_is_the_link_bandwidth_on_an_idle_switch():
    """nccl-tests: busbw = algbw x 2(n-1)/n (all-reduce), x (n-1)/n (reduce-scatter, all-gather);
    with no latency it equals each GPU's link bandwidth."""
    topo = nvswitch_topology(8, gbps=100.0)
    for op, algbw_gbps in (("all-reduce", 100 * 8 / 14), ("reduce-scatter", 100 * 8 / 7), ("all-gather", 100 * 8 / 7)):
        r = collective_time(topo, op, 8 * 10**9)
        assert r.busbw == pytest.approx(100 * GBPS, rel=1e-12)
        assert r.algbw == pytest.approx(algbw_gbps * GBPS, rel=1e-12)
    assert bus_factor("all-reduce", 8) == 2 * 7 / 8
    assert bus_factor("all-gather", 4) == bus_factor("reduce-scatter", 4) == 3 / 4
    assert bus_factor("broadcast", 5) == 1.0


# -- the ring ------------------------------------------------------------------------------

def test_the_ring_search_finds_the_nvlink_cycle():
    """NVLinks 0-2, 2-1, 1-3, 3-0: the identity order 0>1 goes over PCIe; the search
    finds the all-NVLink ring and the collective is faster on it."""
    topo = nvlink_topology(4, [(0, 2), (2, 1), (1, 3), (3, 0)], gbps=10.0)
    ring = best_ring(topo, [0, 1, 2, 3])
    assert ring in {(0, 2, 1, 3), (0, 3, 1, 2)}
    assert ring_bottleneck(topo, ring) == 10 * GBPS
    assert ring_bottleneck(topo, [0, 1, 2, 3]) < 10 * GBPS
    size = 4 * 10**6
    assert collective_time(topo, "all-reduce", size).time_s == pytest.approx(6 * size / 4 / (10 * GBPS), rel=1e-12)


def test_dgx1_ring_beats_the_identity_order():
    """On the hybrid cube-mesh 3>4 and 7>0 have no NVLink; a ring of double NVLinks exists."""
    topo = load_topology("dgx1-v100")
    ring = best_ring(topo, list(range(8)))
    assert ring_bottleneck(topo, ring) >= ring_bottleneck(topo, list(range(8)))
    assert ring_bottleneck(topo, ring) == pytest.approx(45 * GBPS)
    assert all(topo.nvlinks_between(a, b) == 2 for a, b in zip(ring, (*ring[1:], ring[0])))
    identity = _run_beside(topo, list(range(8)), "all-reduce", 10**9, [])
    assert collective_time(topo, "all-reduce", 10**9).time_s < identity


def test_shared_links_count_in_the_bottleneck():
    """PCIe only, GPUs 0,1 below one switch and 2,3 below another: every cross-switch
    route has the same bandwidth, but ring 0>2>1>3 sends twice at once over each switch's
    uplink (0>2 and 1>3) where 0>1>2>3 sends once; the search sees it and so does the run."""
    d = topology_dict(n_gpus=4, pcie_gbps=8.0)
    del d["nvlink"]
    d["pcie"]["switches"] = [{"name": "sw0", "socket": 0, "gpus": [0, 1], "uplink_gbps": 8.0},
                             {"name": "sw1", "socket": 0, "gpus": [2, 3], "uplink_gbps": 8.0}]
    topo = parse_topology(d, "pcie.yaml")
    assert ring_bottleneck(topo, [0, 2, 1, 3]) == 4 * GBPS
    assert ring_bottleneck(topo, [0, 1, 2, 3]) == 8 * GBPS
    assert ring_bottleneck(topo, best_ring(topo, [0, 2, 1, 3])) == 8 * GBPS
    size = 4 * 10**6
    crossed = _run_beside(topo, [0, 2, 1, 3], "all-reduce", size, [])
    assert crossed == pytest.approx(6 * size / 4 / (4 * GBPS), rel=1e-12)
    assert collective_time(topo, "all-reduce", size, [0, 2, 1, 3]).time_s == pytest.approx(crossed / 2, rel=1e-12)


def test_large_groups_keep_their_order():
    topo = nvswitch_topology(10)
    assert best_ring(topo, list(range(9, -1, -1))) == tuple(range(9, -1, -1))


# -- the SimPy API: contention -------------------------------------------------------------

def _run_beside(topo, ring, op, n_bytes, others):
    """``op`` over ``ring`` started at 0 beside transfers ``(src, dst, bytes)``; its end time."""
    env = simpy.Environment()
    net = Network(env)
    for src, dst, n in others:
        net.transfer(topo.route(src, dst), n)
    end: list[float] = []

    def go():
        yield from ring_collective(env, net, topo, ring, op, n_bytes)
        end.append(env.now)

    env.process(go())
    env.run()
    return end[0]


def test_a_transfer_on_a_ring_link_slows_the_collective():
    topo = load_topology("dgx1-v100")
    ring = best_ring(topo, list(range(8)))
    alone = _run_beside(topo, ring, "all-reduce", 10**9, [])
    assert alone == pytest.approx(collective_time(topo, "all-reduce", 10**9).time_s, rel=1e-12)
    beside = _run_beside(topo, ring, "all-reduce", 10**9, [(ring[0], ring[1], 10**9)])
    assert beside > alone * 1.1
    off_ring = _run_beside(topo, ring, "all-reduce", 10**9, [(0, "host", 10**9)])
    assert off_ring == pytest.approx(alone, rel=1e-12)  # PCIe to the host shares no ring link


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [[0], [0, 0, 1], [0, 8]])
def test_bad_groups_are_refused(bad):
    with pytest.raises(MpsimError):
        collective_time(load_topology("dgx1-v100"), "all-reduce", 10**6, bad)


def test_unknown_op_and_bad_size_are_refused():
    topo = nvswitch_topology(2)
    with pytest.raises(MpsimError, match="unknown collective"):
        collective_time(topo, "gather", 10)
    with pytest.raises(MpsimError, match="positive"):
        collective_time(topo, "all-reduce", 0)


def _cli(capsys, *argv):
    code = main(["topo", "collective", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_nccl_tests_columns_and_the_ring(capsys):
    code, out, _ = _cli(capsys, "--server", "dgx1-v100", "--op", "all-reduce", "--size", "1GB,4GB")
    assert code == 0
    assert "ring 0 > 3 > 2 > 1 > 5 > 6 > 7 > 4 > 0" in out
    assert "algbw GB/s" in out and "busbw GB/s" in out
    code, out, _ = _cli(capsys, "-s", "a100-40gb-nvswitch", "--op", "all-gather", "--size", "1GB",
                        "--gpus", "0,2,4,6", "--json", "-")
    d = json.loads(out)
    assert code == 0 and d["gpus"] == [0, 2, 4, 6] and d["ring"] == [0, 2, 4, 6]
    row = d["sizes"][0]
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 3 / 4)
    code, out, _ = _cli(capsys, "--op", "broadcast", "--size", "1MB", "--gpus", "4-7", "--json", "-")
    assert code == 0 and json.loads(out)["ring"][0] == 4


@pytest.mark.parametrize("argv, says", [
    (["--op", "gather", "--size", "1GB"], "--op 'gather'"),
    (["--op", "all-reduce", "--size", "1GB", "--gpus", "0-8"], "--gpus: GPU 8"),
    (["--op", "all-reduce", "--size", "1GB", "--gpus", "3"], "at least 2 GPUs"),
    (["--op", "all-reduce", "--size", "1GB", "--gpus", "0,1,1"], "distinct"),
    (["--op", "all-reduce", "--size", "1GB", "--gpus", "a,b"], "--gpus 'a,b'"),
    (["--op", "all-reduce", "--size", "1GB", "--gpus", "5-2"], "backwards"),
    (["--op", "all-reduce", "--size", "0MB"], "--size"),
    (["--op", "all-reduce", "--size", "1XB"], "--size"),
    (["--op", "all-reduce", "--size", "1GB,"], "--size"),
])
def test_cli_refuses_bad_input_in_one_line(capsys, argv, says):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err


# -- the double binary tree (all-reduce) -----------------------------------------------------

def test_tree_all_reduce_on_two_gpus_is_the_ring():
    """Two GPUs: each tree's one edge carries half the buffer each way, so each direction of
    the link carries the whole buffer, as the ring's two steps do: S/B + 2L either way."""
    topo = fully_connected(2, gbps=2.0, latency_us=3.0)
    size = 12 * 10**6
    tree = collective_time(topo, "all-reduce", size, algorithm="tree").time_s
    assert tree == pytest.approx(size / (2 * GBPS) + 2 * 3e-6, rel=1e-12)
    assert tree == pytest.approx(collective_time(topo, "all-reduce", size).time_s, rel=1e-12)


def test_inside_a_switch_the_ring_beats_the_tree():
    """Every tree edge carries half the buffer each way and an inner GPU feeds three edges
    of its tree at once, where a ring hop carries 2(n-1)/n of it: NCCL's reason for rings
    inside a server."""
    topo = nvswitch_topology(8, gbps=1.0)
    ring, tree = (collective_time(topo, "all-reduce", 10**8, algorithm=a).busbw for a in ("ring", "tree"))
    assert tree < ring
    assert tree_depth(8) == 3 and tree_edges([5, 6, 7]) == [(6, 5), (7, 5)]


@pytest.mark.parametrize("op", ["reduce-scatter", "all-gather", "broadcast"])
def test_the_tree_runs_all_reduce_only(op):
    with pytest.raises(MpsimError, match=f"the tree algorithm runs all-reduce only .*, not {op}"):
        collective_time(fully_connected(4), op, 10**6, algorithm="tree")
