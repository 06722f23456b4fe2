"""Clusters: files checked in one line, the view's routes, two-level collectives against
their closed form and against the same algorithm run on every server explicitly, HSDP,
Megatron-order placement, and cluster jobs in the engine."""

from __future__ import annotations

import math

import pytest
import simpy
from helpers import layer, tiny_trace, topology_dict

from mpsim.data.catalog import cluster_from_data, load_cluster, load_trace, shipped_clusters
from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster, ClusterFile
from mpsim.hardware.topology import parse_topology
from mpsim.plans.cluster_placement import place_on_cluster
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.plans.mesh import DeviceMesh
from mpsim.sim import Job, simulate_job
from mpsim.sim.collectives import inter_server_steps, max_hop_bytes, two_level_transfer
from mpsim.sim.network import Network

GBPS = 1e9


def switch_server(n: int = 4, nvswitch_gbps: float = 8.0, pcie_gbps: float = 100.0, latency_us: float = 0.0):
    d = topology_dict(n_gpus=n, pcie_gbps=pcie_gbps, latency_us=latency_us)
    del d["nvlink"]
    d["nvswitch"] = {"gpu_bandwidth_gbps": nvswitch_gbps, "links_per_gpu": 1, "latency_us": latency_us}
    return parse_topology(d, "switch.yaml")


def cluster_dict(**fabric: object) -> dict:
    base = {"kind": "rail-optimized", "nics_per_server": 4, "nic_gbit": 8.0, "efficiency": 1.0, "latency_us": 0.0,
            "source": "hand-built"}
    base.update(fabric)
    return {"schema": 1, "name": "toy-cluster", "server": "unused", "max_servers": 64, "fabric": base}


def toy_cluster(n: int = 4, **fabric: object) -> Cluster:
    """``n``-GPU NVSwitch servers (8 GB/s per GPU), one 1 GB/s NIC per GPU by default."""
    spec = ClusterFile.model_validate(cluster_dict(**fabric))
    return Cluster(spec, switch_server(n), "toy.yaml")


# -- files ---------------------------------------------------------------------------------------

def test_shipped_clusters_load_with_their_sources():
    names = set(shipped_clusters())
    assert {"aws-p3dn", "aws-p4d", "aws-p4de", "aws-p5", "dgx-a100-superpod", "dgx-h100-superpod"} <= names
    for name in names:
        cluster = load_cluster(name)
        assert cluster.spec.fabric.source.strip()
        assert cluster.price is not None  # from the cluster or its server: choose prices every one


def test_nic_shares_follow_the_datasheets():
    """p4d: 4 x 100 Gb/s for 8 GPUs at 80% = 5 GB/s a GPU; p5: 4 x 100 Gb/s a GPU = 40 GB/s;
    DGX H100: one 400 Gb/s NIC a GPU at 90% = 45 GB/s."""
    assert load_cluster("aws-p4d").nic_bytes_per_s(0) == pytest.approx(5e9)
    assert load_cluster("aws-p5").nic_bytes_per_s(7) == pytest.approx(40e9)
    assert load_cluster("dgx-h100-superpod").cross_bytes_per_s(3) == pytest.approx(45e9)


