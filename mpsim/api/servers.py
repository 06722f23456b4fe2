"""Servers: the shipped ones, a topology file for the machine at hand (probed with torch,
imported when asked), and the time of a copy or a collective alone on an idle server."""

from __future__ import annotations

from collections.abc import Sequence

import yaml

from mpsim.data.catalog import load_topology, shipped_topologies
from mpsim.errors import MpsimError
from mpsim.hardware.topology import HOST, Endpoint, Topology
from mpsim.plans.plan import stripes_by_bandwidth
from mpsim.sim.collectives import (
    OPS,
    all_to_all_bottleneck,
    check_algorithm,
    check_group,
    check_op,
    collective_time,
    ring_bottleneck,
)
from mpsim.sim.transfers import Copy, copy_times
from mpsim.units import parse_bytes


def shipped_servers() -> dict[str, Topology]:
    """Every shipped server by its name."""
    return {name: load_topology(name) for name in shipped_topologies()}


def probe_server(device: str = "cpu", devices: int = 1, threads: int = 1, memory_mib: float | None = None,
                 name: str | None = None) -> tuple[str, Topology]:
    """A topology of this machine from measurements (``mpsim.models.probe``): on ``cuda`` its GPUs,
    on ``cpu`` ``devices`` processes of ``threads`` threads; as the text of a topology
    file and checked."""
    from mpsim.models.probe import probe
    from mpsim.models.profiler import check_device

    check_device(device)
    spec, topology = probe(device, devices, threads, memory_mib, name)
    return f"# Measured by mpsim topo probe.\n{yaml.safe_dump(spec, sort_keys=False)}", topology


def _endpoint(t: Topology, text: str, what: str) -> Endpoint:
    """``host``, or a GPU of ``t`` as ``gpuN`` or ``N``."""
    word = text.strip().lower()
    if word == HOST:
        return HOST
    num = word[3:] if word.startswith("gpu") else word
    if not num.isdigit() or int(num) >= t.n_gpus:
        raise MpsimError(f"{what} {text!r}: expected host or a GPU of {t.name} (gpu0..gpu{t.n_gpus - 1})")
    return int(num)


def _peers(t: Topology, source: Endpoint, stripe: Sequence[str]) -> list[int]:
    """The GPUs a striped copy from ``source`` goes to."""
    if source == HOST:
        raise MpsimError("--stripe copies go from a GPU to its peers; --src must be a GPU")
    peers = [_endpoint(t, x, "--stripe") for x in stripe]
    gpus = [p for p in peers if p != HOST]
    if source in peers or len(gpus) != len(peers) or len(set(peers)) != len(peers):
        raise MpsimError("--stripe peers must be distinct GPUs other than --src")
    return gpus


def _striped(t: Topology, source: int, peers: list[int], n: int) -> dict[str, object]:
    """``n`` bytes from ``source`` split over ``peers`` by route bandwidth (MPress data
    striping); the copy lands with its last part."""
    parts = [(x.gpu, round(n * x.fraction)) for x in stripes_by_bandwidth(t, source, peers)]
    parts[-1] = (parts[-1][0], n - sum(p for _, p in parts[:-1]))
    landed = copy_times(t, [Copy(source, g, part) for g, part in parts]).landed_s
    return {"bytes": n, "seconds": max(landed),
            "parts": [{"dst": g, "bytes": part, "seconds": s} for (g, part), s in zip(parts, landed)],
            "effective_gbps": n / max(landed) / 1e9}


def _direct(t: Topology, source: Endpoint, target: Endpoint, n: int) -> dict[str, object]:
    """``n`` bytes from ``source`` to ``target`` over their route."""
    if target == source:
        raise MpsimError("--src and --dst are the same")
    seconds = copy_times(t, [Copy(source, target, n)]).landed_s[0]
    return {"bytes": n, "seconds": seconds, "route": [link.name for link in t.route(source, target).links],
            "effective_gbps": n / seconds / 1e9}


