"""Routes and bandwidths derived from shipped and hand-built topology files."""

import pytest

from mpsim.data.catalog import load_topology, shipped_topologies
from mpsim.hardware.topology import HOST

# nvidia-smi topo -m of a DGX-1 (shared/reference/hardware.md), NV pairs only.
DGX1_TOPO_M = """\
X NV1 NV1 NV2 NV2 SYS SYS SYS
NV1 X NV2 NV1 SYS NV2 SYS SYS
NV1 NV2 X NV2 SYS SYS NV1 SYS
NV2 NV1 NV2 X SYS SYS SYS NV1
NV2 SYS SYS SYS X NV1 NV1 NV2
SYS NV2 SYS SYS NV1 X NV2 NV1
SYS SYS NV1 SYS NV1 NV2 X NV2
SYS SYS SYS NV1 NV2 NV1 NV2 X"""


def test_every_shipped_topology_loads():
    names = set(shipped_topologies())
    assert {"dgx1-v100", "a100-40gb-nvswitch", "dgx2-v100", "dgx-a100-80gb", "dgx-h100", "titanrtx-x4-pcie",
            "titanrtx-x1", "gtx1080ti-x1", "h100-x1", "h200-x1"} <= names
    for name in names:
        t = load_topology(name)
        assert 0 < t.capacity_bytes < t.memory_bytes


def test_dgx1_connection_matrix_matches_nvidia_smi():
    t = load_topology("dgx1-v100")
    got = "\n".join(" ".join(row) for row in t.to_dict()["connection"])
    assert got == DGX1_TOPO_M


def test_dgx1_every_gpu_uses_six_links_and_gpu0_to_gpu3_is_twice_gpu1():
    t = load_topology("dgx1-v100")
    for g in range(8):
        assert sum(t.nvlinks_between(g, o) for o in range(8) if o != g) == 6
    assert t.route(0, 3).bandwidth == 2 * t.route(0, 1).bandwidth == pytest.approx(45e9)


def test_nvlink_peers_are_the_gpus_with_a_link():
    """DGX-1 hybrid cube-mesh: GPU 0 reaches 1-4 over NVLink and 5-7 only over PCIe; on an
    NVSwitch server every other GPU is a peer."""
    dgx1 = load_topology("dgx1-v100")
    assert dgx1.nvlink_peers(0) == (1, 2, 3, 4)
    for g in range(8):
        assert dgx1.nvlink_peers(g) == tuple(o for o in range(8) if o != g and dgx1.nvlinks_between(g, o))
    assert load_topology("a100-40gb-nvswitch").nvlink_peers(5) == (0, 1, 2, 3, 4, 6, 7)


def test_gpus_behind_one_switch_share_its_uplink_to_host():
    t = load_topology("dgx1-v100")
    up0 = t.route(0, HOST).links[-1]
    up1 = t.route(1, HOST).links[-1]
    up2 = t.route(2, HOST).links[-1]
    assert up0 is up1 and up0.name == "pcie:plx0->cpu0"
    assert up2 is not up0
    assert t.route(0, HOST).bandwidth == pytest.approx(11.6e9)


def test_gpu_pair_without_nvlink_goes_over_pcie_and_qpi():
    t = load_topology("dgx1-v100")
    names = [link.name for link in t.route(0, 5).links]
    assert names == ["pcie:gpu0->plx0", "pcie:plx0->cpu0", "qpi:cpu0->cpu1", "pcie:cpu1->plx2", "pcie:plx2->gpu5"]


def test_nvswitch_server_is_symmetric():
    t = load_topology("a100-40gb-nvswitch")
    bws = {t.route(a, b).bandwidth for a in range(8) for b in range(8) if a != b}
    assert bws == {270e9}
    assert t.connection(0, 7) == "NV12"


def test_route_time_alone_is_latency_plus_size_over_bandwidth():
    t = load_topology("dgx1-v100")
    r = t.route(0, HOST)
    assert r.time_alone_s(216 * 10**6) == pytest.approx(10e-6 + 216e6 / 11.6e9)
