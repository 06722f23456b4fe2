"""``mpsim validate``: run a plan for real and compare it with the simulator's prediction.

The loop is "profile here, simulate, run here": a trace measured on the device at hand
(``mpsim.models.profiler``), a topology probed on it (``mpsim.models.probe``), the plan simulated with
both, and the same plan executed by the executor (``validate/executor.py`` in the
repository, installed as ``mpsim.executor.executor``) under torchrun (one process per
stage of each data-parallel replica). Per GPU the plan runs on (each stage of each
replica) it reports predicted against measured peak memory (with the breakdown: weights,
gradients, optimizer states, everything else) and the iteration time, and the error in
percent: ``(predicted - measured) / measured``.

The executor runs on ``torch.distributed.pipelining``, whose ``PipelineStage`` keeps one
activation and one gradient receive buffer per microbatch, so the job is simulated with
``runtime="torch-pipelining"``.

Tensor-parallel plans (schema 3) run with DTensor (``validate/tensor_parallel.py``), one
process per GPU of every stage's group: ``rank = (replica * stages + stage) * t + i``
(tensor innermost), rank (r, s, i) on GPU ``tensor_parallel.groups[r][s][i]``
(``rank_grid``). Each rank is compared with the simulator's prediction for its own GPU
(``SimResult.gpus[g]``: the simulator predicts every GPU of a group as the group's first).

What the executor does not run is refused before anything starts: PipeDream's asynchronous
schedule and host-streamed optimizer (no counterpart in torch's pipelining), splits other
than along the batch, peer swaps without GPUs, precision other than fp32 on CPU, a host
optimizer with ZeRO 1, and ZeRO 3's offload other than ZeRO-Infinity's to host memory: a
host optimizer with ZeRO 2 runs as ZeRO-Offload, with ZeRO 3 as ZeRO-Infinity (parameter
shards offloaded too, FSDP2's ``CPUOffloadPolicy``), never one without the other, and
never to NVMe. With tensor parallelism: BERT, a degree that does not divide the heads, KV
heads, MLP, vocabulary (and, sequence-parallel, the sequence), data parallelism other than
FSDP2 (ZeRO 3), an optimizer off the device, and swaps.

Ctrl-C or SIGTERM during the run ends it whole (``_end_run``): torchrun runs in a process
group of its own and starts each rank in a session of its own, so torchrun's group and
every rank's group are sent SIGTERM, then SIGKILL after ``STOP_GRACE_S``; torchrun is
reaped, the scratch folder (where torchrun's own temporary files go too, through
``TMPDIR``) is removed, and ``ValidateInterrupted`` says so in one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.profiler import check_device
from mpsim.models.trace import Trace
from mpsim.models.workloads import FAMILIES, ModelConfig
from mpsim.plans.plan import PlanFile, StagePlan, check_plan
from mpsim.signals import Signals, Stopped
from mpsim.sim import SimResult, simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.sim.memory import MODEL_STATES

#: Categories of the comparison; the simulator's others (activations, buffers, workspace,
#: stash, peer swap space) are "activations" in the executor's tracker too.


@dataclass(frozen=True)
class RunSettings:
    """How the executor runs."""

    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    threads: int = 1
    """Intra-op threads per process on CPU (the trace must be measured with the same)."""
    warmup: int = 2
    """Untimed steps after the memory step."""
    steps: int = 5
    """Timed steps; the median is reported."""
    capacity_bytes: int | None = None
    """Memory a stage may use (enforced); None: the topology's capacity."""
    seed: int = 0
    timeout_s: float = 600.0
    digests: bool = False
    """Each rank also records a SHA-256 of its stage's whole parameters after the last step
    (sharded ones gathered), so tests can check that replicas agree."""


#: The executor's module, run by torchrun with ``-m`` (the repository's ``validate/``
#: folder is installed as the package ``mpsim.executor``).
EXECUTOR_MODULE = "mpsim.executor.executor"