def transfer(server: str | Topology, src: str, sizes: Sequence[str], dst: str | None = None,
             stripe: Sequence[str] | None = None) -> dict:
    """One-way time and effective bandwidth of each copy of ``sizes`` (``216MB``, ``1.5GiB``)
    alone on an idle server, from ``src`` to ``dst`` (``host``, ``gpuN`` or ``N``) or
    striped over the ``stripe`` peers. Each copy pays its route's setup latency once."""
    t = load_topology(server) if isinstance(server, str) else server
    if (dst is None) == (stripe is None):
        raise MpsimError("give exactly one of --dst and --stripe")
    source = _endpoint(t, src, "--src")
    try:
        byte_sizes = [parse_bytes(x) for x in sizes]
    except ValueError as exc:
        raise MpsimError(f"--size: {exc}") from None
    if stripe is not None:
        peers = _peers(t, source, stripe)
        assert source != HOST  # _peers refuses it
        copies = [_striped(t, source, peers, n) for n in byte_sizes]
        return {"server": t.name, "src": source, "dst": None, "stripe": peers, "copies": copies}
    assert dst is not None  # exactly one of the two
    target = _endpoint(t, dst, "--dst")
    return {"server": t.name, "src": source, "dst": target, "stripe": None,
            "copies": [_direct(t, source, target, n) for n in byte_sizes]}


def _gpu_group(t: Topology, text: str) -> list[int]:
    """``0-7``, ``0,2,4,6`` or a mix (``0-3,6``) as GPU indices of ``t``, in the order given."""
    gpus: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise MpsimError(f"--gpus {text!r}: expected GPU indices like 0-7 or 0,2,4,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise MpsimError(f"--gpus {text!r}: range {item.strip()} runs backwards")
        gpus += range(first, last + 1)
    return gpus


def collective(server: str | Topology, op: str, sizes: Sequence[str], gpus: str | None = None,
               algorithm: str = "ring") -> dict:
    """Time, algorithm and bus bandwidth (nccl-tests' definitions) of ``op`` (all-reduce,
    reduce-scatter, all-gather, broadcast or all-to-all) on each of ``sizes`` over
    ``gpus`` (``0-7``, ``0,2,4,6``; default every GPU), alone on an idle server, as
    NCCL's ring algorithm runs it over the group's best ring, or its double binary tree
    for all-reduce (``algorithm``), or for all-to-all as NCCL's n-1 concurrent
    point-to-point sends per GPU (``algorithm`` ``p2p`` in the answer, no ring: ``ring``
    None, ``bottleneck_gbps`` the busbw its busiest link allows; ``mpsim.sim.collectives``)."""
    t = load_topology(server) if isinstance(server, str) else server
    try:
        check_op(op)
    except MpsimError:
        raise MpsimError(f"--op {op!r}: expected one of {', '.join(OPS)}") from None
    group = list(range(t.n_gpus)) if gpus is None else _gpu_group(t, gpus)
    try:
        check_group(t, group)
    except MpsimError as exc:
        raise MpsimError(f"--gpus: {exc}" if gpus is not None else str(exc)) from None
    try:
        check_algorithm(op, algorithm)
    except MpsimError as exc:
        raise MpsimError(f"--algorithm: {exc}") from None
    try:
        byte_sizes = [parse_bytes(x) for x in sizes]
    except ValueError as exc:
        raise MpsimError(f"--size: {exc}") from None
    results = [collective_time(t, op, n, group, algorithm) for n in byte_sizes]
    rows = [{"bytes": r.n_bytes, "seconds": r.time_s, "algbw_gbps": r.algbw / 1e9, "busbw_gbps": r.busbw / 1e9}
            for r in results]
    if op == "all-to-all":
        return {"server": t.name, "op": op, "algorithm": "p2p", "gpus": group, "ring": None,
                "ring_bottleneck_gbps": None, "bottleneck_gbps": all_to_all_bottleneck(t, group) / 1e9, "sizes": rows}
    ring = results[0].ring
    return {"server": t.name, "op": op, "algorithm": algorithm, "gpus": group, "ring": list(ring),
            "ring_bottleneck_gbps": ring_bottleneck(t, ring) / 1e9, "sizes": rows}
