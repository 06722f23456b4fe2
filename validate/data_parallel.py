"""Data-parallel replicas of a plan's pipeline in the executor (plan schema 2, ``data_parallel``).

Rank layout: ``rank = (replica * n_stages + stage) * t + i`` with ``t`` the tensor-parallel
degree (1 without ``tensor_parallel``) and ``i`` the rank in the stage's tensor-parallel
group: tensor innermost, then pipeline, then data, Megatron-LM's order. The world is a
(replicas, stages[, t]) grid, a ``DeviceMesh`` with dimensions ``dp``, ``pp`` (and ``tp``):
the ranks along ``pp`` are a replica's pipeline (for each tensor-parallel rank ``i``: its
process group carries the stage-to-stage sends between the ``i``-th ranks of the stages),
along ``dp`` a stage's data-parallel group, along ``tp`` a tensor-parallel group
(``tensor_parallel.py``). Rank (r, s) runs on GPU ``replicas[r][s]``, rank (r, s, i) on
``tensor_parallel.groups[r][s][i]``.

How each ZeRO stage is run (what the simulator models for it):

- 0: ``DistributedDataParallel`` (gradient buckets of ``bucket_mib``), full gradients
  and Adam's states on every rank; torch's pipelining skips the all-reduce on all but the
  last microbatch's backward (``no_sync``);
- 1: the same with ``ZeroRedundancyOptimizer`` (Adam): each rank keeps the states of the
  parameters it owns, about 1/N of them (torch assigns whole parameters, so the split is
  as even as the parameter sizes allow), and broadcasts them after its update;
- 2: ``zero.Zero2Adam``: every parameter's gradient is reduce-scattered into a 1/N slice
  as soon as it is accumulated, in every microbatch's backward;
- 3: FSDP2 ``fully_shard`` on every layer and on the stage: parameters 1/N at rest, a
  layer's whole parameters gathered before its forward and its backward, freed after its
  forward when ``reshard_after_forward``; gradients reduce-scattered after every
  microbatch's backward (``ShardedStage``).

With the optimizer on the host (``optimizer: host-update``), the offload strategies:

- ZeRO-Offload (ZeRO 2): ``Zero2Adam`` with ``host``: the gradient slice goes to the host,
  Adam updates an fp32 master slice on the CPU, the slice comes back and is all-gathered;
- ZeRO-Infinity (ZeRO 3, ``offload_params``, host memory): FSDP2 with
  ``CPUOffloadPolicy`` (pinned on CUDA; CPU runs cannot pin): sharded parameters,
  gradients and Adam's states live in host memory, each layer's shard is copied to the
  device before its all-gather, and Adam steps on the CPU (``HostShardAdam``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from mpsim.executor.stage_actions import untracked
from mpsim.executor.zero import Zero2Adam
from mpsim.plans.plan import DataParallelPlan, PlanFile


@dataclass(frozen=True)
class RankLayout:
    """Where this process sits in the (replicas, stages, tensor) grid (module doc)."""

    rank: int
    replicas: int
    n_stages: int
    tensor: int = 1

    @property
    def replica(self) -> int:
        return self.rank // (self.n_stages * self.tensor)

    @property
    def stage(self) -> int:
        return self.rank // self.tensor % self.n_stages

    @property
    def tp_rank(self) -> int:
        """This rank's place in its stage's tensor-parallel group (0 without one)."""
        return self.rank % self.tensor

    @property
    def world(self) -> int:
        return self.replicas * self.n_stages * self.tensor

    def gpu(self, plan: PlanFile) -> int:
        """The GPU this rank runs on: its stage's in replica 0, ``replicas[r][s]`` in others,
        ``groups[r][s][i]`` with tensor parallelism."""
        if plan.tensor_parallel is not None:
            return plan.tensor_parallel.groups[self.replica][self.stage][self.tp_rank]
        return plan.replica_gpus()[self.replica][self.stage]


def rank_layout(plan: PlanFile, rank: int, world: int) -> RankLayout:
    """This rank's place; the world must be replicas x stages x tensor-parallel degree."""
    layout = RankLayout(rank, plan.replicas, len(plan.stages), plan.tensor)
    if world != layout.world:
        raise SystemExit(f"the plan has {plan.replicas} replica(s) of {len(plan.stages)} stage(s) "
                         f"of {plan.tensor} GPU(s) each but {world} processes were started")
    return layout


