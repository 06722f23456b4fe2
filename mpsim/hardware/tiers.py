"""A server as tiers, and the one place its links are built and its routes derived.

Both topology schemas (``mpsim.hardware.topology`` reads schema 1, ``mpsim.hardware.schema2``
schema 2) are turned into a ``Tiers``: the GPUs' scale-up fabric (a switch every GPU
reaches in one link, a mesh of point-to-point bundles, or none), the ports by which GPUs
reach their CPU (below a PCIe switch that shares one uplink, or each on a PCIe or
NVLink-C2C link of its own), and the link between CPUs. ``Wiring`` builds the directed
links of a ``Tiers`` and derives every route from them:

- GPU to GPU: over a mesh bundle joining the two, else through the scale-up switch, else
  through the host: up to the first GPU's CPU, across the CPU link when the second GPU
  hangs off another CPU, down to it (two GPUs below one PCIe switch turn at the switch);
- GPU to host and back: the GPU's own port to its CPU (host buffers are pinned NUMA-local).

Links are directional: a link carries its bandwidth in each direction independently.
Names say the tier, e.g. ``nvlink:0->3``, ``nvswitch:gpu0->fabric``, ``pcie:gpu0->plx0``,
``pcie:plx0->cpu0``, ``c2c:gpu4->cpu2``, ``upi:cpu0->cpu1``; a schema-1 file's links
keep the names (and order) they always had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from mpsim.units import gbps_to_bytes_per_s

HOST: Final = "host"
Endpoint = int | Literal["host"]


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a physical link: a shared fluid resource of ``bandwidth`` bytes/s."""

    name: str
    bandwidth: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class Route:
    """A path of links. Alone on an idle server it moves at its slowest link's bandwidth."""

    links: tuple[Link, ...]

    @property
    def bandwidth(self) -> float:
        return min(link.bandwidth for link in self.links)

    @property
    def latency_s(self) -> float:
        """One setup latency per transfer: the largest of its links' (hops are pipelined)."""
        return max(link.latency_s for link in self.links)

    def time_alone_s(self, n_bytes: int) -> float:
        return self.latency_s + n_bytes / self.bandwidth


ScaleUpKind = Literal["switch", "mesh", "none"]
HostAttach = Literal["pcie", "c2c"]


@dataclass(frozen=True, slots=True)
class PeerBundle:
    """Point-to-point links joining GPUs ``a`` and ``b`` of a mesh: ``links`` of them,
    ``gbps`` GB/s per direction together."""

    a: int
    b: int
    links: int
    gbps: float


@dataclass(frozen=True, slots=True)
class ScaleUp:
    """The GPUs' own fabric. ``switch``: each GPU one link of ``gpu_gbps`` into a fabric
    that reaches every other GPU (``links_per_gpu`` physical links); ``mesh``: the
    ``bundles``; ``none``: GPUs talk through the host. ``prefix`` starts its links' names,
    ``label`` a connected pair in the connection matrix (``NV`` + link count, as
    ``nvidia-smi topo -m`` writes)."""

    kind: ScaleUpKind
    prefix: str = ""
    label: str = "NV"
    latency_us: float = 0.0
    gpu_gbps: float = 0.0
    links_per_gpu: int = 0
    bundles: tuple[PeerBundle, ...] = ()


@dataclass(frozen=True, slots=True)
class HostPort:
    """GPUs ``gpus`` reaching CPU ``cpu`` by ``kind`` (PCIe or NVLink-C2C): below the PCIe
    switch ``switch``, whose uplink of ``uplink_gbps`` they share, or, with ``switch``
    None, each on a link of its own straight to the CPU. ``gpu_gbps`` is each GPU's own
    link, per direction."""

    cpu: int
    kind: HostAttach
    gpus: tuple[int, ...]
    gpu_gbps: float
    latency_us: float
    switch: str | None = None
    uplink_gbps: float = 0.0


@dataclass(frozen=True, slots=True)
class CpuLink:
    """The link between every two CPUs, ``gbps`` per direction (one per ordered pair)."""

    prefix: str
    gbps: float
    latency_us: float


@dataclass(frozen=True, slots=True)
class Tiers:
    """A checked server: GPUs, CPUs, the scale-up fabric, the host ports in link-building
    order, and the CPU link (None on one CPU, or where no route needs one)."""

    n_gpus: int
    n_cpus: int
    scale_up: ScaleUp
    ports: tuple[HostPort, ...]
    cpu_link: CpuLink | None = None