def executor_module() -> str:
    """The executor's module name, after checking that it is installed."""
    try:
        spec = importlib.util.find_spec(EXECUTOR_MODULE)
    except ImportError:
        spec = None
    if spec is None:
        raise MpsimError(f"the executor {EXECUTOR_MODULE} is not installed (reinstall mpsim)")
    return EXECUTOR_MODULE


RANKS_PER_CORE = 4
"""On CPU, the most executor threads (processes x ``--threads``) a run may start per core
of this machine (``os.cpu_count()``), and never fewer than ``MIN_CPU_RANKS``: gloo ranks
oversubscribed beyond that only time each other out (``validate --dp 16 --stages 4``
started 66 processes on two cores)."""
MIN_CPU_RANKS = 8
"""The processes x threads every machine may run, whatever its cores (the tests' worlds)."""


def check_processes(world: int, device: str, threads: int = 1, source: str = "validate") -> None:
    """Refuse, in one line before torchrun starts, a run of ``world`` processes this machine
    cannot hold: more than its CUDA GPUs on ``cuda``, more threads than ``RANKS_PER_CORE``
    per core (at least ``MIN_CPU_RANKS``) on CPU."""
    dev = check_device(device)
    if dev.type == "cuda":
        have = torch.cuda.device_count()
        if world > have:
            raise MpsimError(f"{source}: the run needs {world} processes, one per GPU, but this machine has {have} "
                             "CUDA GPU(s)")
        return
    cores = os.cpu_count() or 1
    cap = max(MIN_CPU_RANKS, RANKS_PER_CORE * cores)
    if world * threads > cap:
        raise MpsimError(f"{source}: the run needs {world} processes x {threads} thread(s) but this machine has "
                         f"{cores} CPU core(s); at most {cap} (RANKS_PER_CORE={RANKS_PER_CORE} per core, "
                         "mpsim/studies/hardware_check.py): use fewer --dp, --stages, --tp or --threads")


def check_runnable(plan: PlanFile, topo: Topology, trace: Trace, settings: RunSettings, source: str = "<plan>") -> None:
    """Refuse, with one line, a plan the executor cannot run here (module doc)."""
    check_plan(plan, topo, trace, source)
    dev = check_device(settings.device)
    check_processes(len(rank_places(plan)), settings.device, settings.threads, source)
    if plan.schedule == "pipedream":
        raise MpsimError(f"{source}: the executor runs gpipe and 1f1b; torch's pipelining has no asynchronous "
                         "PipeDream schedule")
    if plan.virtual_stages > 1:
        raise MpsimError(f"{source}: virtual_stages {plan.virtual_stages}: the executor runs one stage per GPU "
                         "(no interleaved 1F1B yet)")
    if dev.type == "cuda":
        need = max(plan.gpus_used()) + 1
        if torch.cuda.device_count() < need:
            raise MpsimError(f"{source}: the plan uses GPU {need - 1} but this machine has "
                             f"{torch.cuda.device_count()} CUDA GPU(s)")
    if trace.spec.precision.recipe != "fp32":
        raise MpsimError(f"{source}: the executor trains in fp32; "
                         f"{trace.name} is a {trace.spec.precision.recipe} trace")
    if plan.recompute_checkpoints != "layer":
        raise MpsimError(f"{source}: recompute_checkpoints '{plan.recompute_checkpoints}': the executor "
                         "checkpoints every recomputed layer on its own (use layer)")
    for s, st in enumerate(plan.stages):
        _check_stage_runnable(plan, s, st, dev, source)
    _check_offload_runnable(plan, source)
    _check_tensor_runnable(plan, trace, source)


