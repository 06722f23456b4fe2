"""Clusters: identical servers joined by a fabric of NICs, and the view of them the engine runs.

A cluster file (YAML, ``topologies/clusters/``) names a shipped server type, how many such
servers can be had, and the fabric: NICs per server, their line rate, the share of it a
collective reaches, the per-step latency across the network, which GPUs each NIC serves,
and the fabric's shape (``rail-optimized``: NIC i of every server on leaf switch i, as DGX
SuperPODs are built; ``fat-tree`` with an oversubscription ratio; ``single-switch``).

The engine never builds the whole cluster. ``Cluster.view(k)`` is a ``Topology`` of the
k servers that hold the simulated GPUs, each with its own copy of the server's links, plus
each server's NIC links (one per NIC group, per direction) and, on an oversubscribed fat
tree, its share of the spine. Routes are derived on first use:

- inside a server: the server's own route (its links, prefixed ``s<i>/``);
- across servers: the sender's PCIe link to its switch (GPUDirect RDMA reaches the NIC
  through the GPU's PCIe switch), its NIC group's transmit link, the spine (fat tree), the
  receiver's NIC group's receive link and PCIe link;
- ``mirror_route(g)``: GPU g to its counterpart on another, identical server. Servers
  outside the view run the same program as the one in it, so what g sends to a peer
  server crosses g's transmit links and what g receives from another crosses g's own
  receive links: the route out and back through g's own NIC stands for every
  inter-server hop of a symmetric collective (``collectives.two_level_transfer``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cached_property
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from mpsim.datafile import FileModel, validate
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.schema1 import gpu_list
from mpsim.hardware.topology import (
    HOST,
    MAX_GBPS,
    MAX_GPUS,
    MAX_LATENCY_US,
    MIN_GBPS,
    Endpoint,
    Link,
    PriceSpec,
    Route,
    Topology,
)
from mpsim.units import gbps_to_bytes_per_s

DEFAULT_CLUSTERS: tuple[str, ...] = ("dgx-h100-superpod", "aws-p5", "dgx-a100-superpod", "aws-p4de")
"""The clusters ``choose --tokens`` searches unless told: the shipped H100 and A100 80GB ones."""
DEFAULT_BATCH_TOKENS = 4 * 2**20
"""Tokens per iteration (global batch): 4 Mi tokens, the batch Llama 2 and Llama 3 report."""
CLUSTER_SCHEMA_VERSION = 1
MAX_SERVERS = 65536
FabricKind = Literal["rail-optimized", "fat-tree", "single-switch"]


class NicGroup(FileModel):
    """NICs that a set of GPUs share: each GPU's traffic across servers leaves through its
    group's NICs, which the group's GPUs share."""

    gpus: list[int] = Field(min_length=1, max_length=MAX_GPUS,
                            description="GPU indices (in the server) these NICs serve")
    nics: int = Field(gt=0, le=MAX_GPUS, description="NICs in the group")


class FabricSpec(FileModel):
    kind: FabricKind = Field(description="rail-optimized, fat-tree or single-switch")
    nics_per_server: int = Field(gt=0, le=MAX_GPUS, description="NICs per server that carry training traffic")
    nic_gbit: float = Field(ge=MIN_GBPS, le=MAX_GBPS * 8, description="line rate of one NIC per direction, Gb/s")
    efficiency: float = Field(gt=0, le=1, description="share of the line rate a collective reaches")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="latency of one step across the network, us")
    oversubscription: float = Field(default=1.0, ge=1, le=64,
                                    description="fat tree: the leaves' downlink over uplink bandwidth")
    nic_groups: list[NicGroup] | None = Field(
        default=None, description="which GPUs each group of NICs serves; default: NICs spread evenly over GPUs")
    source: str = Field(min_length=1, description="where the figures come from")

    @property
    def nic_bytes_per_s(self) -> float:
        """One NIC's effective bandwidth per direction, bytes/s."""
        return gbps_to_bytes_per_s(self.nic_gbit / 8 * self.efficiency)


