"""HSDP for real: FSDP2 ``fully_shard`` on a (replicate, shard) ``DeviceMesh``, the torchrun worker.

Launched as ``torchrun --nproc-per-node 4 -m mpsim.executor.hsdp --job JOB.json --out OUT.json``
(``validate/hsdp_check.py`` writes the job and launches it). The world stands for
``replicate`` servers of ``shard`` GPUs each: rank ``r`` is GPU ``r % shard`` of server
``r // shard`` (Megatron-LM's order, as ``mpsim.plans.cluster_placement.place_on_cluster`` places a
data-parallel group), and the data mesh is
``init_device_mesh(device, (replicate, shard), mesh_dim_names=("replicate", "shard"))``:
``fully_shard`` on it shards parameters, gradients and Adam's states over the ``shard``
ranks of a server and replicates them across servers; each microbatch's gradients are
reduce-scattered inside the server, then all-reduced across servers (FSDP2's HSDP). A
one-dimensional mesh (``mesh: [4]``) is plain FSDP over the whole world, for contrast.

Everything else is the executor's (``validate/executor.py``), imported, not copied: the
job's plan is a one-stage data-parallel plan (ZeRO 3, one replica per rank), the model is
built from ``mpsim.models.workloads`` by ``build_pipeline`` (FSDP2 on every layer and the stage by
``shard_module``, here given the 2-D mesh; ``ShardedStage`` reduce-scatters every
microbatch), and ``train`` runs the setup steps, the step whose peak the CPU tracker
(MemTracker, capped at the job's capacity) measures, and the timed steps. Each replica
(rank) trains on its own tokens.

On GPUs across real servers (``torchrun --nnodes 2 --nproc-per-node 8 ...``) each rank
runs on its node's GPU ``LOCAL_RANK`` (NCCL) and rank 0 writes the file on its node.

Writes one JSON file: the mesh, the torch version and, per rank, the executor's result
(peak, breakdown, step times, model states' bytes, losses) with the rank's server and
local GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mpsim.executor.data_parallel import Groups, RankLayout, rank_layout
from mpsim.executor.executor import build_pipeline, init_process, train
from mpsim.models.workloads import ModelConfig
from mpsim.plans.plan import PlanFile

HSDP_DIMS = ("replicate", "shard")
FSDP_DIMS = ("shard",)


def data_mesh(device: torch.device, shape: list[int]) -> DeviceMesh:
    """The mesh FSDP2 shards over: (replicate, shard) for HSDP, (shard,) for FSDP."""
    if len(shape) not in (1, 2):
        raise SystemExit(f"mesh {shape}: give [replicate, shard] (HSDP) or [shard] (FSDP)")
    names = HSDP_DIMS if len(shape) == 2 else FSDP_DIMS
    return init_device_mesh(device.type, tuple(shape), mesh_dim_names=names)


def hsdp_groups(device: torch.device, shape: list[int], world: int) -> Groups:
    """This rank's one-rank pipeline group (the plan has one stage) and the data mesh; every
    rank creates both meshes, in one order."""
    pipeline = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "pp"))["pp"].get_group()
    return Groups(pipeline, data_mesh(device, shape))


def place(rank: int, shape: list[int]) -> dict[str, int]:
    """The server and local GPU a rank stands for (rank = server x GPUs per server + GPU)."""
    per_server = shape[-1] if len(shape) == 2 else 0
    if not per_server:
        return {"server": -1, "local_gpu": -1}
    return {"server": rank // per_server, "local_gpu": rank % per_server}


def check_plan_shape(plan: PlanFile, shape: list[int], world: int) -> None:
    """One stage, no tensor parallelism, ZeRO 3, one replica per rank, mesh filling the world."""
    dp = plan.data_parallel
    if len(plan.stages) != 1 or plan.tensor_parallel is not None or dp is None or dp.zero_stage != 3:
        raise SystemExit("the HSDP worker runs one-stage ZeRO-3 plans without tensor parallelism")
    size = 1
    for n in shape:
        size *= n
    if size != world or dp.degree != world:
        raise SystemExit(f"mesh {shape} and {dp.degree} replicas must fill the {world} processes started")


def run(job: dict, out: Path) -> dict | None:
    """Build, train and measure this rank (module doc); rank 0 writes every rank's result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    shape = [int(n) for n in job["mesh"]]
    check_plan_shape(plan, shape, world)
    layout: RankLayout = rank_layout(plan, rank, world)
    device = init_process(job, int(os.environ.get("LOCAL_RANK", rank)))  # across nodes: this node's GPU
    groups = hsdp_groups(device, shape, world)
    module, step = build_pipeline(plan, ModelConfig(**job["model"]), layout, groups, device)
    result: dict = {"rank": rank, "replica": layout.replica, "gpu": layout.gpu(plan), **place(rank, shape)}
    train(job, step, module, device, result)
    results: list[dict | None] = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        doc = {"mesh": shape, "mesh_dim_names": list(HSDP_DIMS if len(shape) == 2 else FSDP_DIMS),
               "torch_version": torch.__version__, "ranks": results}
        out.write_text(json.dumps(doc, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> None:
    """``--job JOB.json --out OUT.json``; a failing rank writes its traceback beside ``OUT``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, type=Path, help="job JSON written by hsdp_check (executor format + mesh)")
    ap.add_argument("--out", required=True, type=Path, help="JSON file for every rank's result")
    args = ap.parse_args()
    job = json.loads(args.job.read_text())
    try:
        run(job, args.out)
    except Exception:
        rank = os.environ.get("RANK", "?")
        args.out.with_name(f"{args.out.stem}.rank{rank}.error.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
