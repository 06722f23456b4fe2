"""Where the replicas of a data-parallel pipeline run: which GPUs form each stage's
data-parallel group, and in which ring order.

Every replica runs the same pipeline, so a stage's gradients are reduced (and, under
ZeRO-3, its parameters gathered) across the stage's GPUs in all replicas: that group's
ring bandwidth (``collectives.ring_bottleneck``) bounds every collective of the stage. On
an NVSwitch server every choice is the same; on the DGX-1's hybrid cube-mesh it is not
(GPUs 0-3 form a fully connected quad, 0 and 5 share no NVLink). ``place_replicas``
searches the choices on servers of up to ``EXHAUSTIVE_GPUS`` GPUs and picks the one whose
slowest group ring is fastest, then whose pipeline hops are fastest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from mpsim.hardware.cluster import Cluster
from mpsim.hardware.topology import Topology
from mpsim.plans.cluster_placement import place_on_cluster
from mpsim.plans.job import JobSpec
from mpsim.plans.mesh import DeviceMesh
from mpsim.sim.collectives import best_ring, ring_bottleneck

Replicas = tuple[tuple[int, ...], ...]
"""Per replica, the GPU of each stage; replica 0 is the pipeline the engine simulates."""
Groups = tuple[tuple[tuple[int, ...], ...], ...]
"""Per replica, per stage, the GPUs of its tensor-parallel group in ring order; the first
is the stage's GPU in ``Replicas``, the one the engine simulates."""

EXHAUSTIVE_GPUS: Final = 8
"""Servers up to this many GPUs get every grouping searched; larger ones take GPUs in order."""


@dataclass(frozen=True)
class Placed:
    """Where a job's simulated GPUs run: the topology the engine simulates (the server, or
    a cluster's view of the servers replica 0 uses), per replica on it the GPU of each
    stage and per stage its tensor-parallel group; each stage's data-parallel group spans
    ``across`` servers (``mpsim.hardware.cluster``), its GPUs on the view's server listed in
    ``replicas``."""

    topology: Topology
    replicas: Replicas
    groups: Groups
    across: int = 1


def place_job(job: JobSpec, n_stages: int) -> Placed:
    """``job``'s GPUs for ``n_stages`` stages per replica: on one server by
    ``place_groups``; on a cluster in Megatron-LM's order (``cluster_placement.place_on_cluster``),
    each tensor-parallel group in its best ring order."""
    mesh = job.parallelism.mesh(n_stages)
    if job.cluster is None:
        return Placed(job.topology, *place_groups(job.topology, mesh))
    return _place_cluster_job(job.cluster, mesh)


def replicas_of(mesh: DeviceMesh) -> int:
    """Copies of a stage in ``mesh``: its GPUs over the tensor-parallel group's, every axis
    but tensor and pipeline."""
    return mesh.size // mesh.size_of("tensor", "pipeline")


@lru_cache(maxsize=256)
def _place_cluster_job(cluster: Cluster, mesh: DeviceMesh) -> Placed:
    placed = place_on_cluster(cluster.gpus_per_server, mesh)
    view = cluster.view(placed.servers)
    groups = tuple(tuple(best_ring(view, g) if len(g) > 1 else g for g in replica) for replica in placed.groups)
    replicas = tuple(tuple(g[0] for g in replica) for replica in groups)
    return Placed(view, replicas, groups, placed.across)


def place_replicas(topo: Topology, mesh: DeviceMesh) -> Replicas:
    """The GPUs of the replicas of ``mesh``'s stages (one GPU each) on ``topo`` (checked by
    the job: the mesh's GPUs exist)."""
    return _place(topo, replicas_of(mesh), mesh.size_of("pipeline"))


@lru_cache(maxsize=256)
def _place(topo: Topology, data: int, n_stages: int) -> Replicas:
    used = data * n_stages
    if data == 1:
        return (tuple(range(n_stages)),)
    if topo.n_gpus > EXHAUSTIVE_GPUS:
        groups = [tuple(range(s * data, (s + 1) * data)) for s in range(n_stages)]
        return _replicas([best_ring(topo, g) for g in groups])
    best: tuple[float, float] | None = None
    chosen: list[tuple[int, ...]] = []
    for gpus in itertools.combinations(range(topo.n_gpus), used):
        for groups in _groupings(gpus, data):
            rings = [best_ring(topo, g) for g in groups]
            score = (min(ring_bottleneck(topo, r) for r in rings), _pipeline_bandwidth(topo, rings))
            if best is None or score > best:
                best, chosen = score, rings
    return _replicas(chosen)