class ClusterFile(FileModel):
    """The on-disk schema of a cluster file."""

    schema_: int = Field(alias="schema", description="format version, currently 1")
    name: str = Field(min_length=1)
    description: str = ""
    server: str = Field(min_length=1, description="a shipped server type by name, or a topology file's path")
    max_servers: int = Field(gt=0, le=MAX_SERVERS, description="the most servers a search may use")
    fabric: FabricSpec
    price: PriceSpec | None = Field(default=None, description="per server; default: the server file's price")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _oversubscribed_fat_tree_only(self) -> ClusterFile:
        if self.fabric.oversubscription != 1 and self.fabric.kind != "fat-tree":
            raise ValueError(f"oversubscription is a fat tree's; a {self.fabric.kind} fabric is non-blocking")
        return self


def _nic_groups(path: str, fabric: FabricSpec, n_gpus: int) -> tuple[NicGroup, ...]:
    """The fabric's NIC groups, checked against the server's GPUs (every GPU in one group,
    the groups' NICs adding up to ``nics_per_server``), or the even spread."""
    if fabric.nic_groups is None:
        n = fabric.nics_per_server
        if n >= n_gpus:
            if n % n_gpus:
                raise SchemaError(path, "fabric.nic_groups", f"{n} NICs do not spread evenly over {n_gpus} GPUs; "
                                                             "say which GPUs each serves")
            return tuple(NicGroup(gpus=[g], nics=n // n_gpus) for g in range(n_gpus))
        if n_gpus % n:
            raise SchemaError(path, "fabric.nic_groups", f"{n} NICs do not spread evenly over {n_gpus} GPUs; "
                                                         "say which GPUs each serves")
        per = n_gpus // n
        return tuple(NicGroup(gpus=list(range(i * per, (i + 1) * per)), nics=1) for i in range(n))
    seen: set[int] = set()
    for i, group in enumerate(fabric.nic_groups):
        for g in group.gpus:
            if not 0 <= g < n_gpus:
                raise SchemaError(path, f"fabric.nic_groups.{i}.gpus", f"GPU index {g} out of range 0..{n_gpus - 1}")
            if g in seen:
                raise SchemaError(path, f"fabric.nic_groups.{i}.gpus", f"GPU {g} is already in another group")
            seen.add(g)
    if len(seen) != n_gpus:
        missing = sorted(set(range(n_gpus)) - seen)
        raise SchemaError(path, "fabric.nic_groups", f"every GPU needs a NIC; missing {gpu_list(missing)}")
    total = sum(g.nics for g in fabric.nic_groups)
    if total != fabric.nics_per_server:
        raise SchemaError(path, "fabric.nic_groups", f"the groups have {total} NICs but nics_per_server is "
                                                     f"{fabric.nics_per_server}")
    return tuple(fabric.nic_groups)


class Cluster:
    """A validated cluster: its server type (a ``Topology``) and its fabric."""

    def __init__(self, spec: ClusterFile, server: Topology, source: str = "") -> None:
        if spec.schema_ != CLUSTER_SCHEMA_VERSION:
            raise SchemaError(source, "schema", f"expected {CLUSTER_SCHEMA_VERSION}, got {spec.schema_}")
        self.spec = spec
        self.server = server
        self.source = source
        self.nic_groups = _nic_groups(source, spec.fabric, server.n_gpus)
        self._group_of = {g: i for i, group in enumerate(self.nic_groups) for g in group.gpus}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gpus_per_server(self) -> int:
        return self.server.n_gpus

    @property
    def price(self) -> PriceSpec | None:
        return self.spec.price or self.server.spec.price

    @cached_property
    def content_hash(self) -> str:
        """SHA-256 of the cluster's and its server's validated contents."""
        text = self.spec.model_dump_json(by_alias=True) + self.server.content_hash
        return hashlib.sha256(text.encode()).hexdigest()

    def nic_group_of(self, gpu: int) -> int:
        """The NIC group serving GPU ``gpu`` of a server."""
        return self._group_of[gpu]

    def nic_bytes_per_s(self, gpu: int) -> float:
        """What GPU ``gpu`` gets of its NICs per direction when every GPU of its group sends."""
        group = self.nic_groups[self._group_of[gpu]]
        return group.nics * self.spec.fabric.nic_bytes_per_s / len(group.gpus)

    def cross_bytes_per_s(self, gpu: int) -> float:
        """GPU ``gpu``'s bandwidth to another server when every GPU sends at once: its NIC
        share, its PCIe link, and on a fat tree its share of the spine."""
        fabric = self.spec.fabric
        pcie = self.server.route(gpu, HOST).links[0].bandwidth
        spine = fabric.nics_per_server * fabric.nic_bytes_per_s / fabric.oversubscription / self.gpus_per_server
        return min(self.nic_bytes_per_s(gpu), pcie, spine if fabric.kind == "fat-tree" else float("inf"))

    def to_dict(self) -> dict:
        """JSON-safe summary: the server type, the fabric, and per GPU its NIC group and its
        bandwidth to another server when every GPU sends (GB/s)."""
        f = self.spec.fabric
        return {"name": self.name, "description": self.spec.description, "server": self.server.name,
                "gpus_per_server": self.gpus_per_server, "max_servers": self.spec.max_servers,
                "fabric": f.model_dump(exclude={"nic_groups"}),
                "nic_groups": [g.model_dump() for g in self.nic_groups],
                "cross_server_gbps": [self.cross_bytes_per_s(g) / 1e9 for g in range(self.gpus_per_server)]}

    def view(self, servers: int) -> ClusterView:
        """The first ``servers`` servers as one topology (module doc)."""
        return _view(self, servers)

    def describe(self) -> str:
        f = self.spec.fabric
        shape = f.kind + (f" (oversubscribed {f.oversubscription:g}:1)" if f.oversubscription != 1 else "")
        return (f"{self.name}: up to {self.spec.max_servers} x {self.server.name} ({self.gpus_per_server} x "
                f"{self.server.spec.gpu.model}), {f.nics_per_server} x {f.nic_gbit:g} Gb/s NICs per server, {shape}")


_VIEWS: dict[tuple[str, int], ClusterView] = {}


def _view(cluster: Cluster, servers: int) -> ClusterView:
    key = (cluster.content_hash, servers)
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) > 256:
            _VIEWS.clear()
        view = _VIEWS[key] = ClusterView(cluster, servers)
    return view


class ClusterView(Topology):
    """``servers`` servers of a cluster as one topology (module doc): GPU ``s * G + l`` is
    GPU l of server s. ``spec`` is the server's; ``host_memory_bytes`` one server's host."""

    def __init__(self, cluster: Cluster, servers: int) -> None:  # noqa: D107 - the server's links, copied lazily
        if not 1 <= servers <= MAX_SERVERS:
            raise MpsimError(f"a view needs 1..{MAX_SERVERS} servers, got {servers}")
        self.cluster = cluster
        self.server = cluster.server
        self.servers = servers
        self.spec = self.server.spec
        self.source = cluster.source
        self.links: dict[str, Link] = {}
        self._routes: dict[tuple[Endpoint, Endpoint], Route] = {}
        self._mirrors: dict[int, Route] = {}

    @property
    def name(self) -> str:
        return f"{self.servers} x {self.server.name} ({self.cluster.name})"

    @property
    def n_gpus(self) -> int:
        return self.servers * self.server.n_gpus

    @cached_property
    def content_hash(self) -> str:
        return hashlib.sha256(f"{self.cluster.content_hash}:{self.servers}".encode()).hexdigest()

    def _split(self, gpu: int) -> tuple[int, int]:
        if not 0 <= gpu < self.n_gpus:
            raise MpsimError(f"no GPU {gpu} in {self.name} (GPUs are 0..{self.n_gpus - 1})")
        return divmod(gpu, self.server.n_gpus)

    def _link(self, server: int, link: Link) -> Link:
        name = f"s{server}/{link.name}"
        got = self.links.get(name)
        if got is None:
            got = self.links[name] = Link(name, link.bandwidth, link.latency_s)
        return got

    def _fabric_link(self, server: int, name: str, bandwidth: float) -> Link:
        full = f"s{server}/{name}"
        got = self.links.get(full)
        if got is None:
            got = self.links[full] = Link(full, bandwidth, self.cluster.spec.fabric.latency_us * 1e-6)
        return got

    def _in_server(self, server: int, route: Route) -> Route:
        return Route(tuple(self._link(server, link) for link in route.links))

    def _out(self, server: int, local: int) -> tuple[Link, ...]:
        """From GPU ``local`` of ``server`` into the fabric: PCIe up, the NIC group's transmit
        link, the spine on a fat tree."""
        fabric = self.cluster.spec.fabric
        group = self.cluster.nic_group_of(local)
        pcie = self._link(server, self.server.route(local, HOST).links[0])
        nic = self._fabric_link(server, f"nic{group}:tx",
                                self.cluster.nic_groups[group].nics * fabric.nic_bytes_per_s)
        return (pcie, nic, *self._spine(server, "tx"))

    def _in(self, server: int, local: int) -> tuple[Link, ...]:
        fabric = self.cluster.spec.fabric
        group = self.cluster.nic_group_of(local)
        pcie = self._link(server, self.server.route(HOST, local).links[-1])
        nic = self._fabric_link(server, f"nic{group}:rx",
                                self.cluster.nic_groups[group].nics * fabric.nic_bytes_per_s)
        return (*self._spine(server, "rx"), nic, pcie)

    def _spine(self, server: int, way: str) -> tuple[Link, ...]:
        fabric = self.cluster.spec.fabric
        if fabric.kind != "fat-tree" or fabric.oversubscription == 1:
            return ()
        width = fabric.nics_per_server * fabric.nic_bytes_per_s / fabric.oversubscription
        return (self._fabric_link(server, f"spine:{way}", width),)

    def route(self, src: Endpoint, dst: Endpoint) -> Route:
        key = (src, dst)
        got = self._routes.get(key)
        if got is None:
            got = self._routes[key] = self._derive(src, dst)
        return got

    def _derive(self, src: Endpoint, dst: Endpoint) -> Route:
        if src == HOST or dst == HOST:
            gpu = dst if src == HOST else src
            assert isinstance(gpu, int)
            s, local = self._split(gpu)
            return self._in_server(s, self.server.route(HOST, local) if src == HOST else self.server.route(local, HOST))
        assert isinstance(src, int) and isinstance(dst, int)
        (sa, la), (sb, lb) = self._split(src), self._split(dst)
        if src == dst:
            raise MpsimError(f"no route from GPU {src} to itself")
        if sa == sb:
            return self._in_server(sa, self.server.route(la, lb))
        return Route((*self._out(sa, la), *self._in(sb, lb)))

    def mirror_route(self, gpu: int) -> Route:
        """GPU ``gpu`` to its counterpart on another identical server (module doc)."""
        got = self._mirrors.get(gpu)
        if got is None:
            s, local = self._split(gpu)
            got = self._mirrors[gpu] = Route((*self._out(s, local), *self._in(s, local)))
        return got

    def nvlinks_between(self, a: int, b: int) -> int:
        (sa, la), (sb, lb) = self._split(a), self._split(b)
        return self.server.nvlinks_between(la, lb) if sa == sb else 0

    def nvlink_peers(self, g: int) -> tuple[int, ...]:
        s, local = self._split(g)
        base = s * self.server.n_gpus
        return tuple(base + p for p in self.server.nvlink_peers(local))

    def connection(self, a: int, b: int) -> str:
        (sa, la), (sb, lb) = self._split(a), self._split(b)
        return self.server.connection(la, lb) if sa == sb else "NET"

    def socket_of(self, g: int) -> int:
        return self.server.socket_of(self._split(g)[1])


ServerLoader = Callable[[str], Topology]
"""Finds a cluster file's server by the name the file gives (``mpsim.data.catalog``:
shipped name, or a path beside the file)."""


def parse_cluster(data: object, source: str, load_server: ServerLoader) -> Cluster:
    """A cluster from parsed YAML, its server found by ``load_server``."""
    spec = validate(ClusterFile, data, source)
    try:
        server = load_server(spec.server)
    except MpsimError as exc:
        raise SchemaError(source, "server", str(exc)) from None
    return Cluster(spec, server, source)
