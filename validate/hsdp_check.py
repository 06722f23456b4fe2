"""HSDP predicted against measured: the simulator's cluster job beside ``hsdp.py`` under torchrun.

The job is ``JobSpec(cluster.server, trace, schedule, microbatches, Parallelism(data=4,
zero_stage=3, hsdp=True, pipeline=1), cluster=cluster, servers=2)`` on
``validate/results/cpu2x2-cluster.yaml`` (two 2-"GPU" CPU servers joined by loopback),
simulated with the executor's runtime (``torch-pipelining``, as ``mpsim validate`` does).
The same job runs for real as four gloo processes on this machine, FSDP2 on a
(replicate=2, shard=2) mesh (``hsdp.py``); with ``hsdp=False`` it is FSDP over all four
(a one-dimensional mesh), for contrast. Rank ``r`` stands for GPU ``r % 2`` of server
``r // 2``; the engine simulates server 0 (the other server mirrors it), so rank ``r`` is
compared with ``SimResult.gpus[r % 2]``.

    python -m mpsim.executor.hsdp_check --model gpt-tiny --microbatches 2

prints the markdown table of ``reports/validation_hsdp_cpu.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster
from mpsim.models.trace import Trace
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ZOO, ModelConfig
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.plans.plan import DataParallelPlan, PlanFile, make_plan
from mpsim.sim import Job, SimResult, simulate_job
from mpsim.sim.memory import MODEL_STATES
from mpsim.studies.hardware_check import LAUNCH_ATTEMPTS, RunSettings, failure_line, killed_by_signal

CLUSTER_FILE = Path(__file__).resolve().parent / "results" / "cpu2x2-cluster.yaml"
"""Two servers of ``cpu2.yaml`` (2 CPU "devices" each) joined by loopback."""
WORKER_MODULE = "mpsim.executor.hsdp"
SERVERS = 2
MiB = 2**20


def load_cluster(where: Path | str = CLUSTER_FILE) -> Cluster:
    """A cluster file, or a shipped cluster by name (``dgx-h100-superpod``)."""
    from mpsim.data.catalog import load_cluster as shipped

    return shipped(str(where))


def hsdp_job(cluster: Cluster, trace: Trace, schedule: str, microbatches: int, hsdp: bool) -> JobSpec:
    """ZeRO-3 over every GPU of two servers, one pipeline stage: HSDP (shard inside a
    server, replicate across) or, with ``hsdp`` off, FSDP over all of them."""
    data = SERVERS * cluster.gpus_per_server
    par = Parallelism(data=data, zero_stage=3, hsdp=hsdp, pipeline=1)
    return JobSpec(cluster.server, trace, schedule, microbatches, par, cluster=cluster, servers=SERVERS)


def simulate(job: JobSpec) -> SimResult:
    """The simulator's prediction, with the executor's runtime (``torch.distributed.pipelining``)."""
    return simulate_job(Job(job, runtime="torch-pipelining"))


def executor_plan(job: JobSpec) -> PlanFile:
    """The job as the executor's plan: the whole model in one stage, one replica per rank,
    ZeRO 3 (the mesh, not the plan, says which ranks shard and which replicate)."""
    assert job.cluster is not None
    view = job.cluster.view(job.servers)
    n = job.parallelism.data
    dp = DataParallelPlan(degree=n, zero_stage=3, replicas=[[g] for g in range(n)])
    return make_plan(job.trace, view, job.schedule, job.microbatches, [(0, job.trace.n_layers)], [0], "keep",
                     data_parallel=dp)


def mesh_of(job: JobSpec) -> list[int]:
    """The data mesh's shape: (servers, GPUs per server) for HSDP, (all GPUs,) for FSDP."""
    n = job.parallelism.data
    return [job.servers, n // job.servers] if job.parallelism.hsdp else [n]


def worker_job(job: JobSpec, cfg: ModelConfig, settings: RunSettings) -> dict:
    """The worker's job file: the executor's job (plan, model, run settings) and the mesh."""
    return {"plan": json.loads(executor_plan(job).to_json()), "model": dataclasses.asdict(cfg),
            "device": settings.device, "threads": settings.threads, "seed": settings.seed,
            "warmup": settings.warmup, "steps": settings.steps, "capacity_bytes": job.topology.capacity_bytes,
            "digests": settings.digests, "mesh": mesh_of(job)}


def run_worker(job: JobSpec, cfg: ModelConfig, settings: RunSettings, workdir: Path) -> dict:
    """Run ``hsdp.py`` under torchrun, one process per GPU of the job; its JSON."""
    workdir = workdir.resolve()
    doc = worker_job(job, cfg, settings)
    job_path, out = workdir / "hsdp-job.json", workdir / "hsdp-result.json"
    job_path.write_text(json.dumps(doc, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.parallelism.data}",
           "-m", WORKER_MODULE, "--job", str(job_path), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(settings.threads), PYTHONUNBUFFERED="1")
    for attempt in range(LAUNCH_ATTEMPTS):
        out.unlink(missing_ok=True)
        proc = _launch(cmd, env, settings, workdir)
        if out.exists():
            result: dict = json.loads(out.read_text())
            return result
        errors = sorted(workdir.glob("hsdp-result.rank*.error.txt"))
        if errors or not killed_by_signal(proc.stderr) or attempt + 1 == LAUNCH_ATTEMPTS:
            why = errors[0].read_text().strip().splitlines()[-1] if errors else failure_line(proc.stderr)
            raise MpsimError(f"the HSDP worker failed (exit {proc.returncode}): {why}")
    raise AssertionError("unreachable")


def _launch(cmd: list[str], env: dict[str, str], settings: RunSettings, workdir: Path) -> subprocess.CompletedProcess:
    try:  # cwd: see hardware_check._launch (a source checkout's mpsim/ has no executor)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=settings.timeout_s, env=env, check=False,
                              cwd=workdir)
    except subprocess.TimeoutExpired:
        raise MpsimError(f"the HSDP worker did not finish within {settings.timeout_s:.0f} s") from None


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


