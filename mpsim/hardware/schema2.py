"""Topology schema 2: a server as vendor-neutral tiers.

A schema-1 file (``mpsim.hardware.topology.TopologyFile``) has NVIDIA-shaped slots: ``nvlink``
pairs or an ``nvswitch``, a required PCIe tree, at most 8 sockets. Schema 2 says the same
things as tiers, for any vendor and size:

- ``gpu``: the schema-1 GPU block plus its ``vendor``;
- ``scale_up``: the GPUs' own fabric, ``kind`` ``switch`` (NVSwitch-like: each GPU one
  link of ``gpu_bandwidth_gbps`` into a fabric that reaches every other GPU, any number of
  GPUs: an NVL72 rack), ``mesh`` (point-to-point bundles of ``link_bandwidth_gbps`` per
  link: every pair, ``links_per_pair``, or the ``pairs`` listed: NVLink pairs, AMD
  Infinity Fabric / xGMI) or ``none`` (GPUs talk through the host);
- ``host``: its memory, and its ``cpus``, each with the GPUs it holds and how they
  attach (``pcie``, each GPU on a link of its own or below the PCIe ``switches`` listed,
  or ``c2c``, NVLink-C2C), and the ``cpu_link`` between CPUs;
- ``nvme`` and ``price``, as in schema 1.

``ServerFile.tiers`` checks a file (``_check``, one ``SchemaError`` naming the file and
the field) and turns it into ``mpsim.hardware.tiers.Tiers``, which builds the links and
routes for both schemas. ``schema2_of`` writes a schema-1 file as schema 2 with the same
links and routes.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field

from mpsim.datafile import FileModel
from mpsim.errors import SchemaError
from mpsim.hardware.schema1 import (
    CPU_ADAM_BYTES_PER_PARAM,
    CPU_STREAM_EFFICIENCY,
    MAX_GBPS,
    MAX_GPUS,
    MAX_LATENCY_US,
    MIN_GBPS,
    GpuSpec,
    NvlinkSpec,
    NvmeSpec,
    PriceSpec,
    TopologyFile,
    gpu_list,
)
from mpsim.hardware.tiers import CpuLink, HostPort, PeerBundle, ScaleUp, Tiers
from mpsim.units import MAX_BYTES, GiB

SCHEMA_VERSION: Final = 2
MAX_CPUS: Final = 512
"""The most host CPUs a server may have: an NVL72 rack has 36 Grace CPUs, one per two GPUs."""
NAME_PATTERN: Final = r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$"
"""Names that start link names (``nvlink5:gpu0->fabric``, ``pcie:pex0->cpu1``): a letter,
then letters, digits, ``_ . -``."""
MAX_MEMORY_GIB: Final = MAX_BYTES // GiB
HOST_LINK_KINDS: Final = ("pcie", "c2c")
"""Link-name prefixes of the GPU-to-CPU links, which a scale-up or CPU link name may not take."""


class TieredGpuSpec(GpuSpec):
    """Schema 1's GPU block (memory, peaks, efficiencies with their sources) and who makes it."""

    vendor: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$",
                        description="who makes the GPU, lower case: nvidia, amd, intel, ...")


class MeshPair(FileModel):
    gpus: tuple[int, int] = Field(description="the two GPU indices this bundle joins")
    links: int = Field(default=1, gt=0, le=64, description="point-to-point links in the bundle")


