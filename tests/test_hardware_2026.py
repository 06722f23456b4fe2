"""The hardware people buy in 2026 (issue 48, items 1-4): servers, racks, clusters, prices and
kernel tables, each file checked as a user would check it, and the scale-up fabrics against
their closed forms."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpsim.data.catalog import load_cluster, load_topology, load_trace, shipped_clusters, shipped_topologies
from mpsim.hardware.ceilings import ceiling_for
from mpsim.hardware.gpu_tables import SHIPPED, family_of
from mpsim.hardware.schema1 import TopologyFile
from mpsim.hardware.schema2 import ServerFile
from mpsim.hardware.topology import HOST
from mpsim.sim.collectives import collective_time

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("hgx-h200-x8", "dgx-b200", "hgx-b300-x8", "gb300-nvl72", "h100-pcie-x8", "h100-nvl-x8", "l40s-x8-pcie",
           "rtx4090-x1", "rtx4090-x2", "rtx4090-x4", "rtx5090-x1", "rtx5090-x2", "rtx5090-x4", "mi325x-x8",
           "mi355x-x8")
CLUSTERS = ("dgx-h200-superpod", "dgx-b200-superpod", "gb300-nvl72-pod", "mi300x-roce", "aws-p5e",
            "azure-nd-mi300x-v5")
NO_PUBLIC_PRICE = {"mi355x-x8": "no public MI355X rate was found"}
"""New files shipped without a price, and why (their header says so too)."""
FP4 = {"dgx-b200", "hgx-b300-x8", "gb300-nvl72", "rtx5090-x1", "rtx5090-x2", "rtx5090-x4", "mi355x-x8"}
"""Servers whose GPU has FP4 tensor cores (Blackwell, MI355X); every new GPU has FP8."""


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from mpsim.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


# -- files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SERVERS)
def test_topo_check_passes_on_each_new_server(capsys, name):
    code, out = _cli(capsys, "topo", "check", str(ROOT / "topologies" / f"{name}.yaml"))
    assert code == 0, out
    assert f"{name}.yaml: ok ({name}," in out


@pytest.mark.parametrize("name", CLUSTERS)
def test_topo_check_passes_on_each_new_cluster(capsys, name):
    code, out = _cli(capsys, "topo", "check", str(ROOT / "topologies" / "clusters" / f"{name}.yaml"))
    assert code == 0, out
    assert f"{name}.yaml: ok ({name}:" in out


def test_topo_list_lists_them(capsys):
    code, listed = _cli(capsys, "topo", "list")
    assert code == 0
    servers, clusters = listed.split("clusters (--cluster):")
    for name in SERVERS:
        assert re.search(rf"^{re.escape(name)}\s", servers, re.M), name
    for name in CLUSTERS:
        assert re.search(rf"^{re.escape(name)}\s", clusters, re.M), name
    assert set(SERVERS) <= set(shipped_topologies()) and set(CLUSTERS) <= set(shipped_clusters())


@pytest.mark.parametrize("name", SERVERS)
def test_each_new_server_has_a_price_with_its_source_and_date(name):
    text = (ROOT / "topologies" / f"{name}.yaml").read_text()
    price = load_topology(name).spec.price
    if name in NO_PUBLIC_PRICE:
        assert price is None and "No price" in text
        return
    assert price is not None and price.on_demand is not None
    assert price.on_demand.usd_per_hour > 0 and price.on_demand.source.strip() and price.on_demand.date
    assert "# Sources:" in text  # every file names where its figures come from


@pytest.mark.parametrize("name", CLUSTERS)
def test_each_new_cluster_has_a_price_and_a_fabric_source(name):
    cluster = load_cluster(name)
    assert cluster.spec.fabric.source.strip()
    assert cluster.price is not None and cluster.price.on_demand is not None
    assert cluster.price.on_demand.source.strip() and cluster.price.on_demand.date


@pytest.mark.parametrize("name", SERVERS)
def test_peaks_are_dense_per_dtype_with_fp8_and_fp4_where_the_gpu_has_them(name):
    peaks = load_topology(name).spec.gpu.peak_tflops
    assert "fp8" in peaks and peaks["fp8"] >= peaks["bf16"]
    assert ("fp4" in peaks) == (name in FP4)
    if "fp4" in peaks:
        assert peaks["fp4"] >= peaks["fp8"]


def test_datasheet_figures_as_the_runtime_reports_them():
    """Memory as nvidia-smi prints it (NVIDIA) or as the datasheet gives it (AMD, as
    mi300x-x8); the dense peaks the recipes read."""
    gpu = {n: load_topology(n).spec.gpu for n in SERVERS}
    assert gpu["hgx-h200-x8"].memory_mib == 143771 and gpu["dgx-b200"].memory_mib == 183359
    assert gpu["hgx-b300-x8"].memory_mib == 275040 and gpu["gb300-nvl72"].memory_mib == 284208
    assert gpu["h100-nvl-x8"].memory_mib == 95830 and gpu["l40s-x8-pcie"].memory_mib == 46068
    assert gpu["rtx4090-x2"].memory_mib == 24564 and gpu["rtx5090-x4"].memory_mib == 32607
    assert gpu["mi325x-x8"].memory_mib == 256 * 1024 and gpu["mi355x-x8"].memory_mib == 288 * 1024
    assert gpu["dgx-b200"].peak_tflops == {"fp16": 2250.0, "bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0,
                                           "tf32": 1125.0, "fp32": 75.0}
    assert gpu["gb300-nvl72"].peak_tflops["fp4"] == 15000.0 and gpu["hgx-b300-x8"].peak_tflops["fp4"] == 13500.0
    assert gpu["mi355x-x8"].peak_tflops["fp4"] == 10066.3 and gpu["rtx4090-x1"].peak_tflops["bf16"] == 165.2


def test_schema_1_where_it_can_say_it_schema_2_where_it_cannot():
    tiered = {n for n in SERVERS if isinstance(load_topology(n).spec, ServerFile)}
    assert tiered == {"gb300-nvl72", "mi325x-x8", "mi355x-x8"}
    assert all(isinstance(load_topology(n).spec, TopologyFile) for n in set(SERVERS) - tiered)


# -- fabrics -------------------------------------------------------------------------------------

def test_pcie_only_boxes_meet_through_the_host_and_nvl_cards_in_pairs():
    """No NVLink on L40S and GeForce cards: every GPU pair crosses the CPU. H100 NVL: bridged
    pairs at 12 links, the others through the host."""
    for name in ("l40s-x8-pcie", "rtx4090-x4", "rtx5090-x2", "h100-pcie-x8"):
        t = load_topology(name)
        assert all(t.nvlinks_between(0, g) == 0 for g in range(1, t.n_gpus))
        assert t.route(0, 1).bandwidth == t.route(0, HOST).bandwidth
    nvl = load_topology("h100-nvl-x8")
    assert nvl.connection(0, 1) == "NV12" and nvl.connection(2, 3) == "NV12" and nvl.nvlinks_between(1, 2) == 0
    assert nvl.route(0, 1).bandwidth == pytest.approx(12 * 22.5e9)
    assert load_topology("rtx4090-x2").route(0, HOST).bandwidth == pytest.approx(11.7e9)  # x8/x8 split


@pytest.mark.parametrize("name", ["gb300-nvl72", "gb200-nvl72"])
def test_nvl72_all_reduce_inside_the_nvlink_domain_takes_the_ring_closed_form(name):
    """72 GPUs, each one hop into the NVLink switch at B = 810 GB/s with latency L = 10 us:
    a ring all-reduce of S bytes takes 2(n-1)(L + S/(nB))."""
    topo = load_topology(name)
    n, size = 72, 72 * 8 * 2**20
    b, lat = 810e9, 10e-6
    got = collective_time(topo, "all-reduce", size)
    assert len(got.ring) == n
    assert got.time_s == pytest.approx(2 * (n - 1) * (lat + size / (n * b)), rel=1e-9)


@pytest.mark.parametrize(("name", "link_gbps"), [("mi300x-x8", 57.6), ("mi325x-x8", 57.6), ("mi355x-x8", 69.12)])
def test_infinity_fabric_full_mesh_all_reduce_takes_the_ring_closed_form(name, link_gbps):
    """8 GPUs, one xGMI link between every pair: a ring's hops each have their own link, so
    all-reduce takes 2(n-1)(L + S/(nB)) with B the one link's effective bandwidth."""
    topo = load_topology(name)
    assert all(topo.connection(a, b) == "XGMI1" for a in range(8) for b in range(8) if a != b)
    n, size = 8, 8 * 64 * 2**20
    b, lat = link_gbps * 1e9, 10e-6
    assert collective_time(topo, "all-reduce", size).time_s == pytest.approx(
        2 * (n - 1) * (lat + size / (n * b)), rel=1e-9)