def rank_row(sim: SimResult, rank: dict, gpus_per_server: int) -> dict:
    """One rank against the simulated GPU it stands for (module doc). ``*_states_bytes``:
    parameters, gradients and Adam's states at rest (the simulated GPU's memory at the
    iteration's end; the rank's tensors after its last step); ``*_transient_bytes``: the
    peak less those (activations, gathered parameters, unsharded gradients, buffers)."""
    server, local = divmod(rank["rank"], gpus_per_server)
    g = sim.gpus[local]
    pred_states = int(g.memory_used_bytes[-1])
    meas_states = sum(rank["model_state_bytes"].values())
    return {"rank": rank["rank"], "server": server, "local_gpu": local,
            "predicted_peak_bytes": g.peak_bytes, "measured_peak_bytes": rank["peak_bytes"],
            "peak_error_pct": error_pct(g.peak_bytes, rank["peak_bytes"]),
            "predicted_breakdown": {k: g.breakdown.get(k, 0) for k in MODEL_STATES},
            "measured_breakdown": rank["breakdown"],
            "predicted_states_bytes": pred_states, "measured_states_bytes": meas_states,
            "predicted_transient_bytes": g.peak_bytes - pred_states,
            "measured_transient_bytes": rank["peak_bytes"] - meas_states,
            "measured_model_state_bytes": rank["model_state_bytes"], "measured_step_s": rank["step_s"],
            "losses": rank["losses"], "params_sha256": rank.get("params_sha256")}


def compare(job: JobSpec, sim: SimResult, measured: dict) -> dict:
    """Per rank, predicted and measured peak (and model states); the iteration time (the
    slowest rank's median)."""
    assert job.cluster is not None
    rows = [rank_row(sim, r, job.cluster.gpus_per_server) for r in measured["ranks"]]
    step = max(r["measured_step_s"] for r in rows)
    return {"layout": job.layout_name, "where": job.where, "model": job.trace.name, "schedule": job.schedule,
            "microbatch": job.microbatch, "microbatches": job.microbatches, "mesh": measured["mesh"],
            "torch_version": measured["torch_version"], "ranks": rows,
            "predicted_iteration_s": sim.iteration_s, "measured_iteration_s": step,
            "iteration_error_pct": error_pct(sim.iteration_s, step)}


