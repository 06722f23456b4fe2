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


Optimizer = torch.optim.Optimizer | HostAdam


class Stepper:
    """One training step of this stage (the pipeline's step, then the optimizer's), and
    where the run is for an out-of-memory's record: ``step_no`` and ``phase``."""

    def __init__(self, schedule: ScheduleGPipe | Schedule1F1B, opt: Optimizer, tokens: torch.Tensor, rank: int,
                 world: int) -> None:
        self.schedule, self.opt, self.tokens = schedule, opt, tokens
        self.rank, self.world = rank, world
        self.phase = "setup"
        self.step_no = 0

    def __call__(self) -> None:
        self.phase = "pipeline"
        args = (self.tokens,) if self.rank == 0 else ()
        target = self.tokens if self.rank == self.world - 1 else None
        self.schedule.step(*args, target=target, return_outputs=False)
        self.phase = "optimizer"
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.phase = "between steps"


def init_process(job: dict, gpu: int) -> torch.device:
    """Join the process group on this stage's device (NCCL on GPU ``gpu``, gloo on the CPU
    with the job's threads), seed torch and cap the device's memory at the job's capacity."""
    use_cuda = job["device"].startswith("cuda")
    device = torch.device("cuda", gpu) if use_cuda else torch.device("cpu")
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
    return device


def build_pipeline(plan: PlanFile, cfg: ModelConfig, rank: int, world: int,
                   device: torch.device) -> tuple[nn.Sequential, Stepper]:
    """This stage's module and optimizer (on the host for ``host-update``), driven by torch's
    GPipe or 1F1B schedule on synthetic tokens."""
    use_cuda = device.type == "cuda"
    b, m = plan.microbatch, plan.microbatches
    tokens = torch.randint(0, cfg.vocab, (b * m, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    labels = tokens[:b].to(device)
    peers = {s.gpu: torch.device("cuda", s.gpu) for s in plan.stages} if use_cuda else {}
    module, params = build_stage(cfg, plan, rank, device, labels, peers)
    if plan.stages[rank].optimizer == "host-update":
        opt: Optimizer = HostAdam(params, lr=1e-4)
    else:
        opt = torch.optim.Adam(params, lr=1e-4, foreach=False)
    stage = PipelineStage(module, rank, world, device)
    schedule_cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=lambda out, _target: out)
    return module, Stepper(schedule, opt, tokens.to(device), rank, world)


def peak_breakdown(snap: dict) -> dict[str, int]:
    """A MemTracker snapshot's bytes by our categories (``_CATEGORY``), its total left out."""
    breakdown: dict[str, int] = {}
    for key, n in snap.items():
        name = getattr(key, "value", key)
        if name != "Total":
            cat = _CATEGORY.get(name, "activations")
            breakdown[cat] = breakdown.get(cat, 0) + int(n)
    return breakdown


def measure_peak(step: Stepper, module: nn.Sequential, device: torch.device, cap: int | None) -> dict:
    """Step 1 under the tracker (capped at ``cap`` bytes on the CPU): the tracker's peak, the
    peak (the caching allocator's on CUDA) and its breakdown."""
    use_cuda = device.type == "cuda"
    opt = step.opt
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
    return {"tracker_peak_bytes": int(snap["Total"]),
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)) if use_cuda else int(snap["Total"]),
            "breakdown": peak_breakdown(snap)}


def time_steps(step: Stepper, device: torch.device, warmup: int, steps: int) -> list[float]:
    """``warmup`` untimed steps, then the times of ``steps`` timed ones, all processes
    starting each step together."""
    times: list[float] = []
    for i in range(warmup + steps):
        step.step_no = 2 + i
        dist.barrier()
        sync_device(device)
        t0 = time.perf_counter()
        step()
        sync_device(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def train(job: dict, step: Stepper, module: nn.Sequential, device: torch.device, result: dict) -> None:
    """The module doc's steps into ``result``: step 0 sets up, step 1 measures the peak,
    then the timed steps."""
    step()  # builds the pipeline's buffers, the gradients and Adam's states
    step.step_no = 1
    result.update(measure_peak(step, module, device, job.get("capacity_bytes")))
    times = time_steps(step, device, job["warmup"], job["steps"])
    result["step_times_s"] = times
    result["step_s"] = statistics.median(times)


def oom_record(oom: BaseException, step: Stepper, gpu: int) -> dict:
    """Where this stage ran out of memory: its step, phase (with the pass, for the CPU
    tracker's) and the error's first line."""
    where = step.phase
    if where == "pipeline" and isinstance(oom, StageOutOfMemory):
        where = f"pipeline {str(oom).split()[0]}"
    return {"stage": step.rank, "gpu": gpu, "step": step.step_no, "phase": where,
            "message": str(oom).splitlines()[0][:300]}


def run(job: dict, out_dir: Path) -> dict:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    plan = PlanFile.model_validate(job["plan"])
    cfg = ModelConfig(**job["model"])
    if world != len(plan.stages):
        raise SystemExit(f"the plan has {len(plan.stages)} stages but {world} processes were started")
    st = plan.stages[rank]
    device = init_process(job, st.gpu)
    module, step = build_pipeline(plan, cfg, rank, world, device)
    result: dict = {"stage": rank, "gpu": st.gpu, "layers": list(st.layers), "device": str(device), "oom": None}
    try:
        train(job, step, module, device, result)
    except Exception as exc:
        oom = out_of_memory_in(exc)
        if oom is None:
            raise
        result["oom"] = oom_record(oom, step, st.gpu)
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