class Wiring:
    """The directed links of a ``Tiers`` (built once, in a fixed order) and what is derived
    from them: routes, scale-up link counts, peers and ``nvidia-smi``-style labels."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.links: dict[str, Link] = {}
        self._port_of = {g: port for port in tiers.ports for g in port.gpus}
        self._bundles = {(a, b): bundle for bundle in tiers.scale_up.bundles
                         for a, b in ((bundle.a, bundle.b), (bundle.b, bundle.a))}
        self._build()
        n = tiers.n_gpus
        self.link_counts = {(a, b): self._count(a, b) for a in range(n) for b in range(n)}
        self.peers = tuple(tuple(b for b in range(n) if b != a and self.link_counts[(a, b)]) for a in range(n))

    # -- links ---------------------------------------------------------------------------
    def _add(self, name: str, gbps: float, latency_us: float) -> None:
        self.links[name] = Link(name, gbps_to_bytes_per_s(gbps), latency_us * 1e-6)

    def _both(self, a: str, b: str, gbps: float, latency_us: float, kind: str) -> None:
        self._add(f"{kind}:{a}->{b}", gbps, latency_us)
        self._add(f"{kind}:{b}->{a}", gbps, latency_us)

    def _build(self) -> None:
        t, up = self.tiers, self.tiers.scale_up
        if up.kind == "mesh":
            for bundle in up.bundles:
                self._both(str(bundle.a), str(bundle.b), bundle.gbps, up.latency_us, up.prefix)
        elif up.kind == "switch":
            for g in range(t.n_gpus):
                self._both(f"gpu{g}", "fabric", up.gpu_gbps, up.latency_us, up.prefix)
        for port in t.ports:
            below = port.switch if port.switch is not None else f"cpu{port.cpu}"
            for g in port.gpus:
                self._both(f"gpu{g}", below, port.gpu_gbps, port.latency_us, port.kind)
            if port.switch is not None:
                self._both(port.switch, f"cpu{port.cpu}", port.uplink_gbps, port.latency_us, port.kind)
        if t.cpu_link is not None and t.n_cpus > 1:
            for a in range(t.n_cpus):
                for b in range(t.n_cpus):
                    if a != b:
                        self._add(f"{t.cpu_link.prefix}:cpu{a}->cpu{b}", t.cpu_link.gbps, t.cpu_link.latency_us)

    # -- routes --------------------------------------------------------------------------
    def routes(self) -> dict[tuple[Endpoint, Endpoint], Route]:
        """Every GPU pair's route, and each GPU's to the host and back."""
        out: dict[tuple[Endpoint, Endpoint], Route] = {}
        for a in range(self.tiers.n_gpus):
            for b in range(self.tiers.n_gpus):
                if a != b:
                    out[(a, b)] = self.gpu_route(a, b)
            out[(a, HOST)] = Route(self._up(a))
            out[(HOST, a)] = Route(self._down(a))
        return out

    def gpu_route(self, a: int, b: int) -> Route:
        up = self.tiers.scale_up
        if (a, b) in self._bundles:
            return Route((self.links[f"{up.prefix}:{a}->{b}"],))
        if up.kind == "switch":
            return Route((self.links[f"{up.prefix}:gpu{a}->fabric"], self.links[f"{up.prefix}:fabric->gpu{b}"]))
        pa, pb = self._port_of[a], self._port_of[b]
        if pa.switch is not None and pa.switch == pb.switch:
            return Route((self.links[f"{pa.kind}:gpu{a}->{pa.switch}"], self.links[f"{pb.kind}:{pb.switch}->gpu{b}"]))
        hops = list(self._up(a))
        if pa.cpu != pb.cpu:
            assert self.tiers.cpu_link is not None, "checked: GPUs on two CPUs without a scale-up path need a CPU link"
            hops.append(self.links[f"{self.tiers.cpu_link.prefix}:cpu{pa.cpu}->cpu{pb.cpu}"])
        return Route((*hops, *self._down(b)))

    def _up(self, g: int) -> tuple[Link, ...]:
        """GPU g to its CPU: through its switch, or its own link."""
        p = self._port_of[g]
        if p.switch is None:
            return (self.links[f"{p.kind}:gpu{g}->cpu{p.cpu}"],)
        return self.links[f"{p.kind}:gpu{g}->{p.switch}"], self.links[f"{p.kind}:{p.switch}->cpu{p.cpu}"]

    def _down(self, g: int) -> tuple[Link, ...]:
        p = self._port_of[g]
        if p.switch is None:
            return (self.links[f"{p.kind}:cpu{p.cpu}->gpu{g}"],)
        return self.links[f"{p.kind}:cpu{p.cpu}->{p.switch}"], self.links[f"{p.kind}:{p.switch}->gpu{g}"]

    # -- labels --------------------------------------------------------------------------
    def _count(self, a: int, b: int) -> int:
        """Scale-up links from GPU a to GPU b (through a switch: each GPU's own links)."""
        up = self.tiers.scale_up
        if up.kind == "switch":
            return up.links_per_gpu
        bundle = self._bundles.get((a, b))
        return bundle.links if bundle is not None else 0

    def connection(self, a: int, b: int) -> str:
        """X, <label><links>, PIX (one PCIe switch), NODE (one CPU) or SYS."""
        if a == b:
            return "X"
        if n := self.link_counts.get((a, b), 0):
            return f"{self.tiers.scale_up.label}{n}"
        pa, pb = self._port_of[a], self._port_of[b]
        if pa.switch is not None and pa.switch == pb.switch:
            return "PIX"
        return "NODE" if pa.cpu == pb.cpu else "SYS"

    def cpu_of(self, g: int) -> int:
        return self._port_of[g].cpu

    def port_of(self, g: int) -> HostPort:
        return self._port_of[g]
