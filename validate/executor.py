"""One pipeline stage of a plan, run for real: the torchrun worker of ``mpsim validate``.

Launched as ``torchrun --nproc-per-node P -m mpsim.executor.executor --job JOB.json``
(one process per stage; gloo on CPU, NCCL on GPUs); this folder is installed as the
package ``mpsim.executor``. Each process builds its stage's layers from
``mpsim.workloads`` (the modules the trace was measured on), wraps them as the plan says
(``stage_actions``), and drives them with ``torch.distributed.pipelining``
(``ScheduleGPipe`` or ``Schedule1F1B``) on synthetic tokens.

Steps, in order:

1. step 0 sets up the pipeline (shape inference, receive buffers) and creates the
   gradients and Adam's states, which are static from then on;
2. step 1 measures peak memory: on CPU ``torch.distributed._tools.mem_tracker.MemTracker``
   (bytes by category), capped, so a stage that outgrows its capacity fails here; on CUDA
   the caching allocator's peak, with MemTracker for the breakdown;
3. ``warmup`` untimed steps, then ``steps`` timed ones (no tracker), all processes
   starting each step together.

The stage's capacity is enforced: on CUDA with the allocator's memory fraction, on CPU
by the tracker, which raises out-of-memory when an allocation would pass it. An
out-of-memory is written as a result (stage, step, phase), not raised, under either
schedule: torch's pipelining wraps what a stage raises in its own ``RuntimeError``, so it
is found along the exception's cause chain (``out_of_memory_in``).

Writes ``stage<i>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from mpsim.executor.stage_actions import Recompute, Split, Swap, SwapSpace, selective, untracked
from mpsim.plan import PlanFile
from mpsim.profiler import sync_device
from mpsim.workloads import Embedding, LossHead, ModelConfig, TransformerLayer

_CATEGORY = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Buffer": "activations",
             "Activation": "activations", "Temp": "activations", "Other": "activations", "Input": "activations"}


class StageOutOfMemory(RuntimeError):
    pass


def out_of_memory_in(exc: BaseException) -> BaseException | None:
    """The out-of-memory behind ``exc``, if any.

    ``torch.distributed.pipelining`` wraps what a stage's forward or backward raises in
    its own ``RuntimeError`` (1F1B's steps, and GPipe's backward), so the stage's
    out-of-memory is found along the ``__cause__`` / ``__context__`` chain."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (torch.OutOfMemoryError, StageOutOfMemory)):
            return e
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return None


