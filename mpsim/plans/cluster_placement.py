"""A parallel layout laid onto a cluster of servers: the mesh's ranks in Megatron-LM's
order, the innermost axis (tensor) inside a server, as the engine simulates it
(``ClusterPlacement``, ``place_on_cluster``). One server's GPUs are chosen by
``mpsim.sim.placement``, which searches them."""

from __future__ import annotations

from dataclasses import dataclass

from mpsim.errors import MpsimError
from mpsim.plans.mesh import DeviceMesh


@dataclass(frozen=True)
class ClusterPlacement:
    """Where a job's GPUs sit in a cluster, in Megatron-LM's order (rank = tensor rank +
    t x (replica + d x stage); server = rank // G), as the engine simulates it: the view's
    servers are those of replica 0's stages; ``replicas`` and ``groups`` list, in view GPU
    indices, the data-parallel replicas that share those servers (``local``); every stage's
    data-parallel group spans ``across`` servers, ``local`` of its GPUs on each."""

    servers: int
    """Servers in the view (those holding replica 0's stages)."""
    local: int
    across: int
    replicas: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[tuple[int, ...], ...], ...]


def place_on_cluster(gpus_per_server: int, mesh: DeviceMesh) -> ClusterPlacement:
    """The placement of ``mesh``'s GPUs filling whole servers of ``gpus_per_server`` (class
    doc): rank r on GPU r, the mesh's innermost axis (tensor) inside a server; a stage's
    replicas are its GPUs' coordinates on every axis but tensor and pipeline. One line
    when they do not fill whole servers."""
    g = gpus_per_server
    tensor, stages = mesh.size_of("tensor"), mesh.size_of("pipeline")
    rest = tuple(n for n in mesh.names if n not in ("tensor", "pipeline"))
    data = mesh.size_of(*rest)
    per_stage = data * tensor
    if g % tensor:
        raise MpsimError(f"tensor parallelism stays inside a server: TP x{tensor} does not divide its {g} GPUs")
    if per_stage % g and g % per_stage:
        raise MpsimError(f"a stage's {per_stage} GPUs (data x tensor) neither fill whole {g}-GPU servers nor "
                         "share one evenly")
    if per_stage < g and stages % (g // per_stage):
        raise MpsimError(f"{stages} stages of {per_stage} GPUs do not fill whole {g}-GPU servers")
    local = min(data, g // tensor)
    stage_server = [per_stage * s // g for s in range(stages)]
    first = {server: i for i, server in enumerate(dict.fromkeys(stage_server))}
    replica_of = DeviceMesh(tuple((n, mesh.size_of(n)) for n in rest))

    def gpu(r: int, s: int, i: int) -> int:
        rank = mesh.rank({"tensor": i, "pipeline": s, **replica_of.coords(r)})
        return first[rank // g] * g + rank % g

    groups = tuple(tuple(tuple(gpu(r, s, i) for i in range(tensor)) for s in range(stages)) for r in range(local))
    replicas = tuple(tuple(group[0] for group in replica) for replica in groups)
    return ClusterPlacement(len(first), local, data // local, replicas, groups)