@pytest.mark.parametrize("change, message", [
    ({"fabric": {"kind": "rail-optimized", "oversubscription": 2}}, "oversubscription is a fat tree's"),
    ({"fabric": {"nic_groups": [{"gpus": [0, 1], "nics": 2}, {"gpus": [2], "nics": 2}]}}, "missing [3]"),
    ({"fabric": {"nic_groups": [{"gpus": [0, 1], "nics": 1}, {"gpus": [2, 3], "nics": 1}]}}, "have 2 NICs"),
    ({"fabric": {"nic_groups": [{"gpus": [0, 1], "nics": 2}, {"gpus": [1, 2, 3], "nics": 2}]}}, "already in"),
    ({"fabric": {"nics_per_server": 3}}, "do not spread evenly"),
    ({"fabric": {"nic_gbit": -1}}, "nic_gbit"),
    ({"schema": 2}, "expected 1"),
    ({"max_servers": 0}, "max_servers"),
    ({"server": "no-such-server"}, "unknown server"),
])
def test_bad_cluster_files_are_refused_in_one_line(change, message, tmp_path):
    data = cluster_dict()
    data["server"] = "dgx-h100"
    for key, value in change.items():
        if key == "fabric":
            data["fabric"] = {**data["fabric"], **value}
        else:
            data[key] = value
    if "nic_groups" in data["fabric"] or data["fabric"]["nics_per_server"] == 3:
        data["server"] = "titanrtx-x4-pcie"
    with pytest.raises(MpsimError) as err:
        cluster_from_data(data, "bad.yaml", tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- the view ------------------------------------------------------------------------------------

def test_view_routes_cross_servers_through_pcie_and_nics():
    view = toy_cluster().view(2)
    route = view.route(1, 6)  # GPU 1 of server 0 to GPU 2 of server 1
    assert [link.name for link in route.links] == ["s0/pcie:gpu1->sw0", "s0/nic1:tx", "s1/nic2:rx", "s1/pcie:sw0->gpu2"]
    assert route.bandwidth == pytest.approx(1e9)
    assert view.route(4, 5).links[0].name == "s1/nvswitch:gpu0->fabric"  # inside server 1: its own copy
    assert [link.name for link in view.mirror_route(5).links] == [
        "s1/pcie:gpu1->sw0", "s1/nic1:tx", "s1/nic1:rx", "s1/pcie:sw0->gpu1"]
    assert view.connection(0, 4) == "NET" and view.nvlinks_between(0, 4) == 0


def test_oversubscribed_fat_tree_shares_a_spine_link_per_server():
    view = toy_cluster(kind="fat-tree", oversubscription=4.0).view(2)
    names = [link.name for link in view.route(0, 4).links]
    assert "s0/spine:tx" in names and "s1/spine:rx" in names
    assert view.links["s0/spine:tx"].bandwidth == pytest.approx(4 * 1e9 / 4)


# -- two-level collectives ---------------------------------------------------------------------

def _run(make) -> float:
    env = simpy.Environment()
    net = Network(env)
    env.process(_wait(make(net)))
    env.run()
    return float(env.now)


def _wait(event):
    yield event


@pytest.mark.parametrize("op", ["all-reduce", "reduce-scatter", "all-gather"])
@pytest.mark.parametrize("across", [2, 4, 16])
def test_two_level_collective_takes_its_closed_form(op, across):
    """n GPUs a server on NVSwitch (B = 8 GB/s), one NIC of b = 1 GB/s each, S bytes:
    T = latency + max(f_n S / B, f_N (S / n) / b), f_k = 2(k-1)/k for all-reduce, (k-1)/k
    otherwise; both levels' flows run at once (NCCL pipelines them)."""
    n, size = 4, 64 * 10**6
    cluster = toy_cluster(n, latency_us=10.0)
    view = cluster.view(1)
    ring = tuple(range(n))
    f = (lambda k: 2 * (k - 1) / k) if op == "all-reduce" else (lambda k: (k - 1) / k)
    expected = inter_server_steps(op, across) * 10e-6 + max(f(n) * size / (8 * GBPS), f(across) * size / n / GBPS)
    got = _run(lambda net: two_level_transfer(net, view, ring, op, across, op, size))
    assert got == pytest.approx(expected, rel=1e-6)


def test_inter_server_latency_is_the_tree_s_for_many_servers():
    assert inter_server_steps("all-reduce", 2) == 2
    assert inter_server_steps("all-reduce", 1024) == 2 * 10  # a double binary tree, not 2 x 1023 ring steps
    assert inter_server_steps("reduce-scatter", 16) == 15


def test_hsdp_gradients_reduce_scatter_inside_and_all_reduce_across():
    """HSDP: S bytes reduce-scattered over n GPUs inside ((n-1)/n S at B), their shards
    all-reduced across N servers (2(N-1)/N S/n at b); parameters gathered inside only."""
    n, size, across = 4, 80 * 10**6, 8
    view = toy_cluster(n).view(1)
    ring = tuple(range(n))
    grads = _run(lambda net: two_level_transfer(net, view, ring, "reduce-scatter", across, "all-reduce", size))
    assert grads == pytest.approx(max(3 / 4 * size / (8 * GBPS), 2 * 7 / 8 * size / 4 / GBPS), rel=1e-6)
    params = _run(lambda net: two_level_transfer(net, view, ring, "all-gather", across, None, size))
    assert params == pytest.approx(3 / 4 * size / (8 * GBPS), rel=1e-6)


def _explicit(net, view, n: int, across: int, op: str, size: int):
    """The same two-level algorithm with every server simulated: on each server a ring
    inside, and per rail l a ring over the servers through the real cross-server routes."""
    routes, sizes = [], []
    for s in range(across):
        ring = [s * n + g for g in range(n)]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            routes.append(view.route(a, b))
            sizes.append(max_hop_bytes(op, size, n))
    for g in range(n):
        rail = [s * n + g for s in range(across)]
        for a, b in zip(rail, rail[1:] + rail[:1]):
            routes.append(view.route(a, b))
            sizes.append(max_hop_bytes(op, -(-size // n), across))
    return net.transfer_all(routes, sizes, 0.0)


@pytest.mark.parametrize("fabric", [{}, {"kind": "fat-tree", "oversubscription": 2.0},
                                    {"nic_groups": [{"gpus": [0, 1], "nics": 2}, {"gpus": [2, 3], "nics": 2}]}])
@pytest.mark.parametrize("op", ["all-reduce", "reduce-scatter"])
def test_symmetric_servers_simulated_once_give_what_all_of_them_give(fabric, op):
    """One server with mirror routes (what the engine runs) against four servers simulated
    explicitly: the same time, whatever the NIC sharing or the spine."""
    n, across, size = 4, 4, 48 * 10**6
    cluster = toy_cluster(n, **fabric)
    once = _run(lambda net: two_level_transfer(net, cluster.view(1), tuple(range(n)), op, across, op, size))
    every = _run(lambda net: _explicit(net, cluster.view(across), n, across, op, size))
    assert once == pytest.approx(every, rel=1e-9)


# -- placement -----------------------------------------------------------------------------------

def _mesh(data: int, tensor: int, stages: int) -> DeviceMesh:
    return DeviceMesh((("tensor", tensor), ("data", data), ("pipeline", stages)))


def test_megatron_order_puts_tensor_groups_in_a_server_and_stages_across():
    placed = place_on_cluster(8, _mesh(data=4, tensor=4, stages=2))  # 2 replicas of a stage per server
    assert (placed.servers, placed.local, placed.across) == (2, 2, 2)
    assert placed.groups[0] == ((0, 1, 2, 3), (8, 9, 10, 11))
    assert placed.groups[1] == ((4, 5, 6, 7), (12, 13, 14, 15))
    small = place_on_cluster(8, _mesh(data=2, tensor=2, stages=4))  # two stages a server
    assert (small.servers, small.local, small.across) == (2, 2, 1)
    assert small.replicas == ((0, 4, 8, 12), (2, 6, 10, 14))


@pytest.mark.parametrize("args, message", [
    ((8, 2, 3, 4), "does not divide"),
    ((8, 3, 2, 4), "neither fill"),
    ((8, 1, 2, 3), "do not fill whole"),
])
def test_placements_that_do_not_fill_servers_are_refused(args, message):
    with pytest.raises(MpsimError, match=message):
        place_on_cluster(args[0], _mesh(*args[1:]))


# -- jobs ------------------------------------------------------------------------------------------

def _toy_job(servers: int, par: Parallelism, cluster: Cluster | None = None, m: int = 4) -> JobSpec:
    cluster = cluster or toy_cluster(4)
    trace = tiny_trace([layer(f"l{i}", params=10**6) for i in range(4)])
    return JobSpec(cluster.server, trace, "1f1b", m, par, cluster=cluster, servers=servers)


def test_one_server_of_a_cluster_is_that_server():
    """A cluster job on one server runs what the server alone runs (no NIC crossed)."""
    cluster = toy_cluster(4)
    par = Parallelism(data=4, zero_stage=3, pipeline=1)
    alone = simulate_job(Job(JobSpec(cluster.server, _toy_job(1, par, cluster).trace, "1f1b", 4, par)))
    joined = simulate_job(Job(_toy_job(1, par, cluster)))
    assert joined.iteration_s == alone.iteration_s
    assert [g.peak_bytes for g in joined.gpus] == [g.peak_bytes for g in alone.gpus]


def test_fsdp_across_servers_shards_over_all_gpus_and_hsdp_over_a_server():
    """ZeRO-3 model states: 16P/N over all N GPUs; HSDP shards over a server's GPUs only
    (Rajbhandari et al. 2020, section 5; FSDP2's HSDP). The toy layers keep 12 bytes of
    optimizer state a parameter, 10^6 parameters each."""
    fsdp = simulate_job(Job(_toy_job(4, Parallelism(data=16, zero_stage=3, pipeline=1))))
    hsdp = simulate_job(Job(_toy_job(4, Parallelism(data=16, zero_stage=3, hsdp=True, pipeline=1))))
    for result, ways in ((fsdp, 16), (hsdp, 4)):
        assert result.gpus[0].breakdown["optimizer"] == 4 * math.ceil(12 * 10**6 / ways)
    assert fsdp.layout == "FSDP x16" and hsdp.layout == "HSDP x16"


def test_pipeline_across_servers_sends_over_the_nics():
    """Eight stages on two 4-GPU servers: stage 3 (GPU 3 of server 0) sends each
    microbatch's activation to stage 4 (GPU 0 of server 1) through NIC 3, and stage 4 sends
    the gradient back through its NIC 0; no other stage crosses a NIC."""
    cluster = toy_cluster(4)
    trace = tiny_trace([layer(f"l{i}", out=10**6, inp=10**6) for i in range(8)])
    job = JobSpec(cluster.server, trace, "1f1b", 8, Parallelism(pipeline=8), cluster=cluster, servers=2)
    links = simulate_job(Job(job)).links
    assert links["s0/nic3:tx"]["bytes"] == 8 * 10**6
    assert links["s1/nic0:tx"]["bytes"] == 8 * 10**6
    assert {name for name, link in links.items() if "nic" in name and link["bytes"]} == {
        "s0/nic3:tx", "s1/nic0:rx", "s1/nic0:tx", "s0/nic3:rx"}


@pytest.mark.parametrize("servers, par, message", [
    (2, Parallelism(data=4, pipeline=1), "fills its servers"),
    (2, Parallelism(data=8, zero_stage=3, hsdp=True, pipeline=1), None),
    (1, Parallelism(data=4, zero_stage=3, hsdp=True, pipeline=1), "stays inside one server"),
    (65, Parallelism(data=260, pipeline=1), "1 to 64 servers"),
])
def test_cluster_jobs_are_checked_in_one_line(servers, par, message):
    if message is None:
        _toy_job(servers, par)
        return
    with pytest.raises(MpsimError) as err:
        _toy_job(servers, par)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_hsdp_needs_a_cluster_and_zero_3():
    trace = tiny_trace([layer("l")])
    with pytest.raises(MpsimError, match="give a cluster"):
        JobSpec(switch_server(4), trace, "1f1b", 4, Parallelism(data=4, zero_stage=3, hsdp=True, pipeline=1))
    with pytest.raises(MpsimError, match="zero stage 3"):
        JobSpec(switch_server(4), trace, "1f1b", 4, Parallelism(data=4, hsdp=True, pipeline=1))


# -- the command line ------------------------------------------------------------------------------

def _cli(capsys, *argv: str) -> tuple[int, str]:
    from mpsim.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def test_topo_show_draws_a_cluster_and_topo_list_names_the_shipped_ones(capsys):
    code, shown = _cli(capsys, "topo", "show", "aws-p4d")
    assert code == 0, shown
    assert "GPU1       nic0     1             2                     5.0" in shown
    _, listed = _cli(capsys, "topo", "list")
    assert "dgx-h100-superpod" in listed and "clusters (--cluster):" in listed


def test_simulate_on_a_cluster_names_the_servers_and_refuses_a_plan_file(capsys, tmp_path):
    args = ["simulate", "--cluster", "dgx-h100-superpod", "--servers", "2", "--model", "llama-3-8b",
            "--microbatches", "2", "--dp", "16", "--zero", "3", "--hsdp"]
    code, out = _cli(capsys, *args)
    assert code == 0, out
    assert "2 x dgx-h100 (dgx-h100-superpod): HSDP x16" in out
    plan = tmp_path / "p.json"
    plan.write_text("{}")
    code, refused = _cli(capsys, "simulate", "--cluster", "dgx-h100-superpod", "--plan", str(plan))
    assert code == 2 and "plan files describe one server" in refused


def test_text_of_a_deep_pipeline_across_servers_shows_each_stages_own_gpu():
    from mpsim.views.text import simulate_text

    cluster = toy_cluster(8)
    trace = tiny_trace([layer(f"l{i}", params=10**5) for i in range(16)])
    job = JobSpec(cluster.server, trace, "1f1b", 16, Parallelism(data=2, pipeline=16), cluster=cluster, servers=4)
    result = simulate_job(Job(job))
    text = simulate_text(result)
    assert len(result.gpus) == 32
    rows = [line for line in text.split("(breakdown")[0].splitlines() if line[:1].isdigit()]
    assert [int(line.split()[0]) for line in rows] == list(result.gpu_of_stage)
    assert "the other 16 GPUs of the simulated servers replicate them" in text


def test_a_cluster_of_nvl72_racks_is_a_cluster_of_72_gpu_scale_up_domains():
    """A GB200 NVL72 rack is one server of the cluster (its 72 GPUs one NVLink domain,
    schema 2), with one 400 Gb/s NIC per GPU; a job's tensor groups stay in a rack and its
    replicas span racks."""
    cluster = load_cluster("gb200-nvl72-pod")
    assert cluster.gpus_per_server == 72 and cluster.spec.fabric.nics_per_server == 72
    assert cluster.nic_bytes_per_s(71) == pytest.approx(400e9 / 8 * 0.9)
    trace = load_trace("llama-3-8b").rescale(1)
    job = JobSpec(cluster.server, trace, "1f1b", 2, Parallelism(data=18, zero_stage=1, tensor=8, pipeline=1),
                  cluster=cluster, servers=2)
    r = simulate_job(Job(job))
    assert r.fits and r.replicas == 18 and (r.gpus_used, r.gpus_available) == (144, 144)
    nic = [name for name in r.links if "/nic" in name]  # the replicas' gradients cross racks through NICs
    assert nic and all(r.links[name]["bytes"] > 0 for name in nic)