def test_gb300_racks_cross_at_800_gbps_per_gpu():
    """One ConnectX-8 per GPU at 800 Gb/s and 90%: 90 GB/s per GPU to another rack, twice
    the GB200 pod's 45."""
    assert load_cluster("gb300-nvl72-pod").cross_bytes_per_s(5) == pytest.approx(90e9)
    assert load_cluster("gb200-nvl72-pod").cross_bytes_per_s(5) == pytest.approx(45e9)
    assert load_cluster("mi300x-roce").cross_bytes_per_s(0) == pytest.approx(400 / 8 * 0.85 * 1e9)


# -- kernel tables and ceilings ------------------------------------------------------------------

KERNEL_DATA = {"hgx-h200-x8": "hopper-sxm", "dgx-b200": "blackwell", "hgx-b300-x8": "blackwell-ultra",
               "gb300-nvl72": "blackwell-ultra", "h100-pcie-x8": "hopper-pcie", "h100-nvl-x8": "hopper-sxm",
               "rtx4090-x1": "ada", "rtx5090-x1": "blackwell-geforce", "mi325x-x8": "cdna3-mi325x",
               "mi355x-x8": "cdna4"}
TRANSFERRED = {"l40s-x8-pcie": "ada-l40s"}


def test_each_new_gpu_has_a_family_table_on_by_default_where_it_rests_on_kernel_data():
    for name, family in {**KERNEL_DATA, **TRANSFERRED}.items():
        gpu = load_topology(name).spec.gpu
        assert family_of(gpu.model) == family, name
        table = SHIPPED[family]
        assert (gpu.kernel_table() is table) == (name in KERNEL_DATA), name
        assert table.basis == ("kernel data" if name in KERNEL_DATA else "transferred")