def _pass_name() -> str:
    """``backward`` inside autograd's backward pass, else ``forward``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class CappedMemTracker(MemTracker):
    """MemTracker for a whole pipeline step: device totals by category only, capped.

    The per-module statistics are off (a stage's modules run once per microbatch, which
    MemTracker's per-module view refuses); parameters, gradients and optimizer states are
    registered with ``track_external``. The tracked bytes on ``device`` may not pass
    ``cap_bytes``."""

    def __init__(self, device: torch.device, cap_bytes: int | None) -> None:
        super().__init__()
        self._cap_device = device
        self._cap_bytes = cap_bytes

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        if self._cap_bytes is None:
            return
        used = self._curr_mem_snap.get(self._cap_device, {}).get("Total", 0)
        if used > self._cap_bytes:
            raise StageOutOfMemory(f"{_pass_name()} tried to hold {used} bytes on a {self._cap_bytes}-byte device")


class Head(nn.Module):
    """The loss head on fixed labels, so the stage's output is the microbatch's loss."""

    labels: torch.Tensor

    def __init__(self, head: LossHead, labels: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("labels", labels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x, self.labels[: x.shape[0]])


def build_stage(cfg: ModelConfig, plan: PlanFile, stage: int, device: torch.device,
                labels: torch.Tensor, peers: dict[int, torch.device]) -> tuple[nn.Sequential, list[nn.Parameter]]:
    """The stage's layers, wrapped as the plan says; returns the module and its parameters."""
    st = plan.stages[stage]
    a, b = st.layers
    n_model = cfg.layers + 2
    actions = plan.action_of(stage)
    mods: list[nn.Module] = []
    previous_swap: Swap | None = None
    for j in range(a, b):
        if j == 0:
            layer: nn.Module = Embedding(cfg)
        elif j == n_model - 1:
            layer = Head(LossHead(cfg), labels)
        else:
            layer = TransformerLayer(cfg)
        layer = layer.to(device)
        act = actions.get(j)
        if act is not None and act.split > 1:
            layer = Split(layer, act.split)
        if act is not None and act.action == "recompute":
            layer = Recompute(layer)
        elif act is not None and act.action == "selective":
            layer = selective(layer)
        elif act is not None and act.action in ("host", "peer"):
            stripes = [(peers[x.gpu], x.fraction) for x in act.peers]
            swap = Swap(layer, SwapSpace(device, act.action, stripes))
            swap.previous, previous_swap = previous_swap, swap
            layer = swap
        mods.append(layer)
    module = nn.Sequential(*mods)
    return module, list(module.parameters())


class HostAdam:
    """Optimizer states off the device (plan ``optimizer: host-update``, ZeRO-Offload style):
    gradients go to host memory, Adam updates a host copy of the weights, weights come back."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params = params
        with untracked():
            self.master = [p.detach().to("cpu", copy=True) for p in params]
            for m in self.master:
                m.grad = torch.zeros_like(m)
            self.adam = torch.optim.Adam(self.master, lr=lr, foreach=False)

    def step(self) -> None:
        with untracked(), torch.no_grad():
            for p, m in zip(self.params, self.master):
                assert m.grad is not None
                if p.grad is not None:
                    m.grad.copy_(p.grad)
            self.adam.step()
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()


def run(job: dict, out_dir: Path) -> dict:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    cfg = ModelConfig(**job["model"])
    if world != len(plan.stages):
        raise SystemExit(f"the plan has {len(plan.stages)} stages but {world} processes were started")
    st = plan.stages[rank]
    use_cuda = job["device"].startswith("cuda")
    device = torch.device("cuda", st.gpu) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(job["threads"])
    dist.init_process_group("nccl" if use_cuda else "gloo")
    torch.manual_seed(job["seed"])
    cap = job.get("capacity_bytes")
    if use_cuda and cap:
        device_bytes = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / device_bytes), device)
    b, m = plan.microbatch, plan.microbatches
    tokens = torch.randint(0, cfg.vocab, (b * m, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    labels = tokens[:b].to(device)
    peers = {s.gpu: torch.device("cuda", s.gpu) for s in plan.stages} if use_cuda else {}
    module, params = build_stage(cfg, plan, rank, device, labels, peers)
    if st.optimizer == "host-update":
        opt: torch.optim.Optimizer | HostAdam = HostAdam(params, lr=1e-4)
    else:
        opt = torch.optim.Adam(params, lr=1e-4, foreach=False)
    stage = PipelineStage(module, rank, world, device)
    schedule_cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=lambda out, _target: out)
    tokens = tokens.to(device)
    phase = {"name": "setup"}

    def step() -> None:
        phase["name"] = "pipeline"
        args = (tokens,) if rank == 0 else ()
        target = tokens if rank == world - 1 else None
        schedule.step(*args, target=target, return_outputs=False)
        phase["name"] = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=False)
        phase["name"] = "between steps"

    result: dict = {"stage": rank, "gpu": st.gpu, "layers": list(st.layers), "device": str(device), "oom": None}
    step_no = 0
    try:
        step()  # builds the pipeline's buffers, the gradients and Adam's states
        step_no = 1
        tracker = CappedMemTracker(device, None if use_cuda else cap)
        tracker.track_external(module, *([opt] if isinstance(opt, torch.optim.Optimizer) else []))
        if use_cuda:
            sync_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        with tracker:
            step()
        sync_device(device)
        snap = tracker.get_tracker_snapshot("peak")[device]
        breakdown: dict[str, int] = {}
        for key, n in snap.items():
            name = getattr(key, "value", key)
            if name != "Total":
                cat = _CATEGORY.get(name, "activations")
                breakdown[cat] = breakdown.get(cat, 0) + int(n)
        result["tracker_peak_bytes"] = int(snap["Total"])
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated(device)) if use_cuda else int(snap["Total"])
        result["breakdown"] = breakdown
        del tracker
        times: list[float] = []
        for i in range(job["warmup"] + job["steps"]):
            step_no = 2 + i
            dist.barrier()
            sync_device(device)
            t0 = time.perf_counter()
            step()
            sync_device(device)
            if i >= job["warmup"]:
                times.append(time.perf_counter() - t0)
        result["step_times_s"] = times
        result["step_s"] = statistics.median(times)
    except Exception as exc:
        oom = out_of_memory_in(exc)
        if oom is None:
            raise
        where = phase["name"]
        if where == "pipeline" and isinstance(oom, StageOutOfMemory):
            where = f"pipeline {str(oom).split()[0]}"
        result["oom"] = {"stage": rank, "gpu": st.gpu, "step": step_no, "phase": where,
                         "message": str(oom).splitlines()[0][:300]}
    (out_dir / f"stage{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["oom"] is not None:
        os._exit(3)  # the other stages wait on this one; torchrun stops them
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, type=Path, help="job JSON written by mpsim validate")
    ap.add_argument("--out", required=True, type=Path, help="folder for stage<i>.json")
    args = ap.parse_args()
    job = json.loads(args.job.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run(job, args.out)
    except Exception:
        rank = os.environ.get("RANK", "?")
        (args.out / f"stage{rank}.error.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