def check(cluster: Cluster, trace: Trace, cfg: ModelConfig, schedule: str, microbatches: int, hsdp: bool,
          settings: RunSettings, workdir: Path | None = None) -> dict:
    """Simulate the job, run it for real, and compare (``compare``)."""
    job = hsdp_job(cluster, trace, schedule, microbatches, hsdp)
    sim = simulate(job)
    with tempfile.TemporaryDirectory(prefix="mpsim-hsdp-") as tmp:
        where = workdir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        measured = run_worker(job, cfg, settings, where)
    return compare(job, sim, measured)


def markdown_rows(report: dict) -> list[str]:
    """The report's ranks as rows of the table in ``reports/validation_hsdp_cpu.md``."""
    out = []
    for r in report["ranks"]:
        pa, ma = r["predicted_transient_bytes"], r["measured_transient_bytes"]
        out.append(f"| {report['layout']} | {r['rank']} | {r['server']} | {r['local_gpu']} | "
                   f"{r['predicted_peak_bytes'] / MiB:.2f} | {r['measured_peak_bytes'] / MiB:.2f} | "
                   f"{r['peak_error_pct']:+.2f}% | {r['predicted_states_bytes'] / MiB:.2f} / "
                   f"{r['measured_states_bytes'] / MiB:.2f} | {pa / MiB:.2f} / {ma / MiB:.2f} | "
                   f"{report['predicted_iteration_s'] * 1e3:.0f} / {report['measured_iteration_s'] * 1e3:.0f} ms |")
    return out


TABLE_HEAD = ("| layout | rank | server | GPU | predicted peak MiB | measured MiB | peak error | "
              "model states MiB | rest of the peak MiB | iteration |\n|---|---|---|---|---|---|---|---|---|---|")


def measured_trace(model: str, device: str, threads: int) -> tuple[Trace, ModelConfig]:
    """A preset's layers measured on this machine (as ``mpsim validate --model`` does)."""
    from mpsim.models.profiler import measure_trace

    if model not in ZOO or (device == "cpu" and ZOO[model][2] != "fp32"):
        raise MpsimError(f"--model {model}: give a preset (on CPU an fp32 one: gpt-tiny)")
    cfg, mb, recipe = ZOO[model]
    return measure_trace(cfg, mb, recipe, device, threads, name=model), cfg


def main() -> None:
    """Check HSDP and FSDP here (the default), or write the job for real servers
    (``--write-job``) and compare what they measured (``--compare``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny", help="a preset, measured here")
    ap.add_argument("--cluster", default=str(CLUSTER_FILE), help="a cluster file or shipped name (default: cpu2x2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the reports here")
    ap.add_argument("--write-job", type=Path, help="write the HSDP worker's job file here and stop")
    ap.add_argument("--compare", type=Path, help="the worker's output from real servers: compare it, run nothing")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    settings = RunSettings(device=args.device, threads=1, warmup=args.warmup, steps=args.steps)
    if args.write_job:  # the plan needs the model's layers only: no measurement
        cfg, mb, recipe = ZOO[args.model]
        job = hsdp_job(cluster, trace_model(cfg, mb, recipe, name=args.model), args.schedule, args.microbatches, True)
        args.write_job.write_text(json.dumps(worker_job(job, cfg, settings), indent=1) + "\n")
        return
    trace, cfg = measured_trace(args.model, args.device, 1)
    if args.compare:
        job = hsdp_job(cluster, trace, args.schedule, args.microbatches, True)
        reports = [compare(job, simulate(job), json.loads(args.compare.read_text()))]
    else:
        reports = [check(cluster, trace, cfg, args.schedule, args.microbatches, hsdp, settings)
                   for hsdp in (True, False)]
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}; cluster {cluster.describe()}\n")
    print(TABLE_HEAD)
    print("\n".join(row for report in reports for row in markdown_rows(report)))


if __name__ == "__main__":
    main()