def _check_tensor_runnable(plan: PlanFile, trace: Trace, source: str) -> None:
    """Refuse a tensor-parallel plan the executor's DTensor shards cannot run (module doc)."""
    tp = plan.tensor_parallel
    if tp is None:
        return
    cfg = model_config(trace)
    t = tp.degree
    if cfg.family == "bert":
        raise MpsimError(f"{source}: tensor_parallel with BERT: the executor shards GPT and Llama only")
    sizes = {"heads": cfg.heads, "kv_heads": cfg.kv, "ffn_hidden": cfg.ffn, "vocab": cfg.vocab}
    if tp.sequence_parallel:
        sizes["seq_len"] = cfg.seq_len
    uneven = [f"{k} {n}" for k, n in sizes.items() if n % t]
    if uneven:
        raise MpsimError(f"{source}: tensor_parallel.degree {t} does not divide {trace.name}'s {', '.join(uneven)}")
    dp = plan.data_parallel
    if dp is not None and dp.zero_stage < 3:
        raise MpsimError(f"{source}: tensor_parallel with ZeRO stage {dp.zero_stage}: the executor runs data "
                         "parallelism over DTensor shards with FSDP2 only (ZeRO stage 3)")
    for s, st in enumerate(plan.stages):
        if st.optimizer != "gpu":
            raise MpsimError(f"{source}: stages.{s}.optimizer '{st.optimizer}' with tensor_parallel: the executor "
                             "keeps a tensor-parallel stage's optimizer on the device (use gpu)")
        swapped = [a.layer for a in st.actions if a.action in ("host", "peer")]
        if swapped:
            raise MpsimError(f"{source}: layer {swapped[0]} swaps with tensor_parallel: the executor swaps whole "
                             "tensors, not DTensor shards (use keep, recompute or selective)")


def _check_offload_runnable(plan: PlanFile, source: str) -> None:
    """Refuse host optimizers and offloaded shards the executor's ZeRO stages cannot run
    (module doc)."""
    dp = plan.data_parallel
    if dp is None or dp.zero_stage == 0:
        return
    if dp.offload_params and dp.offload_device == "nvme":
        raise MpsimError(f"{source}: data_parallel.offload_device 'nvme': the executor offloads to host memory "
                         "only (FSDP2's CPUOffloadPolicy); use host")
    for s, st in enumerate(plan.stages):
        on_host = st.optimizer == "host-update"
        if on_host and dp.zero_stage == 1:
            raise MpsimError(f"{source}: stages.{s}.optimizer 'host-update' with ZeRO stage 1: the executor's "
                             "host Adam is ZeRO-Offload's (ZeRO stage 2) or ZeRO-Infinity's (3); use gpu")
        if dp.zero_stage == 3 and on_host != dp.offload_params:
            raise MpsimError(f"{source}: stages.{s}.optimizer '{st.optimizer}' with offload_params "
                             f"{str(dp.offload_params).lower()}: FSDP2's CPU offload moves parameter shards and "
                             "the optimizer to the host together (ZeRO-Infinity: both, or neither)")


def _check_stage_runnable(plan: PlanFile, s: int, st: StagePlan, dev: torch.device, source: str) -> None:
    """Refuse stage ``s`` if the executor cannot run its optimizer placement or one of its
    actions on ``dev``."""
    if st.optimizer == "host-stream":
        raise MpsimError(f"{source}: stages.{s}.optimizer 'host-stream' is not run by the executor "
                         "(use gpu or host-update)")
    if st.optimizer_layers is not None:
        raise MpsimError(f"{source}: stages.{s}.optimizer_layers: the executor moves a stage's whole optimizer "
                         "to the host; leave optimizer_layers out")
    for act in st.actions:
        if act.action == "peer" and dev.type != "cuda":
            raise MpsimError(f"{source}: layer {act.layer} swaps to peer GPUs, which needs --device cuda")
        if act.split > 1 and (act.split_dim or "batch") != "batch":
            raise MpsimError(f"{source}: layer {act.layer} splits along {act.split_dim}; the executor "
                             "splits along the batch only")
        if act.split > plan.microbatch:
            raise MpsimError(f"{source}: layer {act.layer} splits a microbatch of {plan.microbatch} "
                             f"into {act.split}")


