"""Servers: GPUs, host, NVLink / NVSwitch / PCIe links, and the routes derived from them.

A topology file (YAML, ``topologies/``) describes the physical links only. Every route
between two GPUs and between each GPU and host memory, with its bottleneck bandwidth, is
derived (``Topology.route``), never typed in by hand.

Two schemas are read. Schema 1 (``mpsim.hardware.schema1``) has NVIDIA-shaped slots:
``nvlink`` pairs or an ``nvswitch``, a PCIe tree below host sockets. Schema 2
(``mpsim.hardware.schema2``) is tiered and vendor-neutral: a ``scale_up`` switch or mesh
of any size, CPUs with the GPUs each holds by PCIe or NVLink-C2C. Both become one
``mpsim.hardware.tiers.Tiers``, whose ``Wiring`` builds the links and routes, so a
schema-1 file keeps the links, names and routes it always had.

Links are directional: a PCIe x16 lane set or an NVLink carries its bandwidth in each
direction independently, so a swap-out and a swap-in on the same GPU do not contend,
while two GPUs behind one PCIe switch swapping out at once share its uplink.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path

from mpsim.datafile import read_data_file, validate
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.schema1 import (  # noqa: F401 - the file parts, read from here as before
    MAX_GBPS,
    MAX_GPUS,
    MAX_LATENCY_US,
    MAX_USD,
    MIN_GBPS,
    SCHEMA_VERSION,
    Dtype,
    GpuSpec,
    NvmeSpec,
    OpEfficiency,
    PriceSpec,
    TopologyFile,
    schema_expected,
)
from mpsim.hardware.schema2 import ServerFile
from mpsim.hardware.tiers import HOST, Endpoint, Link, Route, Wiring  # noqa: F401 - as above
from mpsim.units import GiB, MiB


def with_faster_peer_links(spec: TopologyFile | ServerFile, factor: float) -> TopologyFile | ServerFile:
    """The same server with its scale-up links (NVLink, NVSwitch, a schema-2 mesh or switch)
    ``factor`` times faster: a what-if that bounds what any D2D placement (device mapping,
    striping) could gain."""
    return spec.with_faster_scale_up(factor)



class Topology:
    """A validated server with its links and derived routes (``mpsim.hardware.tiers``)."""

    def __init__(self, spec: TopologyFile | ServerFile, source: str = "") -> None:
        self.tiers = spec.tiers(source)
        self.spec = spec
        self.source = source
        self._wiring = Wiring(self.tiers)
        self.links: dict[str, Link] = self._wiring.links
        self._routes: dict[tuple[Endpoint, Endpoint], Route] = self._wiring.routes()

    # -- queries --------------------------------------------------------------------------
    @cached_property
    def content_hash(self) -> str:
        """SHA-256 of the validated contents (not the name or path): equal contents, equal hash."""
        return hashlib.sha256(self.spec.model_dump_json(by_alias=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n_gpus(self) -> int:
        return self.spec.gpu.count

    @cached_property
    def memory_bytes(self) -> int:
        return int(self.spec.gpu.memory_mib * MiB)

    @cached_property
    def reserved_bytes(self) -> int:
        return int(self.spec.gpu.reserved_mib * MiB)

    @cached_property
    def capacity_bytes(self) -> int:
        """What tensors may use on one GPU: memory less the reserved context."""
        return self.memory_bytes - self.reserved_bytes

    @cached_property
    def host_memory_bytes(self) -> int:
        return int(self.spec.host.memory_gib * GiB)

    def route(self, src: Endpoint, dst: Endpoint) -> Route:
        try:
            return self._routes[(src, dst)]
        except KeyError:
            raise MpsimError(f"no route from {src} to {dst} on {self.name} (GPUs are 0..{self.n_gpus - 1})") from None

    def nvlinks_between(self, a: int, b: int) -> int:
        """Scale-up links (NVLink, xGMI, ...) from GPU a to GPU b (through a switch: each
        GPU's own links)."""
        return self._wiring.link_counts.get((a, b), 0)

    def nvlink_peers(self, g: int) -> tuple[int, ...]:
        """The GPUs GPU g reaches over its scale-up links (NVLink, xGMI, ...), in index order."""
        return self._wiring.peers[g]

    def connection(self, a: int, b: int) -> str:
        """The ``nvidia-smi topo -m`` label of a GPU pair: X, NV<n> (a schema-2 mesh or
        switch may name another label, XGMI<n>), PIX, NODE or SYS."""
        return self._wiring.connection(a, b)

    def socket_of(self, g: int) -> int:
        """The host CPU (socket) GPU g hangs off."""
        return self._wiring.cpu_of(g)

    def to_dict(self) -> dict:
        """JSON-safe summary: GPUs, connection and bandwidth matrices (GB/s)."""
        n = self.n_gpus
        gpu = self.spec.gpu
        return {
            "name": self.name,
            "description": self.spec.description,
            "gpu": {
                "model": gpu.model,
                "count": n,
                "memory_bytes": self.memory_bytes,
                "reserved_bytes": self.reserved_bytes,
                "capacity_bytes": self.capacity_bytes,
                "peak_tflops": dict(gpu.peak_tflops),
                "memory_bandwidth_gbps": gpu.memory_bandwidth_gbps,
            },
            "host": {"memory_bytes": self.host_memory_bytes, "sockets": self.spec.host.sockets},
            "connection": [[self.connection(a, b) for b in range(n)] for a in range(n)],
            "bandwidth_gbps": [
                [None if a == b else self.route(a, b).bandwidth / 1e9 for b in range(n)] for a in range(n)
            ],
            "to_host_gbps": [self.route(g, HOST).bandwidth / 1e9 for g in range(n)],
            "from_host_gbps": [self.route(HOST, g).bandwidth / 1e9 for g in range(n)],
        }


def parse_topology(data: object, source: str = "<topology>") -> Topology:
    """A server from parsed YAML of either schema (``schema: 2``: ``mpsim.hardware.schema2``)."""
    version = data.get("schema") if isinstance(data, dict) else None
    if version == 2:
        return Topology(validate(ServerFile, data, source), source)
    if isinstance(version, int) and not isinstance(version, bool) and version != SCHEMA_VERSION:
        raise SchemaError(source, "schema", schema_expected(version))
    return Topology(validate(TopologyFile, data, source), source)


def read_topology_file(path: Path) -> Topology:
    return parse_topology(read_data_file(path, "yaml", "topology"), str(path))