def test_the_l40s_transfers_the_rtx_4090_table_and_says_so():
    l40s, ada = SHIPPED["ada-l40s"], SHIPPED["ada"]
    assert l40s.sms == 142 and ada.sms == 128
    assert {d: r.fraction for d, r in l40s.gemm.items()} == {d: r.fraction for d, r in ada.gemm.items()}
    assert all(l40s.sources[f"gemm.{d}"].startswith("transferred from the RTX 4090") for d in l40s.gemm)
    assert not l40s.by_default


def test_the_wider_band_of_a_transferred_table():
    """A transferred table times nothing by default; the time band is then the estimate's."""
    from mpsim.timing.costs import ESTIMATE_TIME_BAND_PCT, UNCHECKED_TIME_BAND_PCT, cost_model

    trace = load_trace("gpt2-xl")
    assert cost_model(trace, load_topology("l40s-x8-pcie").spec.gpu).time_band()[0] == ESTIMATE_TIME_BAND_PCT
    assert cost_model(trace, load_topology("rtx4090-x1").spec.gpu).time_band()[0] == UNCHECKED_TIME_BAND_PCT
    assert cost_model(trace, load_topology("hgx-b300-x8").spec.gpu).time_band()[0] == UNCHECKED_TIME_BAND_PCT


@pytest.mark.parametrize(("family", "dtype", "best"), [
    ("blackwell-ultra", "bf16", 1769.0 / 2250), ("blackwell-ultra", "fp8", 3353.3 / 4500),
    ("cdna3-mi325x", "bf16", 843 / 1307.4), ("cdna3-mi325x", "fp8", 1519 / 2614.9),
    ("cdna4", "bf16", 1565.0 / 2516.6), ("blackwell-geforce", "bf16", 240.05 / 419.2)])
def test_new_ceilings_are_the_best_published_lone_gemm(family, dtype, best):
    model = {"blackwell-ultra": "B300-SXM6-288GB", "cdna3-mi325x": "MI325X-OAM-256GB", "cdna4": "MI355X-OAM-288GB",
             "blackwell-geforce": "GeForce-RTX-5090-32GB"}[family]
    c = ceiling_for(model, dtype)
    assert c.gemm == round(best, 3)
    rate = SHIPPED[family].gemm[dtype]
    assert rate.fraction <= c.gemm