@dataclass(frozen=True)
class Groups:
    """This rank's pipeline group (None: the whole world), its stage's data-parallel mesh
    (None without replicas) and tensor-parallel mesh (None without tensor parallelism)."""

    pipeline: dist.ProcessGroup | None
    data: DeviceMesh | None
    tensor: DeviceMesh | None = None


def make_groups(plan: PlanFile, device: torch.device) -> Groups:
    """The (dp, pp[, tp]) mesh's groups along each dimension; every rank creates all of
    them, in one order."""
    if plan.data_parallel is None and plan.tensor_parallel is None:
        return Groups(None, None)
    shape: tuple[int, ...] = (plan.replicas, len(plan.stages))
    names: tuple[str, ...] = ("dp", "pp")
    if plan.tensor_parallel is not None:
        shape, names = (*shape, plan.tensor), (*names, "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return Groups(mesh["pp"].get_group(), mesh["dp"] if plan.data_parallel is not None else None,
                  mesh["tp"] if plan.tensor_parallel is not None else None)


def shard_module(module: nn.Sequential, dp: DataParallelPlan, mesh: DeviceMesh | None,
                 device: torch.device) -> nn.Module:
    """The stage's module as its ZeRO stage runs it: DDP for 0 and 1, itself for 2 (the
    optimizer's hooks shard it), FSDP2 on every layer and the stage for 3."""
    assert mesh is not None
    if dp.zero_stage <= 1:
        return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                       process_group=mesh.get_group(), bucket_cap_mb=dp.bucket_mib,
                                       gradient_as_bucket_view=True,  # no second copy of the gradients
                                       broadcast_buffers=False)  # each replica's labels are its own
    if dp.zero_stage == 3:
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if dp.offload_params else OffloadPolicy()
        for layer in module:
            fully_shard(layer, mesh=mesh, reshard_after_forward=dp.reshard_after_forward, offload_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=dp.reshard_after_forward, offload_policy=policy)
    return module


class HostShardAdam(torch.optim.Adam):
    """Adam over FSDP2's CPU-offloaded shards (ZeRO-Infinity): its step and states are on the
    host, whose temporaries the device's tracker does not see (even on a CPU run)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        with untracked():
            return super().step(closure)


def sharded_optimizer(module: nn.Module, dp: DataParallelPlan, mesh: DeviceMesh | None, lr: float,
                      microbatches: int, host: bool = False) -> torch.optim.Optimizer | Zero2Adam:
    """Adam as the ZeRO stage shards it (module doc); ``host``: on the CPU (ZeRO 2 and 3)."""
    assert mesh is not None
    params = list(module.parameters())
    if dp.zero_stage == 1:
        return ZeroRedundancyOptimizer(params, torch.optim.Adam, process_group=mesh.get_group(), lr=lr,
                                       foreach=False)
    if dp.zero_stage == 2:
        return Zero2Adam(params, mesh.get_group(), lr, grad_divisor=microbatches, host=host)
    if host:
        return HostShardAdam(params, lr=lr, foreach=False)
    return torch.optim.Adam(params, lr=lr, foreach=False)


class ShardedStage(PipelineStage):
    """A pipeline stage whose module is FSDP2's, run as ZeRO-3 is modelled with microbatches.

    torch's own stage keeps an FSDP module's gathered parameters and unsharded gradients
    from the first microbatch's backward to the step's end and reduce-scatters once. Here
    every microbatch's backward reduce-scatters its gradients (sharded gradients
    accumulate), and parameters are freed after each backward unless
    ``reshard_after_forward`` is off, in which case they stay gathered until the step's
    last backward. Runs the full backward only (GPipe, 1F1B)."""

    def __init__(self, *args: object, reshard_after_forward: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.reshard_after_forward = reshard_after_forward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            raise NotImplementedError(f"backward {backward_type!r}: the executor runs full backwards only")
        module = self.submod
        assert isinstance(module, FSDPModule)
        module.set_is_last_backward(last_backward)
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(last_backward or self.reshard_after_forward)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """Gradients were reduce-scattered by every backward; only their scaling is left."""
        self.scale_grads(grad_scale_factor)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on this rank (a DTensor's local shard)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
