"""Topology schema 2 (tiers): the shipped GB200 NVL72 and MI300X files, routes derived from
the tiers, schema-1 files unchanged through their schema-2 form, bad input in one line."""

import copy
from pathlib import Path

import pytest
import yaml

from mpsim.cli import main
from mpsim.data.catalog import load_topology, shipped_topologies
from mpsim.errors import SchemaError
from mpsim.hardware.schema2 import ServerFile, schema2_of
from mpsim.hardware.topology import (
    HOST,
    Topology,
    TopologyFile,
    parse_topology,
    read_topology_file,
    with_faster_peer_links,
)

ROOT = Path(__file__).resolve().parent.parent
NEW = ("gb200-nvl72", "mi300x-x8")


def _dict(name: str) -> dict:
    return yaml.safe_load((ROOT / "topologies" / f"{name}.yaml").read_text())


def _endpoints(n: int) -> list[tuple]:
    gpus = range(n)
    return [(a, b) for a in gpus for b in gpus if a != b] + [(g, HOST) for g in gpus] + [(HOST, g) for g in gpus]


# -- the shipped tiered files --------------------------------------------------------------

@pytest.mark.parametrize("name", NEW)
def test_new_servers_load_and_pass_topo_check(name, capsys):
    t = read_topology_file(ROOT / "topologies" / f"{name}.yaml")
    assert isinstance(t.spec, ServerFile) and t.name == name
    assert 0 < t.capacity_bytes < t.memory_bytes
    assert main(["topo", "check", str(ROOT / "topologies" / f"{name}.yaml")]) == 0
    assert f"ok ({name}, {t.n_gpus} x {t.spec.gpu.model}" in capsys.readouterr().out
    assert main(["topo", "show", name]) == 0
    assert name in shipped_topologies()


def test_nvl72_gpu_pairs_cross_the_nvlink_switch_and_reach_the_host_over_c2c():
    t = load_topology("gb200-nvl72")
    assert isinstance(t.spec, ServerFile)
    assert (t.n_gpus, t.spec.host.sockets, t.spec.gpu.vendor) == (72, 36, "nvidia")
    for a, b in ((0, 1), (0, 71), (37, 2)):  # same superchip, far ends of the rack, either way
        r = t.route(a, b)
        assert [x.name for x in r.links] == [f"nvlink5:gpu{a}->fabric", f"nvlink5:fabric->gpu{b}"]
        assert r.bandwidth == 810e9 and r.latency_s == 10 * 1e-6
        assert t.connection(a, b) == "NV18"
    up, down = t.route(5, HOST), t.route(HOST, 5)
    assert [x.name for x in up.links] == ["c2c:gpu5->cpu2"] and up.bandwidth == 405e9
    assert [x.name for x in down.links] == ["c2c:cpu2->gpu5"] and down.bandwidth == 405e9
    assert t.socket_of(5) == 2 and t.socket_of(71) == 35
    assert t.nvlink_peers(0) == tuple(range(1, 72))
    assert len(t.links) == 2 * 72 + 2 * 72  # switch in and out, C2C up and down; no CPU link
    assert t.spec.host.adam_params_per_s == 18432e9 * 0.6 / 28


