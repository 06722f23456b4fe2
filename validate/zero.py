"""ZeRO-2 for one pipeline stage's data-parallel group: gradients and Adam's states sharded.

ZeRO (Rajbhandari et al. 2020), section 5.2, stage P_os+g: each of the group's N ranks
owns a 1/N slice of every parameter (padded to a multiple of N) and keeps only that
slice's gradient and Adam states; parameters stay whole on every rank.

What runs, as the simulator models it:

- a parameter's full gradient exists from the end of its accumulation in the backward
  (``register_post_accumulate_grad_hook``) until its reduce-scatter (mean over the
  group) has landed in the rank's shard buffer; the full gradient is then freed. This
  happens in every microbatch's backward; the shard buffers accumulate;
- the optimizer step runs Adam on the rank's slices only (views into the parameters, so
  the update writes the parameters in place), then all-gathers every parameter's slices
  so that each rank holds the updated whole parameters.

With ``host`` (ZeRO-Offload, Ren et al. 2021; plan ``optimizer: host-update``) Adam and
its states live in host memory (``HostShards``): at the step each gradient slice is
copied to a host buffer (pinned on CUDA), Adam updates an fp32 master copy of the slice
on the CPU, and the updated slice is copied back into the parameter before the
all-gather. The gradient slices stay on the device between steps, as the simulator has
them.

The collectives are synchronous: a hook returns once its reduce-scatter has landed.
gloo (torch 2.13) has ``reduce_scatter_single`` with a mean and ``all_gather_single``, so
CPU and NCCL runs take the same path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mpsim.executor.stage_actions import untracked


class ParamShard:
    """One parameter's slice on this rank: ``chunk_numel`` elements per rank (the last
    rank's slice may be shorter, or empty), its accumulated gradient slice, and the view of
    the parameter's data that Adam updates."""

    def __init__(self, full: nn.Parameter, group_rank: int, group_size: int) -> None:
        self.full = full
        self.group_size = group_size
        self.chunk_numel = -(-full.numel() // group_size)
        start = min(group_rank * self.chunk_numel, full.numel())
        end = min(start + self.chunk_numel, full.numel())
        self.param = full.detach().view(-1)[start:end]
        """This rank's slice of the parameter's data (a view: Adam writes the parameter)."""
        self.grad = torch.zeros(self.chunk_numel, dtype=full.dtype, device=full.device)
        """The slice's gradient, accumulated over the step's microbatches."""
        self.param.grad = self.grad[: end - start]

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.group_size

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (the parameter's numel) zero-padded to ``padded_numel``."""
        extra = self.padded_numel - flat.numel()
        return flat if extra == 0 else torch.nn.functional.pad(flat, (0, extra))


class HostShards:
    """Adam on the CPU over fp32 master copies of the rank's parameter slices (ZeRO-Offload):
    ``step`` takes the slices' gradients, updates the masters and writes them back into the
    slices. Its buffers and states are host memory, kept out of the device's tracker."""

    def __init__(self, slices: list[torch.Tensor], lr: float) -> None:
        self.slices = slices
        pin = any(s.device.type == "cuda" for s in slices)
        with untracked():
            self.master = [_host_copy(s, pin) for s in slices]
            for m in self.master:
                m.grad = torch.zeros_like(m)
            self.adam = torch.optim.Adam(self.master, lr=lr, foreach=False)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        with untracked():
            for m, g in zip(self.master, grads):
                assert m.grad is not None
                m.grad.copy_(g[: m.numel()], non_blocking=True)
            if any(s.device.type == "cuda" for s in self.slices):
                torch.cuda.current_stream().synchronize()  # the gradients have landed on the host
            self.adam.step()
            for s, m in zip(self.slices, self.master):
                s.copy_(m, non_blocking=True)  # ordered before the all-gather on the same stream

    def host_bytes(self) -> dict[str, int]:
        """Bytes of the master slices, their gradients and Adam's states in host memory."""
        states = [v for st in self.adam.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": _nbytes(self.master), "grads": _nbytes([m.grad for m in self.master if m.grad is not None]),
                "optimizer": _nbytes(states)}


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = t.detach().to("cpu", dtype=torch.float32, copy=True)
    return host.pin_memory() if pin else host


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Zero2Adam:
    """Adam with ZeRO-2 sharding over ``group`` (module doc); ``grad_divisor`` divides the
    accumulated gradient slices before the update (the microbatches, whose losses are means);
    ``host``: Adam on the CPU (``HostShards``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, lr: float, grad_divisor: int,
                 host: bool = False) -> None:
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shards = {p: ParamShard(p, rank, size) for p in params}
        self.grad_divisor = grad_divisor
        owned = [s for s in self.shards.values() if s.param.numel() > 0]
        self.host = HostShards([s.param for s in owned], lr) if host else None
        self._owned_grads = [s.grad for s in owned]
        self.adam = self.host.adam if self.host else torch.optim.Adam([s.param for s in owned], lr=lr, foreach=False)
        for p in params:
            p.register_post_accumulate_grad_hook(self._reduce_scatter)

    def _reduce_scatter(self, p: torch.Tensor) -> None:
        """The full gradient of ``p`` reduce-scattered (mean) into this rank's slice, then freed."""
        assert isinstance(p, nn.Parameter) and p.grad is not None
        shard = self.shards[p]
        landed = torch.empty_like(shard.grad)
        dist.reduce_scatter_single(landed, shard.padded(p.grad.reshape(-1)), op=dist.ReduceOp.AVG, group=self.group)
        p.grad = None
        shard.grad.add_(landed)

    @torch.no_grad()
    def step(self) -> None:
        """Adam on the slices, then every parameter gathered whole again."""
        if self.grad_divisor != 1:
            for s in self.shards.values():
                s.grad.div_(self.grad_divisor)
        if self.host is not None:
            self.host.step(self._owned_grads)
        else:
            self.adam.step()
        for p, s in self.shards.items():
            mine = s.param.new_zeros(s.chunk_numel)  # a copy: the gather writes where the slice lives
            mine[: s.param.numel()] = s.param
            whole = p.detach().view(-1) if s.padded_numel == p.numel() else p.new_empty(s.padded_numel)
            dist.all_gather_single(whole, mine, group=self.group)
            if whole.data_ptr() != p.data_ptr():
                p.detach().view(-1).copy_(whole[: p.numel()])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient slices (they are kept from one step to the next, like the
        executor's other optimizers' gradients)."""
        for s in self.shards.values():
            s.grad.zero_()

    def grad_shards(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.values()]