def model_config(trace: Trace) -> ModelConfig:
    """The model a trace describes (its ``model`` block); one line for a trace of another
    model (``mpsim trace --module``: the executor builds GPT, BERT and Llama shapes only)."""
    family = trace.spec.model.get("family")
    if family not in FAMILIES:
        raise MpsimError(f"{trace.name}: model family {family!r} is not one the executor builds "
                         f"({', '.join(FAMILIES)}); validate runs those only")
    try:
        return ModelConfig(**trace.spec.model)
    except (TypeError, ValueError) as exc:
        raise MpsimError(f"{trace.name}: its model block does not describe a GPT or BERT ({exc})") from None


def run_executor(plan: PlanFile, cfg: Any, settings: RunSettings, capacity_bytes: int | None,
                 workdir: Path) -> list[dict | None]:
    """Run the plan with torchrun, one process per GPU of each stage's tensor-parallel group
    (one per stage without) of each replica, the model ``cfg`` (a dataclass the worker builds
    from: a ``ModelConfig``, or the executor's description of a Hugging Face model); the
    per-rank result dicts in rank order
    (``rank_grid``; None for a rank that stopped because another failed)."""
    job = {"plan": json.loads(plan.to_json()), "model": dataclasses.asdict(cfg), "device": settings.device,
           "threads": settings.threads, "seed": settings.seed, "warmup": settings.warmup, "steps": settings.steps,
           "capacity_bytes": capacity_bytes, "digests": settings.digests}
    world = len(rank_places(plan))
    workdir = workdir.resolve()
    job_path = workdir / "job.json"
    job_path.write_text(json.dumps(job, indent=1))
    out = workdir / "ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", executor_module(), "--job", str(job_path), "--out", str(out)]
    scratch = workdir / "tmp"  # torchrun's own temporary files (its log folders), removed below
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(settings.threads), PYTHONUNBUFFERED="1", TMPDIR=str(scratch))
    try:
        return _run_attempts(cmd, env, settings, workdir, out, world)
    finally:
        with _signals.held():
            shutil.rmtree(scratch, ignore_errors=True)


def _run_attempts(cmd: list[str], env: dict[str, str], settings: RunSettings, workdir: Path, out: Path,
                  world: int) -> list[dict | None]:
    for attempt in range(LAUNCH_ATTEMPTS):
        shutil.rmtree(out, ignore_errors=True)  # a second attempt reads its own results only
        proc = _launch(cmd, env, settings, workdir)
        results = [json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None for r in range(world)]
        if any(r is not None and r.get("oom") for r in results):
            return results
        errors = sorted(out.glob("rank*.error.txt")) if out.exists() else []
        if all(r is not None for r in results) and not errors:
            return results  # every rank measured and wrote its result; a crash after that voids nothing
        if errors:
            raise MpsimError(f"the executor failed (exit {proc.returncode}): "
                             f"{errors[0].read_text().strip().splitlines()[-1]}")
        if (any(results) and not killed_by_signal(proc.stderr)) or attempt + 1 == LAUNCH_ATTEMPTS:
            raise MpsimError(f"the executor failed (exit {proc.returncode}): {failure_line(proc.stderr)}")
    raise AssertionError("unreachable")


def killed_by_signal(stderr: str) -> bool:
    """Whether torchrun says a rank died of a signal (a negative exit code: a native abort
    or crash, not an exception the rank raised and reported)."""
    return re.search(r"exitcode\s*:\s*-\d+", stderr) is not None


LAUNCH_ATTEMPTS = 2
"""Runs of a plan when one fails without any rank reporting an error of its own: before any
rank reported anything (torchrun's launch or the gloo rendezvous failed, as seen about once
in forty data-parallel runs on a loaded 2-core machine), or with a rank killed by a signal
(a native abort, exit code -6, seen twice in about a hundred ZeRO-Infinity runs on a loaded
machine, 0 in 12 reruns). A failure a rank reports is never retried; a run in which every
rank wrote its result is taken even if a rank then crashed."""


