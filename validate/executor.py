"""One pipeline stage of a plan, run for real: the torchrun worker of ``mpsim validate``.

Launched as ``torchrun --nproc-per-node P -m mpsim.executor.executor --job JOB.json``
(one process per GPU of each stage's tensor-parallel group, one per stage without, of each
data-parallel replica: ``rank = (replica * stages + stage) * t + i``, tensor innermost;
gloo on CPU, NCCL on GPUs); this folder is installed as the package ``mpsim.executor``.
Each process builds its stage's layers from ``mpsim.models.workloads`` (the modules the trace
was measured on), shards them with DTensor as ``tensor_parallel`` describes, wraps them as
the plan says (``stage_actions``; with replicas, DDP, ZeRO-1/2 or FSDP2 as
``data_parallel`` describes), and drives them with ``torch.distributed.pipelining``
(``ScheduleGPipe`` or ``Schedule1F1B``) on synthetic tokens, each replica on its own (the
ranks of a tensor-parallel group on the same ones).

Steps, in order:

1. step 0 sets up the pipeline (shape inference, receive buffers) and creates the
   gradients and Adam's states, which are static from then on; with replicas, step 1
   too (DDP lays out its gradient buckets again, in the order of the first backward, at
   the next forward);
2. the next step measures peak memory: on CPU ``torch.distributed._tools.mem_tracker.MemTracker``
   (bytes by category), capped, so a stage that outgrows its capacity fails here; on CUDA
   the caching allocator's peak, with MemTracker for the breakdown;
3. ``warmup`` untimed steps, then ``steps`` timed ones (no tracker), all processes
   starting each step together.

The stage's capacity is enforced: on CUDA with the allocator's memory fraction, on CPU
by the tracker, which raises out-of-memory when an allocation would pass it. An
out-of-memory is written as a result (stage, step, phase), not raised, under either
schedule: torch's pipelining wraps what a stage raises in its own ``RuntimeError``, so it
is found along the exception's cause chain (``out_of_memory_in``).

Writes ``rank<i>.json`` into ``--out``: the rank's replica, stage, tensor-parallel rank and
GPU, its peak, the breakdown, its step times, its model states' bytes after the last step
and, on the last stage, every step's loss (the mean over the microbatches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from mpsim.executor.data_parallel import (
    Groups,
    HostShardAdam,
    RankLayout,
    ShardedStage,
    local_bytes,
    make_groups,
    rank_layout,
    shard_module,
    sharded_optimizer,
)
from mpsim.executor.stage_actions import Recompute, Split, Swap, SwapSpace, selective, untracked
from mpsim.executor.tensor_parallel import Sharder, layer_sharder, local_loss, stage_sequence, step_context
from mpsim.executor.zero import Zero2Adam
from mpsim.models.profiler import sync_device
from mpsim.models.workloads import Embedding, LossHead, ModelConfig, TransformerLayer
from mpsim.plans.plan import PlanFile, TensorParallelPlan

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
    registered with ``track_external``; the states of ``host_optimizer`` (host memory, even
    on a CPU run) are not. The tracked bytes on ``device`` may not pass ``cap_bytes``."""

    def __init__(self, device: torch.device, cap_bytes: int | None,
                 host_optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self._cap_device = device
        self._cap_bytes = cap_bytes
        self._host_optimizer = host_optimizer

    def _track_optimizer_states(self, reftype, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self._host_optimizer:
            super()._track_optimizer_states(reftype, optimizer)

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

    def track_grads(self, grads: list[torch.Tensor]) -> None:
        """Count ``grads`` (gradient buffers that are no parameter's ``.grad``: ZeRO-2's
        slices) as gradients."""
        for g in grads:
            self._update_and_maybe_create_winfos(g, _MemRefType.GRAD)


class Head(nn.Module):
    """The loss head on fixed labels, so the stage's output is the microbatch's loss."""

    labels: torch.Tensor

    def __init__(self, head: LossHead, labels: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("labels", labels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return local_loss(self.head(x, self.labels[: x.shape[0]]))


def build_stage(cfg: ModelConfig, plan: PlanFile, stage: int, device: torch.device,
                labels: torch.Tensor, peers: dict[int, torch.device],
                shard: Sharder | None = None) -> tuple[nn.Sequential, list[nn.Parameter]]:
    """The stage's layers (each sharded by ``shard`` first, with tensor parallelism), wrapped
    as the plan says; returns the module and its parameters."""
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
        if shard is not None:
            layer = shard(layer)
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

    def host_bytes(self) -> dict[str, int]:
        """Bytes of the host copy of the weights, its gradients and Adam's states."""
        return optimizer_bytes(self.master, [m.grad for m in self.master if m.grad is not None], self.adam)


Optimizer: TypeAlias = torch.optim.Optimizer | HostAdam | Zero2Adam


def host_optimizer(opt: Optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds this rank's states in host memory (None: on the device)."""
    if isinstance(opt, HostAdam):
        return opt.adam
    if isinstance(opt, Zero2Adam) and opt.host is not None:
        return opt.host.adam
    return opt if isinstance(opt, HostShardAdam) else None


def local_optimizer(opt: Optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds this rank's states on the device (None: on the host)."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        return opt.optim
    if isinstance(opt, Zero2Adam):
        return None if opt.host is not None else opt.adam
    if isinstance(opt, (HostAdam, HostShardAdam)):
        return None
    return opt


class Stepper:
    """One training step of this stage (the pipeline's step, then the optimizer's), and
    where the run is for an out-of-memory's record: ``step_no`` and ``phase``. The last
    stage records each step's loss (the mean over its microbatches) in ``losses``."""

    def __init__(self, schedule: ScheduleGPipe | Schedule1F1B, opt: Optimizer, tokens: torch.Tensor, stage: int,
                 n_stages: int, tp: TensorParallelPlan | None = None) -> None:
        self.schedule, self.opt, self.tokens = schedule, opt, tokens
        self.stage, self.n_stages = stage, n_stages
        self.tp = tp
        self.phase = "setup"
        self.step_no = 0
        self.losses: list[float] = []

    def __call__(self) -> None:
        self.phase = "pipeline"
        last = self.stage == self.n_stages - 1
        args = (self.tokens,) if self.stage == 0 else ()
        target = self.tokens if last else None
        losses: list[torch.Tensor] = []
        with step_context(self.tp):
            self.schedule.step(*args, target=target, losses=losses if last else None, return_outputs=False)
        if last:
            self.losses.append(float(torch.stack([x.detach() for x in losses]).mean()))
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


LR = 1e-4


def replica_tokens(cfg: ModelConfig, plan: PlanFile, replica: int) -> torch.Tensor:
    """The step's synthetic tokens (every microbatch) of one replica; replicas differ."""
    b, m = plan.microbatch, plan.microbatches
    return torch.randint(0, cfg.vocab, (b * m, cfg.seq_len), generator=torch.Generator().manual_seed(1 + replica))


def stage_io(cfg: ModelConfig, plan: PlanFile, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of one microbatch at ``stage`` (meta tensors), so that torch's
    pipelining knows the shapes without its inference forward and backward: that extra
    backward on step 0 would register every parameter twice in DDP's bucket order (and its
    meta forward cannot run DTensor's collectives). Under sequence parallelism the hidden
    states are the rank's shard of the sequence."""
    b, (first, end) = plan.microbatch, plan.stages[stage].layers
    seq = stage_sequence(cfg, plan.tensor_parallel)
    hidden = torch.empty(b, seq, cfg.hidden, device="meta", requires_grad=True)
    tokens = torch.empty(b, cfg.seq_len, dtype=torch.long, device="meta")
    loss = torch.empty((), device="meta", requires_grad=True)
    return tokens if first == 0 else hidden, loss if end == cfg.layers + 2 else hidden


def build_pipeline(plan: PlanFile, cfg: ModelConfig, layout: RankLayout, groups: Groups,
                   device: torch.device) -> tuple[nn.Module, Stepper]:
    """This rank's module and optimizer (on the host for ``host-update``; sharded as the
    plan's ZeRO stage says), driven by torch's GPipe or 1F1B schedule on its replica's
    synthetic tokens."""
    s, m = layout.stage, plan.microbatches
    tokens = replica_tokens(cfg, plan, layout.replica)
    labels = tokens[: plan.microbatch].to(device)
    peers = {g: torch.device("cuda", g) for g in range(torch.cuda.device_count())} if device.type == "cuda" else {}
    shard = layer_sharder(cfg, plan.tensor_parallel, groups.tensor)
    built, params = build_stage(cfg, plan, s, device, labels, peers, shard)
    module: nn.Module = built
    dp = plan.data_parallel
    if dp is not None:
        module = shard_module(built, dp, groups.data, device)
    on_host = plan.stages[s].optimizer == "host-update"
    if dp is not None and (dp.zero_stage >= 2 or not on_host):
        opt: Optimizer = sharded_optimizer(module, dp, groups.data, LR, m, host=on_host)
    elif on_host:
        opt = HostAdam(params, lr=LR)
    else:
        opt = torch.optim.Adam(params, lr=LR, foreach=False)
    given = dp is not None or plan.tensor_parallel is not None
    example_in, example_out = stage_io(cfg, plan, s) if given else (None, None)
    if dp is not None and dp.zero_stage == 3:
        stage: PipelineStage = ShardedStage(module, s, layout.n_stages, device, example_in, example_out,
                                            group=groups.pipeline, reshard_after_forward=dp.reshard_after_forward)
    else:
        stage = PipelineStage(module, s, layout.n_stages, device, example_in, example_out, group=groups.pipeline)
    schedule_cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=lambda out, _target: out)
    return module, Stepper(schedule, opt, tokens.to(device), s, layout.n_stages, plan.tensor_parallel)


def peak_breakdown(snap: dict) -> dict[str, int]:
    """A MemTracker snapshot's bytes by our categories (``_CATEGORY``), its total left out."""
    breakdown: dict[str, int] = {}
    for key, n in snap.items():
        name = getattr(key, "value", key)
        if name != "Total":
            cat = _CATEGORY.get(name, "activations")
            breakdown[cat] = breakdown.get(cat, 0) + int(n)
    return breakdown


def measure_peak(step: Stepper, module: nn.Module, device: torch.device, cap: int | None) -> dict:
    """Step 1 under the tracker (capped at ``cap`` bytes on the CPU): the tracker's peak, the
    peak (the caching allocator's on CUDA) and its breakdown."""
    use_cuda = device.type == "cuda"
    opt = local_optimizer(step.opt)
    tracker = CappedMemTracker(device, None if use_cuda else cap, host_optimizer(step.opt))
    on_device = [] if isinstance(step.opt, HostShardAdam) else [module]  # FSDP2's offloaded shards are host memory
    tracker.track_external(*on_device, *([opt] if opt is not None else []))
    if isinstance(step.opt, Zero2Adam):
        tracker.track_grads(step.opt.grad_shards())
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
            "reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if use_cuda else None,
            "breakdown": peak_breakdown(snap)}


def time_steps(step: Stepper, device: torch.device, warmup: int, steps: int) -> list[float]:
    """``warmup`` untimed steps, then the times of ``steps`` timed ones, all processes
    starting each step together."""
    times: list[float] = []
    first = step.step_no + 1
    for i in range(warmup + steps):
        step.step_no = first + i
        dist.barrier()
        sync_device(device)
        t0 = time.perf_counter()
        step()
        sync_device(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def optimizer_bytes(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    opt: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of ``params``, ``grads`` and ``opt``'s states (local shards where sharded)."""
    states = [] if opt is None else [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(local_bytes(p) for p in params), "grads": sum(local_bytes(g) for g in grads),
            "optimizer": sum(local_bytes(v) for v in states)}


NOTHING = {"params": 0, "grads": 0, "optimizer": 0}


def model_state_bytes(module: nn.Module, opt: Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer states on its device
    (shards where they are sharded), read off the tensors themselves."""
    if isinstance(opt, HostShardAdam):
        return dict(NOTHING)
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    if isinstance(opt, Zero2Adam):
        grads += opt.grad_shards()
    return optimizer_bytes(params, grads, local_optimizer(opt))


def host_state_bytes(module: nn.Module, opt: Optimizer) -> dict[str, int]:
    """The same in host memory: a host optimizer's copy of the weights, its gradients and
    states (FSDP2's offloaded shards, ZeRO-Offload's master slices, ``HostAdam``'s copy)."""
    if isinstance(opt, HostShardAdam):
        params = list(module.parameters())
        return optimizer_bytes(params, [p.grad for p in params if p.grad is not None], opt)
    if isinstance(opt, Zero2Adam) and opt.host is not None:
        return opt.host.host_bytes()
    return opt.host_bytes() if isinstance(opt, HostAdam) else dict(NOTHING)


def params_digest(module: nn.Module) -> str:
    """SHA-256 of the stage's whole parameters (sharded ones gathered: a collective every
    rank of the data-parallel group runs, in the same order)."""
    h = hashlib.sha256()
    for p in module.parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(whole.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def train(job: dict, step: Stepper, module: nn.Module, device: torch.device, result: dict) -> None:
    """The module doc's steps into ``result``: the setup steps, the step that measures the
    peak, then the timed steps; the model states' bytes (and, when the job asks, a digest
    of the parameters) after the last."""
    setup_steps = 1 if job["plan"].get("data_parallel") is None else 2
    for i in range(setup_steps):
        step.step_no = i
        step()  # builds the pipeline's buffers, the gradients and Adam's states (and DDP's buckets)
    step.step_no = setup_steps
    result.update(measure_peak(step, module, device, job.get("capacity_bytes")))
    times = time_steps(step, device, job["warmup"], job["steps"])
    result["step_times_s"] = times
    result["step_s"] = statistics.median(times)
    result["model_state_bytes"] = model_state_bytes(module, step.opt)
    result["host_state_bytes"] = host_state_bytes(module, step.opt)
    result["losses"] = step.losses
    if job.get("digests"):
        result["params_sha256"] = params_digest(module)


def oom_record(oom: BaseException, step: Stepper, gpu: int) -> dict:
    """Where this stage ran out of memory: its step, phase (with the pass, for the CPU
    tracker's) and the error's first line."""
    where = step.phase
    if where == "pipeline" and isinstance(oom, StageOutOfMemory):
        where = f"pipeline {str(oom).split()[0]}"
    return {"stage": step.stage, "gpu": gpu, "step": step.step_no, "phase": where,
            "message": str(oom).splitlines()[0][:300]}


def run(job: dict, out_dir: Path) -> dict:
    if "hf_config" in job["model"]:  # a Hugging Face mixture of experts: expert_parallel.py's worker
        from mpsim.executor.expert_parallel import run as run_moe

        return run_moe(job, out_dir)
    rank = int(os.environ["RANK"])
    plan = PlanFile.model_validate(job["plan"])
    if plan.context > 1:  # ring attention
        from mpsim.executor.context_parallel import run as run_cp

        return run_cp(job, out_dir)
    cfg = ModelConfig(**job["model"])
    layout = rank_layout(plan, rank, int(os.environ["WORLD_SIZE"]))
    gpu = layout.gpu(plan)
    device = init_process(job, gpu)
    module, step = build_pipeline(plan, cfg, layout, make_groups(plan, device), device)
    tokens = replica_tokens(cfg, plan, layout.replica)
    result: dict = {"rank": rank, "replica": layout.replica, "stage": layout.stage, "tp_rank": layout.tp_rank,
                    "gpu": gpu,
                    "layers": list(plan.stages[layout.stage].layers), "device": str(device), "oom": None,
                    "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}
    return train_and_record(job, step, module, device, result, out_dir)


def train_and_record(job: dict, step: Stepper, module: nn.Module, device: torch.device, result: dict, out_dir: Path,
                     finished: Callable[[dict], None] | None = None) -> dict:
    """This rank's measured run (``train``) into ``result``, an out-of-memory recorded as a
    result; ``finished`` adds to a run that ended; ``rank<i>.json`` written. After an
    out-of-memory the process ends at once: the other ranks wait on this one and torchrun
    stops them."""
    try:
        train(job, step, module, device, result)
    except Exception as exc:
        oom = out_of_memory_in(exc)
        if oom is None:
            raise
        result["oom"] = oom_record(oom, step, result["gpu"])
    if result["oom"] is None and finished is not None:
        finished(result)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["oom"] is not None:
        os._exit(3)
    dist.barrier()
    dist.destroy_process_group()
    return result


def token_ids(vocab: int, seq_len: int, plan: PlanFile, replica: int) -> torch.Tensor:
    """A step's synthetic tokens of one replica of a Hugging Face model's job (every
    microbatch); replicas differ."""
    b, m = plan.microbatch, plan.microbatches
    return torch.randint(0, vocab, (b * m, seq_len), generator=torch.Generator().manual_seed(1 + replica))


def accumulated_loss(module: nn.Module, tokens: torch.Tensor, plan: PlanFile) -> float:
    """Each microbatch's forward and backward in turn on one stage (gradients accumulated,
    the loss scaled by 1/m); the step's mean loss."""
    b, m = plan.microbatch, plan.microbatches
    total = 0.0
    for i in range(m):
        loss = module(tokens[i * b:(i + 1) * b])
        (loss / m).backward()
        total += float(loss.detach())
    return total / m


def worker_main(run_job: Callable[[dict, Path], object], description: str, written_by: str) -> None:
    """A torchrun worker's entry: ``--job JOB.json --out DIR``, ``run_job(job, DIR)``; a
    failing rank writes its traceback to ``DIR/rank<i>.error.txt`` before it raises."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--job", required=True, type=Path, help=f"job JSON written by {written_by}")
    ap.add_argument("--out", required=True, type=Path, help="folder for rank<i>.json")
    args = ap.parse_args()
    job = json.loads(args.job.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run_job(job, args.out)
    except Exception:
        rank = os.environ.get("RANK", "?")
        (args.out / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise


def main() -> None:
    worker_main(run, __doc__.splitlines()[0], "mpsim validate")


if __name__ == "__main__":
    main()