def place_groups(topo: Topology, mesh: DeviceMesh) -> tuple[Replicas, Groups]:
    """Replicas and tensor-parallel groups of ``mesh`` (its replicas, every axis but tensor
    and pipeline, x tensor x pipeline GPUs) in Megatron-LM's order: the tensor-parallel
    groups first, on the fastest rings (the
    smallest ring bandwidth over the groups, highest); then which group runs which stage
    of which replica, by the data-parallel rings (every tensor rank's) and then the
    pipeline hops. Every choice is searched on servers of up to ``EXHAUSTIVE_GPUS`` GPUs;
    larger ones take blocks of consecutive GPUs (group b = stage b // data, replica
    b % data)."""
    if mesh.size_of("tensor") == 1:
        replicas = place_replicas(topo, mesh)
        return replicas, tuple(tuple((g,) for g in r) for r in replicas)
    return _place_groups(topo, replicas_of(mesh), mesh.size_of("tensor"), mesh.size_of("pipeline"))


@lru_cache(maxsize=256)
def _place_groups(topo: Topology, data: int, tensor: int, n_stages: int) -> tuple[Replicas, Groups]:
    n_groups = data * n_stages
    if topo.n_gpus > EXHAUSTIVE_GPUS:
        blocks = [best_ring(topo, range(b * tensor, (b + 1) * tensor)) for b in range(n_groups)]
        return _arranged(blocks, [tuple(range(s * data, (s + 1) * data)) for s in range(n_stages)])
    best: tuple[float, ...] | None = None
    chosen: tuple[Replicas, Groups] | None = None
    for gpus in itertools.combinations(range(topo.n_gpus), n_groups * tensor):
        for parts in _partitions(gpus, tensor):
            rings = [best_ring(topo, g) for g in parts]
            tp_bw = min(ring_bottleneck(topo, r) for r in rings)
            if best is not None and tp_bw < best[0]:
                continue
            for stage_sets in _groupings(tuple(range(n_groups)), data):
                score = (tp_bw, *_data_and_pipeline_bandwidth(topo, rings, stage_sets))
                if best is None or score > best:
                    best, chosen = score, _arranged(rings, stage_sets)
    assert chosen is not None
    return chosen


def _data_and_pipeline_bandwidth(topo: Topology, rings: list[tuple[int, ...]],
                                 stage_sets: list[tuple[int, ...]]) -> tuple[float, float]:
    """The slowest data-parallel ring over every stage and tensor rank (inf with one
    replica), and the narrowest pipeline hop of the tensor ranks 0."""
    dp_bw = float("inf")
    if len(stage_sets[0]) > 1:
        dp_bw = min(ring_bottleneck(topo, best_ring(topo, [rings[i][rank] for i in members]))
                    for members in stage_sets for rank in range(len(rings[0])))
    firsts = [tuple(rings[i][0] for i in members) for members in stage_sets]
    return dp_bw, _pipeline_bandwidth(topo, firsts)


def _arranged(rings: list[tuple[int, ...]], stage_sets: list[tuple[int, ...]]) -> tuple[Replicas, Groups]:
    """Stage s of replica r runs group ``rings[stage_sets[s][r]]``."""
    data = len(stage_sets[0])
    groups = tuple(tuple(rings[members[r]] for members in stage_sets) for r in range(data))
    return tuple(tuple(g[0] for g in replica) for replica in groups), groups


def _groupings(gpus: Sequence[int], size: int) -> Iterator[list[tuple[int, ...]]]:
    """Every way to cut ``gpus`` into groups of ``size``, in every stage order (the
    groups' order is the pipeline's, which decides its hops)."""
    for unordered in _partitions(tuple(gpus), size):
        yield from (list(p) for p in itertools.permutations(unordered))


def _partitions(gpus: tuple[int, ...], size: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    if not gpus:
        yield ()
        return
    head, rest = gpus[0], gpus[1:]
    for others in itertools.combinations(rest, size - 1):
        left = tuple(g for g in rest if g not in others)
        for tail in _partitions(left, size):
            yield ((head, *others), *tail)


def _pipeline_bandwidth(topo: Topology, rings: list[tuple[int, ...]]) -> float:
    """The narrowest pipeline hop over all replicas (replica r is member r of each ring)."""
    hops = [topo.route(a[r], b[r]).bandwidth for a, b in zip(rings, rings[1:]) for r in range(len(a))]
    return min(hops, default=0.0)


def _replicas(rings: list[tuple[int, ...]]) -> Replicas:
    return tuple(tuple(ring[r] for ring in rings) for r in range(len(rings[0])))