class ScaleUpSpec(FileModel):
    """The GPUs' own fabric; which fields apply depends on ``kind`` (``_check_scale_up``)."""

    kind: Literal["switch", "mesh", "none"] = Field(
        description="switch: every GPU one hop into a fabric that reaches every other GPU (NVSwitch); mesh: "
                    "point-to-point links between GPU pairs (NVLink pairs, xGMI); none: GPUs talk through the host")
    name: str | None = Field(
        default=None, pattern=NAME_PATTERN,
        description="the fabric's name (NVLink5, NVSwitch, xGMI); lower-cased, it starts its links' names")
    label: str = Field(
        default="NV", pattern=r"^[A-Z]{1,8}$",
        description="a connected GPU pair in `mpsim topo show`'s matrix, before the link count: NV (nvidia-smi "
                    "topo -m), XGMI (AMD)")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, default=10.0,
                              description="per-transfer setup latency, microseconds")
    gpu_bandwidth_gbps: float | None = Field(
        default=None, ge=MIN_GBPS, le=MAX_GBPS,
        description="switch: effective bandwidth of each GPU into the fabric per direction, GB/s")
    links_per_gpu: int | None = Field(
        default=None, gt=0, le=64, description="switch: links from each GPU to the fabric (shown as NV<n>)")
    link_bandwidth_gbps: float | None = Field(
        default=None, ge=MIN_GBPS, le=MAX_GBPS, description="mesh: effective bandwidth of one link per direction, GB/s")
    links_per_pair: int | None = Field(
        default=None, gt=0, le=64, description="mesh: a full mesh, this many links between every two GPUs")
    pairs: list[MeshPair] | None = Field(
        default=None, min_length=1, description="mesh: the GPU pairs joined and their links (a partial mesh)")


class PcieSwitchSpec(FileModel):
    name: str = Field(pattern=NAME_PATTERN, description="the switch's name, unique in the server")
    gpus: list[int] = Field(min_length=1, max_length=MAX_GPUS, description="GPU indices below this switch")
    uplink_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective switch-to-CPU bandwidth per direction, GB/s")


class CpuSpec(FileModel):
    """One host CPU (socket) and the GPUs whose host it is (their host buffers live in its
    memory, NUMA-local)."""

    gpus: list[int] = Field(default_factory=list, max_length=MAX_GPUS,
                            description="indices of the GPUs attached to this CPU")
    attach: Literal["pcie", "c2c"] = Field(
        default="pcie", description="how they attach: pcie (each on its own link, or below a switch), c2c "
                                    "(NVLink-C2C, each on its own link)")
    gpu_link_gbps: float | None = Field(
        default=None, ge=MIN_GBPS, le=MAX_GBPS,
        description="effective bandwidth of each GPU's own link (to its switch, or to the CPU) per direction, GB/s; "
                    "required when the CPU has GPUs")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, default=10.0,
                              description="per-transfer setup latency of these links, microseconds")
    switches: list[PcieSwitchSpec] = Field(
        default_factory=list, description="pcie only: PCIe switches, each sharing one uplink among its GPUs; a GPU "
                                          "of this CPU below none links straight to the CPU")


class CpuLinkSpec(FileModel):
    name: str = Field(pattern=NAME_PATTERN, description="UPI, QPI, xGMI, ...; lower-cased, it starts its links' names")
    bandwidth_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective bandwidth between two CPUs per direction, GB/s")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, default=10.0,
                              description="per-transfer setup latency, microseconds")


class HostTierSpec(FileModel):
    """The host side: memory of all CPUs together, the CPUs, and the link between them."""

    memory_gib: float = Field(gt=0, le=MAX_MEMORY_GIB, description="host DRAM of all CPUs together, GiB")
    memory_bandwidth_gbps: float | None = Field(
        default=None, ge=MIN_GBPS, le=MAX_GBPS,
        description="peak DRAM bandwidth of all CPUs together, GB/s (channels x transfer rate x 8 bytes)")
    cpu_adam_gparams_per_s: float = Field(
        ge=1e-6, le=1e6, default=1.0,
        description="optimizer update rate on the CPUs when memory_bandwidth_gbps is not given, 1e9 params/s "
                    "(estimate)")
    cpus: list[CpuSpec] = Field(min_length=1, max_length=MAX_CPUS, description="the host CPUs (sockets)")
    cpu_link: CpuLinkSpec | None = Field(
        default=None, description="the link between every two CPUs; required where two GPUs on different CPUs "
                                  "have no scale-up path")

    @property
    def sockets(self) -> int:
        """Host CPUs (schema 1's ``host.sockets``)."""
        return len(self.cpus)

    @property
    def adam_params_per_s(self) -> float:
        """As schema 1's ``HostSpec.adam_params_per_s``: CPU Adam is memory bound."""
        if self.memory_bandwidth_gbps is None:
            return self.cpu_adam_gparams_per_s * 1e9
        return self.memory_bandwidth_gbps * 1e9 * CPU_STREAM_EFFICIENCY / CPU_ADAM_BYTES_PER_PARAM