def test_mi300x_is_an_xgmi_full_mesh_with_pcie_to_two_sockets():
    t = load_topology("mi300x-x8")
    assert isinstance(t.spec, ServerFile) and t.spec.gpu.vendor == "amd"
    for a, b in _endpoints(8)[:56]:
        r = t.route(a, b)
        assert [x.name for x in r.links] == [f"xgmi:{a}->{b}"]
        assert r.bandwidth == 57.6 * 1e9 and r.latency_s == 10 * 1e-6
        assert t.connection(a, b) == "XGMI1" and t.nvlinks_between(a, b) == 1
    assert [x.name for x in t.route(5, HOST).links] == ["pcie:gpu5->pex2", "pcie:pex2->cpu1"]
    assert [x.name for x in t.route(HOST, 0).links] == ["pcie:cpu0->pex0", "pcie:pex0->gpu0"]
    assert t.route(5, HOST).bandwidth == 46.6 * 1e9
    assert [t.socket_of(g) for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.nvlink_peers(3) == (0, 1, 2, 4, 5, 6, 7)


def test_faster_scale_up_what_if_scales_a_tiered_fabric():
    t = load_topology("mi300x-x8")
    fast = Topology(with_faster_peer_links(t.spec, 2.0), "x")
    assert fast.route(0, 1).bandwidth == 57.6 * 2.0 * 1e9
    assert fast.route(0, HOST).bandwidth == t.route(0, HOST).bandwidth
    assert t.spec.nvlink is None  # schema 1's block, which code reading either schema may ask for


# -- schema 1 through schema 2 -------------------------------------------------------------

SCHEMA1 = [n for n in shipped_topologies() if isinstance(load_topology(n).spec, TopologyFile)]


@pytest.mark.parametrize("name", SCHEMA1)
def test_a_schema1_file_and_its_schema2_form_have_the_same_routes(name):
    old = load_topology(name)
    assert isinstance(old.spec, TopologyFile)
    new = parse_topology(schema2_of(old.spec), f"{name} as schema 2")
    assert isinstance(new.spec, ServerFile)
    assert set(new.links) == set(old.links)
    for src, dst in _endpoints(old.n_gpus):
        a, b = old.route(src, dst), new.route(src, dst)
        assert [(x.name, x.bandwidth, x.latency_s) for x in a.links] == \
            [(x.name, x.bandwidth, x.latency_s) for x in b.links], (src, dst)
    n = old.n_gpus
    assert [[new.connection(a, b) for b in range(n)] for a in range(n)] == \
        [[old.connection(a, b) for b in range(n)] for a in range(n)]
    assert [new.socket_of(g) for g in range(n)] == [old.socket_of(g) for g in range(n)]
    assert [new.nvlink_peers(g) for g in range(n)] == [old.nvlink_peers(g) for g in range(n)]
    assert new.spec.host.adam_params_per_s == old.spec.host.adam_params_per_s


def test_schema1_dgx1_keeps_its_link_names_and_order():
    """Built through the tiers, a schema-1 file's links keep their names and order."""
    t = load_topology("dgx1-v100")
    names = list(t.links)
    assert names[:4] == ["nvlink:0->1", "nvlink:1->0", "nvlink:0->2", "nvlink:2->0"]
    assert names[32:38] == ["pcie:gpu0->plx0", "pcie:plx0->gpu0", "pcie:gpu1->plx0", "pcie:plx0->gpu1",
                            "pcie:plx0->cpu0", "pcie:cpu0->plx0"]
    assert names[-2:] == ["qpi:cpu0->cpu1", "qpi:cpu1->cpu0"]
    assert [x.name for x in t.route(0, 5).links] == [
        "pcie:gpu0->plx0", "pcie:plx0->cpu0", "qpi:cpu0->cpu1", "pcie:cpu1->plx2", "pcie:plx2->gpu5"]


# -- hand-built tiers ----------------------------------------------------------------------

def _small(**host_extra) -> dict:
    """4 GPUs, one NVLink bundle 0-1 of 2 links, two CPUs with two GPUs each on their own
    PCIe links (no switch), a UPI link between the CPUs."""
    return {
        "schema": 2, "name": "small",
        "gpu": {"vendor": "nvidia", "model": "toy", "count": 4, "memory_mib": 1024, "reserved_mib": 0,
                "peak_tflops": {"fp16": 1.0}, "memory_bandwidth_gbps": 1.0},
        "scale_up": {"kind": "mesh", "name": "NVLink", "link_bandwidth_gbps": 20.0, "latency_us": 2,
                     "pairs": [{"gpus": [0, 1], "links": 2}]},
        "host": {"memory_gib": 64, "cpus": [{"gpus": [0, 1], "gpu_link_gbps": 10.0, "latency_us": 3},
                                            {"gpus": [2, 3], "gpu_link_gbps": 12.0, "latency_us": 4}],
                 "cpu_link": {"name": "UPI", "bandwidth_gbps": 5.0, "latency_us": 7}, **host_extra},
    }


def test_a_partial_mesh_routes_the_other_pairs_through_the_host():
    t = parse_topology(_small(), "small.yaml")
    assert [x.name for x in t.route(0, 1).links] == ["nvlink:0->1"] and t.route(0, 1).bandwidth == 40e9
    r = t.route(0, 2)
    assert [x.name for x in r.links] == ["pcie:gpu0->cpu0", "upi:cpu0->cpu1", "pcie:cpu1->gpu2"]
    assert r.bandwidth == 5e9 and r.latency_s == 7 * 1e-6
    same_cpu = t.route(2, 3)
    assert [x.name for x in same_cpu.links] == ["pcie:gpu2->cpu1", "pcie:cpu1->gpu3"]
    assert same_cpu.bandwidth == 12e9 and same_cpu.latency_s == 4 * 1e-6
    assert [x.name for x in t.route(3, HOST).links] == ["pcie:gpu3->cpu1"]
    assert [t.connection(0, b) for b in range(4)] == ["X", "NV2", "SYS", "SYS"]
    assert t.connection(2, 3) == "NODE"


def _set(d: dict, path: str, value: object) -> dict:
    d = copy.deepcopy(d)
    *head, last = path.split(".")
    node = d
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


BAD = [
    ("a GPU under two CPUs", "mi300x-x8", "host.cpus.1.gpus", [3, 4, 5, 6, 7],
     "host.cpus.1.gpus: GPU 3 is already attached to CPU 0"),
    ("a mesh link to a GPU that does not exist", "mi300x-x8", "scale_up",
     {"kind": "mesh", "name": "xGMI", "link_bandwidth_gbps": 57.6, "pairs": [{"gpus": [0, 8]}]},
     "scale_up.pairs.0.gpus: GPU index 8 out of range 0..7"),
    ("a c2c host without bandwidth", "gb200-nvl72", "host.cpus.3.gpu_link_gbps", KeyError,
     "host.cpus.3.gpu_link_gbps: required: the bandwidth of each GPU's c2c link"),
    ("a switch without bandwidth", "gb200-nvl72", "scale_up.gpu_bandwidth_gbps", KeyError,
     "scale_up.gpu_bandwidth_gbps: required for kind switch"),
    ("a switch given mesh links", "gb200-nvl72", "scale_up.links_per_pair", 1,
     "scale_up.links_per_pair: not used by kind switch"),
    ("a mesh both full and listed", "mi300x-x8", "scale_up.pairs", [{"gpus": [0, 1]}],
     "scale_up: kind mesh takes exactly one of links_per_pair or pairs"),
    ("a GPU on no CPU", "gb200-nvl72", "host.cpus.35", KeyError,
     "host.cpus: every GPU must be attached to a CPU; missing [70, 71]"),
    ("a switch's GPU of another CPU", "mi300x-x8", "host.cpus.0.switches.1.gpus", [2, 4],
     "host.cpus.0.switches.1.gpus: GPU 4 is not attached to this CPU (list it in host.cpus.0.gpus)"),
    ("c2c below a PCIe switch", "gb200-nvl72", "host.cpus.0.switches", [{"name": "s", "gpus": [0],
                                                                        "uplink_gbps": 1.0}],
     "host.cpus.0.switches: c2c GPUs attach to the CPU directly, below no PCIe switch"),
    ("a switch named twice", "mi300x-x8", "host.cpus.1.switches.0.name", "pex0",
     "host.cpus.1.switches.0.name: switch pex0 is named twice"),
    ("no CPU link where a route needs one", "mi300x-x8", "scale_up", {"kind": "none"}, None),
    ("no vendor", "mi300x-x8", "gpu.vendor", KeyError, "gpu.vendor: required field is missing"),
    ("a misspelt key", "gb200-nvl72", "scale_up.gpu_bandwidth_gb", 1.0, "scale_up.gpu_bandwidth_gb: unknown field"),
    ("too many GPUs", "gb200-nvl72", "gpu.count", 1025, "gpu.count: Input should be less than or equal to 1024"),
    ("an unknown scale-up kind", "mi300x-x8", "scale_up.kind", "torus", "scale_up.kind: Input should be"),
    ("a fabric named as host links", "gb200-nvl72", "scale_up.name", "PCIe", "scale_up.name: 'PCIe' names host links"),
]


@pytest.mark.parametrize("case,server,path,value,message", BAD, ids=[b[0] for b in BAD])
def test_bad_schema2_input_is_one_line_naming_the_field(case, server, path, value, message):
    d = _set(_dict(server), path, value)
    if message is None:  # drop the CPU link too: GPUs 0 and 4 now meet only through the CPUs
        d = _set(d, "host.cpu_link", KeyError)
        message = "host.cpu_link: required: GPUs 0 and 4 sit on CPUs 0 and 1 with no scale-up link between them"
    with pytest.raises(SchemaError) as err:
        parse_topology(d, "srv.yaml")
    text = str(err.value)
    assert "\n" not in text and text.startswith("srv.yaml: ")
    assert message in text, text


def test_an_unknown_schema_names_both():
    d = _set(_dict("mi300x-x8"), "schema", 3)
    with pytest.raises(SchemaError, match=r"^srv\.yaml: schema: expected 1, got 3 \(or 2, the tiered format"):
        parse_topology(d, "srv.yaml")


def test_a_tiered_file_simulates(capsys):
    """A small job on each new server runs and reports a finite iteration time."""
    for name, extra in (("mi300x-x8", []), ("gb200-nvl72", ["--stages", "8"])):
        code = main(["simulate", "--server", name, "--model", "gpt-5.3b", "--microbatch", "1", *extra])
        out = capsys.readouterr().out
        assert code == 0 and "FITS on every GPU" in out and "iteration" in out, out