def _launch(cmd: list[str], env: dict[str, str], settings: RunSettings, workdir: Path) -> subprocess.CompletedProcess:
    """Run torchrun in a process group of its own, its output in files of ``workdir`` (a
    pipe left unread could block a dying torchrun); anything raised while it runs (a
    signal's ``Stopped``, KeyboardInterrupt) or its timeout ends it and its ranks first."""
    logs = workdir / "torchrun.out", workdir / "torchrun.err"
    with logs[0].open("w") as out, logs[1].open("w") as err:
        with _signals.held():  # a signal now is raised once there is a handle to end the run by
            # cwd: `python -m` puts the working directory first on sys.path, where a source checkout's
            # mpsim/ (which has no executor: that is validate/) would hide the installed package
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env,
                                    cwd=workdir, start_new_session=True)
        try:
            code = proc.wait(timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            _end_run(proc)
            raise MpsimError(f"the executor did not finish within {settings.timeout_s:.0f} s") from None
        except BaseException:
            _end_run(proc)
            raise
    return subprocess.CompletedProcess(cmd, code, logs[0].read_text(errors="replace"),
                                       logs[1].read_text(errors="replace"))


STOP_GRACE_S = 10.0
"""How long torchrun and its ranks have to end on SIGTERM before they are sent SIGKILL
(torchrun passes SIGTERM on to its ranks and waits for them)."""


def _below(root: int) -> dict[int, tuple[int, str]]:
    """Every process descended from ``root``, as pid -> (process group, start time), read
    from Linux's ``/proc`` (empty elsewhere: torchrun's group is then all that is ended
    directly, and torchrun ends its ranks on SIGTERM itself)."""
    table: dict[int, tuple[int, int, str]] = {}
    with suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:  # ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ..., starttime (the 20th)
            table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
    found: dict[int, tuple[int, str]] = {}
    frontier = {root}
    while frontier:
        children = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier and pid not in found}
        found.update({pid: (table[pid][1], table[pid][2]) for pid in children})
        frontier = children
    return found


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of ``pid`` from ``/proc``; None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], fields[19]


def _signal_run(proc: subprocess.Popen, below: dict[int, tuple[int, str]], sig: int) -> None:
    """Send ``sig`` to torchrun's group (while torchrun is not reaped, its pid and group are
    its own) and to the group of every process of ``below`` that is still the one seen
    (same start time: a pid reused meanwhile is left alone)."""
    mine = os.getpgrp()
    if proc.returncode is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    for pid, (group, started) in below.items():
        stat = _stat(pid)
        if group == proc.pid or stat is None or stat[1] != started:
            continue
        with suppress(ProcessLookupError, PermissionError):
            if group == mine:  # not of a group of its own: the process alone
                os.kill(pid, sig)
            else:
                os.killpg(group, sig)