class ServerFile(FileModel):
    """The on-disk schema 2 of a topology file (module doc)."""

    schema_: int = Field(alias="schema", description="format version: 2")
    name: str
    description: str = ""
    gpu: TieredGpuSpec
    scale_up: ScaleUpSpec = Field(description="the GPUs' own fabric (switch, mesh or none)")
    host: HostTierSpec
    nvme: NvmeSpec | None = Field(default=None, description="local NVMe drives (ZeRO-Infinity's offload target)")
    price: PriceSpec | None = Field(default=None, description="list prices with source and date (`mpsim choose`)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @property
    def nvlink(self) -> NvlinkSpec | None:
        """Schema 1's NVLink-pairs block, which a tiered file never has (its pairs are a
        ``scale_up`` mesh): None, for code that reads either schema."""
        return None

    def tiers(self, source: str = "") -> Tiers:
        """The file checked (errors naming ``source`` and the field) and as tiers."""
        _check(source, self)
        return _tiers(self)

    def with_faster_scale_up(self, factor: float) -> ServerFile:
        """The same server with its scale-up links ``factor`` times faster."""
        up = self.scale_up
        update: dict[str, object] = {}
        if up.gpu_bandwidth_gbps is not None:
            update["gpu_bandwidth_gbps"] = up.gpu_bandwidth_gbps * factor
        if up.link_bandwidth_gbps is not None:
            update["link_bandwidth_gbps"] = up.link_bandwidth_gbps * factor
        return self.model_copy(update={"scale_up": up.model_copy(update=update)})


# -- checks --------------------------------------------------------------------------------

_KIND_FIELDS: Final = {
    "switch": (("name", "gpu_bandwidth_gbps", "links_per_gpu"), ()),
    "mesh": (("name", "link_bandwidth_gbps"), ("links_per_pair", "pairs")),
    "none": ((), ()),
}
"""Per scale-up kind: the fields it requires, and those of which it takes exactly one."""
_KIND_OPTIONAL: Final = ("gpu_bandwidth_gbps", "links_per_gpu", "link_bandwidth_gbps", "links_per_pair", "pairs",
                         "name")


def _check(path: str, spec: ServerFile) -> None:
    """Cross-field rules pydantic cannot state per field; raise the first violation."""
    if spec.schema_ != SCHEMA_VERSION:
        raise SchemaError(path, "schema", f"expected {SCHEMA_VERSION}, got {spec.schema_}")
    n = spec.gpu.count
    _check_scale_up(path, spec.scale_up, n)
    cpu_of = _check_cpus(path, spec.host.cpus, n)
    _check_cpu_link(path, spec, cpu_of)


def _check_scale_up(path: str, up: ScaleUpSpec, n: int) -> None:
    required, one_of = _KIND_FIELDS[up.kind]
    for field in required:
        if getattr(up, field) is None:
            raise SchemaError(path, f"scale_up.{field}", f"required for kind {up.kind}")
    for field in _KIND_OPTIONAL:
        if field not in required + one_of and getattr(up, field) is not None:
            raise SchemaError(path, f"scale_up.{field}", f"not used by kind {up.kind}")
    if one_of and sum(getattr(up, field) is not None for field in one_of) != 1:
        raise SchemaError(path, "scale_up", f"kind {up.kind} takes exactly one of {' or '.join(one_of)}")
    if up.name is not None and up.name.lower() in HOST_LINK_KINDS:
        raise SchemaError(path, "scale_up.name", f"{up.name!r} names host links; call the fabric otherwise")
    seen: set[frozenset[int]] = set()
    for i, pair in enumerate(up.pairs or ()):
        a, b = pair.gpus
        where = f"scale_up.pairs.{i}.gpus"
        for g in (a, b):
            if not 0 <= g < n:
                raise SchemaError(path, where, f"GPU index {g} out of range 0..{n - 1}")
        if a == b:
            raise SchemaError(path, where, f"a GPU cannot link to itself ({a})")
        if frozenset((a, b)) in seen:
            raise SchemaError(path, where, f"pair {a}-{b} listed twice")
        seen.add(frozenset((a, b)))


def _check_cpus(path: str, cpus: list[CpuSpec], n: int) -> dict[int, int]:
    """Every GPU on exactly one CPU, each switch's GPUs its CPU's; the CPU of each GPU."""
    cpu_of: dict[int, int] = {}
    switch_names: set[str] = set()
    for i, cpu in enumerate(cpus):
        where = f"host.cpus.{i}"
        for g in cpu.gpus:
            if not 0 <= g < n:
                raise SchemaError(path, f"{where}.gpus", f"GPU index {g} out of range 0..{n - 1}")
            if g in cpu_of:
                raise SchemaError(path, f"{where}.gpus", f"GPU {g} is already attached to CPU {cpu_of[g]}")
            cpu_of[g] = i
        if cpu.gpus and cpu.gpu_link_gbps is None:
            raise SchemaError(path, f"{where}.gpu_link_gbps",
                              f"required: the bandwidth of each GPU's {cpu.attach} link")
        if cpu.attach == "c2c" and cpu.switches:
            raise SchemaError(path, f"{where}.switches", "c2c GPUs attach to the CPU directly, below no PCIe switch")
        _check_switches(path, where, cpu, switch_names)
    missing = sorted(set(range(n)) - set(cpu_of))
    if missing:
        raise SchemaError(path, "host.cpus", f"every GPU must be attached to a CPU; missing {gpu_list(missing)}")
    return cpu_of


def _check_switches(path: str, where: str, cpu: CpuSpec, names: set[str]) -> None:
    """A CPU's switches: names unique in the server (``names``, added to), each GPU one of
    the CPU's and below one switch at most."""
    below: dict[int, str] = {}
    for j, sw in enumerate(cpu.switches):
        if sw.name in names:
            raise SchemaError(path, f"{where}.switches.{j}.name", f"switch {sw.name} is named twice")
        names.add(sw.name)
        for g in sw.gpus:
            if g not in cpu.gpus:
                raise SchemaError(path, f"{where}.switches.{j}.gpus",
                                  f"GPU {g} is not attached to this CPU (list it in {where}.gpus)")
            if g in below:
                raise SchemaError(path, f"{where}.switches.{j}.gpus", f"GPU {g} is already below switch {below[g]}")
            below[g] = sw.name


def _check_cpu_link(path: str, spec: ServerFile, cpu_of: dict[int, int]) -> None:
    link = spec.host.cpu_link
    if link is not None:
        if link.name.lower() in HOST_LINK_KINDS:
            raise SchemaError(path, "host.cpu_link.name", f"{link.name!r} names GPU-to-CPU links; call it otherwise")
        return
    up = spec.scale_up
    if len(spec.host.cpus) == 1 or up.kind == "switch" or up.links_per_pair is not None:
        return  # one CPU, or every GPU pair joined by the scale-up fabric
    joined = {frozenset(p.gpus) for p in up.pairs or ()}
    for a, b in combinations(range(spec.gpu.count), 2):
        if cpu_of[a] != cpu_of[b] and frozenset((a, b)) not in joined:
            raise SchemaError(path, "host.cpu_link", f"required: GPUs {a} and {b} sit on CPUs {cpu_of[a]} and "
                                                     f"{cpu_of[b]} with no scale-up link between them")


# -- tiers ----------------------------------------------------------------------------------

def _tiers(spec: ServerFile) -> Tiers:
    """A checked schema-2 file as tiers: ports per CPU in file order, its switches first,
    then its GPUs on links of their own."""
    up = spec.scale_up
    prefix = (up.name or "").lower()
    if up.kind == "switch":
        assert up.gpu_bandwidth_gbps is not None and up.links_per_gpu is not None
        scale_up = ScaleUp("switch", prefix, up.label, up.latency_us, gpu_gbps=up.gpu_bandwidth_gbps,
                           links_per_gpu=up.links_per_gpu)
    elif up.kind == "mesh":
        assert up.link_bandwidth_gbps is not None
        bw = up.link_bandwidth_gbps
        if up.links_per_pair is not None:
            k = up.links_per_pair
            bundles = tuple(PeerBundle(a, b, k, k * bw) for a, b in combinations(range(spec.gpu.count), 2))
        else:
            bundles = tuple(PeerBundle(p.gpus[0], p.gpus[1], p.links, p.links * bw) for p in up.pairs or ())
        scale_up = ScaleUp("mesh", prefix, up.label, up.latency_us, bundles=bundles)
    else:
        scale_up = ScaleUp("none")
    ports: list[HostPort] = []
    for i, cpu in enumerate(spec.host.cpus):
        if not cpu.gpus:
            continue
        assert cpu.gpu_link_gbps is not None
        for sw in cpu.switches:
            ports.append(HostPort(i, cpu.attach, tuple(sw.gpus), cpu.gpu_link_gbps, cpu.latency_us, sw.name,
                                  sw.uplink_gbps))
        below = {g for sw in cpu.switches for g in sw.gpus}
        if direct := tuple(g for g in cpu.gpus if g not in below):
            ports.append(HostPort(i, cpu.attach, direct, cpu.gpu_link_gbps, cpu.latency_us))
    link = spec.host.cpu_link
    cpu_link = None if link is None else CpuLink(link.name.lower(), link.bandwidth_gbps, link.latency_us)
    return Tiers(spec.gpu.count, len(spec.host.cpus), scale_up, tuple(ports), cpu_link)


def schema2_of(spec: TopologyFile, vendor: str = "nvidia") -> dict[str, Any]:
    """A schema-1 file as a schema-2 mapping with the same links, names and routes: NVLink
    pairs a mesh named NVLink, an NVSwitch a switch named NVSwitch, each socket a CPU
    holding its switches' GPUs, the socket link a CPU link at the PCIe latency (as schema
    1 times it)."""
    gpu = spec.gpu.model_dump(mode="json", exclude_none=True) | {"vendor": vendor}
    scale_up: dict[str, Any] = {"kind": "none"}
    if spec.nvlink is not None:
        nv = spec.nvlink
        scale_up = {"kind": "mesh", "name": "NVLink", "link_bandwidth_gbps": nv.link_bandwidth_gbps,
                    "latency_us": nv.latency_us,
                    "pairs": [{"gpus": list(p.gpus), "links": p.links} for p in nv.pairs]}
    elif spec.nvswitch is not None:
        sw = spec.nvswitch
        scale_up = {"kind": "switch", "name": "NVSwitch", "gpu_bandwidth_gbps": sw.gpu_bandwidth_gbps,
                    "links_per_gpu": sw.links_per_gpu, "latency_us": sw.latency_us}
    pcie = spec.pcie
    cpus: list[dict[str, Any]] = []
    for socket in range(spec.host.sockets):
        switches = [sw for sw in pcie.switches if sw.socket == socket]
        cpu: dict[str, Any] = {"gpus": [g for sw in switches for g in sw.gpus]}
        if switches:
            cpu |= {"attach": "pcie", "gpu_link_gbps": pcie.gpu_link_gbps, "latency_us": pcie.latency_us,
                    "switches": [{"name": sw.name, "gpus": list(sw.gpus), "uplink_gbps": sw.uplink_gbps}
                                 for sw in switches]}
        cpus.append(cpu)
    host: dict[str, Any] = spec.host.model_dump(mode="json", exclude_none=True, exclude={"sockets"}) | {"cpus": cpus}
    if spec.socket_link is not None:
        host["cpu_link"] = {"name": spec.socket_link.name, "bandwidth_gbps": spec.socket_link.bandwidth_gbps,
                            "latency_us": pcie.latency_us}
    out: dict[str, Any] = {"schema": SCHEMA_VERSION, "name": spec.name, "description": spec.description, "gpu": gpu,
                           "scale_up": scale_up, "host": host}
    for key in ("nvme", "price"):
        block = getattr(spec, key)
        if block is not None:
            out[key] = block.model_dump(mode="json", exclude_none=True)
    return out