def _end_run(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks (each rank in a session of its own, as torch's elastic
    agent starts them): SIGTERM to all their groups, SIGKILL after ``STOP_GRACE_S`` to
    whatever is left; torchrun is reaped. A signal meanwhile is held till the end."""
    with _signals.held():
        _end_tree(proc)


def _end_tree(proc: subprocess.Popen) -> None:
    below = _below(proc.pid)
    _signal_run(proc, below, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if proc.poll() is None:  # not reaped: its pid is still its own
            below.update(_below(proc.pid))  # a rank started meanwhile
        elif not _alive(below):
            break
        time.sleep(0.05)
    _signal_run(proc, below, signal.SIGKILL)
    proc.wait()


def _alive(below: dict[int, tuple[int, str]]) -> bool:
    """Whether any process of ``below`` still runs (a zombie runs nothing)."""
    return any((stat := _stat(pid)) is not None and stat[0] not in ("Z", "X") and stat[1] == started
               for pid, (_, started) in below.items())


class ValidateInterrupted(MpsimError):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM: torchrun and its ranks ended, the
    scratch folder removed."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"validate interrupted by {signal.Signals(signum).name}: torchrun and its ranks were "
                         "stopped and the scratch folder removed")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by it (130, 143)."""
        return 128 + self.signum


_signals = Signals()
"""The handler ``_signals.installed()`` sets while a run lasts; ``held()`` works whether or not it is."""


def failure_line(stderr: str) -> str:
    """The line of torchrun's output that says what failed: the last exception line of a
    traceback (``ImportError: ...``), not the banner of separators torchrun ends with."""
    lines = [ln.strip() for ln in stderr.strip().splitlines()]
    code = re.search(r"exitcode\s*:\s*(-?\d+)", stderr)
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?", ln):
            return f"{ln} (a rank's exit code {code[1]})" if ln.endswith("ChildFailedError:") and code else ln
    meaningful = [ln for ln in lines if ln and not set(ln) <= set("=-_ ")]
    return meaningful[-1] if meaningful else "(no output)"


def simulate_plan(plan: PlanFile, topo: Topology, trace: Trace) -> SimResult:
    """The simulator's prediction for the executor's run."""
    return simulate_job(job_of_plan(topo, trace, plan, runtime="torch-pipelining"))


def _error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


@dataclass(frozen=True)
class RankPlace:
    """Where one executor rank runs: its replica, stage, rank in the stage's tensor-parallel
    group (0 without one) and GPU."""

    replica: int
    stage: int
    tp_rank: int
    gpu: int


def rank_grid(plan: PlanFile) -> list[RankPlace]:
    """Every executor rank's place, in rank order: ``rank = (replica * stages + stage) * t + i``
    (tensor innermost, Megatron-LM's order; ``t`` = 1 without tensor parallelism), rank
    (r, s, i) on GPU ``tensor_parallel.groups[r][s][i]`` (``replicas[r][s]`` without)."""
    tp = plan.tensor_parallel
    groups = tp.groups if tp is not None else [[[g] for g in row] for row in plan.replica_gpus()]
    return [RankPlace(r, s, i, g) for r, row in enumerate(groups) for s, group in enumerate(row)
            for i, g in enumerate(group)]


def rank_places(plan: PlanFile) -> list[tuple[int, int, int]]:
    """(replica, stage, GPU) of every executor rank, in rank order (``rank_grid``)."""
    return [(p.replica, p.stage, p.gpu) for p in rank_grid(plan)]


def _gpu_row(plan: PlanFile, predicted: SimResult, place: RankPlace, m: dict | None) -> dict:
    """One GPU's row: the simulator's ``SimResult.gpus[gpu]`` against the rank that ran there."""
    s, gpu = place.stage, place.gpu
    g = predicted.gpus[gpu]
    pred_bd = {k: g.breakdown.get(k, 0) for k in MODEL_STATES}
    pred_bd["activations"] = g.peak_bytes - sum(pred_bd.values())
    row: dict = {"replica": place.replica, "stage": s, "tp_rank": place.tp_rank, "gpu": gpu,
                 "layers": list(plan.stages[s].layers),
                 "predicted_peak_bytes": g.peak_bytes, "predicted_breakdown": pred_bd, "predicted_fits": g.fits,
                 "predicted_reserved_bytes": g.reserved().reserved_peak_bytes}
    if m is not None and not m.get("oom"):
        bd = {k: m["breakdown"].get(k, 0) for k in (*MODEL_STATES, "activations")}
        row.update(measured_peak_bytes=m["peak_bytes"], measured_breakdown=bd, measured_step_s=m["step_s"],
                   peak_error_pct=_error_pct(g.peak_bytes, m["peak_bytes"]))
        if m.get("reserved_bytes") is not None:  # on CUDA: torch.cuda.max_memory_reserved
            row.update(measured_reserved_bytes=m["reserved_bytes"],
                       reserved_error_pct=_error_pct(row["predicted_reserved_bytes"], m["reserved_bytes"]))
        if "model_state_bytes" in m:
            row["measured_model_state_bytes"] = m["model_state_bytes"]
        if "host_state_bytes" in m:
            row["measured_host_state_bytes"] = m["host_state_bytes"]
    return row


def compare(plan: PlanFile, predicted: SimResult, measured: list[dict | None]) -> dict:
    """The validation report: per GPU the plan runs on (each GPU of each stage's group in
    each replica, in rank order) predicted and measured peak and breakdown, and the
    iteration time (the slowest rank's), with errors in percent. ``measured`` is
    ``run_executor``'s list."""
    oom = next((r["oom"] for r in measured if r is not None and r.get("oom")), None)
    rows = [_gpu_row(plan, predicted, place, m) for place, m in zip(rank_grid(plan), measured)]
    report: dict = {
        "model": plan.model, "server": predicted.server, "schedule": plan.schedule, "strategy": plan.strategy,
        "microbatch": plan.microbatch, "microbatches": plan.microbatches, "replicas": plan.replicas,
        "zero_stage": None if plan.data_parallel is None else plan.data_parallel.zero_stage,
        "tensor": plan.tensor,
        "sequence_parallel": plan.tensor_parallel is not None and plan.tensor_parallel.sequence_parallel,
        "predicted_fits": predicted.fits, "predicted_oom": predicted.oom, "oom": oom, "stages": rows,
        "predicted_iteration_s": predicted.iteration_s,
    }
    if oom is None:
        step = max(r["step_s"] for r in measured if r is not None)
        report["measured_iteration_s"] = step
        report["iteration_error_pct"] = _error_pct(predicted.iteration_s, step)
    return report


def validate_plan(plan: PlanFile, topo: Topology, trace: Trace, settings: RunSettings, source: str = "<plan>",
                  workdir: Path | None = None) -> dict:
    """Check, simulate, run and compare one plan (see the module doc)."""
    check_runnable(plan, topo, trace, settings, source)
    return measure(plan, topo, trace, model_config(trace), settings, workdir)[0]


def measure(plan: PlanFile, topo: Topology, trace: Trace, model: Any, settings: RunSettings,
            workdir: Path | None = None) -> tuple[dict, list[dict | None]]:
    """``plan`` simulated, run by the executor with ``model`` (a dataclass the worker reads:
    a ``ModelConfig``, or the executor's description of a Hugging Face model) and compared
    (``compare``, with the device and versions): the report and each rank's results.
    A signal ends the run and raises ``ValidateInterrupted``."""
    predicted = simulate_plan(plan, topo, trace)
    capacity = settings.capacity_bytes if settings.capacity_bytes is not None else topo.capacity_bytes
    with _signals.installed():
        try:
            measured = _run_in_scratch(plan, model, settings, capacity, workdir)
        except Stopped as exc:
            raise ValidateInterrupted(exc.signum) from None
        except KeyboardInterrupt:  # raised some other way (the handler turns SIGINT into Stopped)
            raise ValidateInterrupted(signal.SIGINT) from None
    report = compare(plan, predicted, measured)
    report["device"] = trace.spec.source.device or settings.device
    report["torch_version"] = torch.__version__
    report["cuda_version"] = torch.version.cuda
    return report, measured


def _run_in_scratch(plan: PlanFile, cfg: Any, settings: RunSettings, capacity: int | None,
                    workdir: Path | None) -> list[dict | None]:
    """``run_executor`` in ``workdir``, else in a scratch folder made here and removed after
    (whatever ends the run)."""
    if workdir is not None:
        return run_executor(plan, cfg, settings, capacity, workdir)
    scratch = None
    try:
        with _signals.held():
            scratch = Path(tempfile.mkdtemp(prefix="mpsim-validate-"))
        return run_executor(plan, cfg, settings, capacity, scratch)
    finally:
        if scratch is not None:
            with _signals.held():
                shutil.rmtree(scratch, ignore_errors=True)
