"""One job: load a server and a model, plan and simulate, read and write plan files, and
validate a plan on this machine (torch, imported when asked)."""

from __future__ import annotations

from pathlib import Path

from mpsim.api.models import retraced
from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster
from mpsim.hardware.topology import Topology
from mpsim.models.expert_parallel import UNIFORM, ExpertLoad
from mpsim.models.finetune import FineTune
from mpsim.models.trace import Trace, measured_elsewhere
from mpsim.planners import Planned, plan_job
from mpsim.plans.job import (
    DEFAULT_MICROBATCHES,
    DEFAULT_MODEL,
    DEFAULT_SCHEDULE,
    DEFAULT_SERVER,
    JobSpec,
    Parallelism,
    job_of,
    pipeline,
)
from mpsim.plans.plan import PlanFile, check_plan, read_plan_file
from mpsim.plans.strategies import check_zero_stage
from mpsim.sim import SimResult, simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.timing.runtime import DEFAULT_PROFILE


def plan(server: str | Topology | None, model: str | Trace, schedule: str = DEFAULT_SCHEDULE,
         microbatch: int | None = None, microbatches: int = DEFAULT_MICROBATCHES, n_stages: int | None = None,
         strategy: str = "none",
         partition: str = "compute", record_link_rates: bool = False,
         parallelism: Parallelism | None = None, cluster: str | Cluster | None = None, servers: int = 1,
         runtime_profile: str = DEFAULT_PROFILE, expert_load: ExpertLoad = UNIFORM) -> Planned:
    """Make a plan with a named strategy; returns it with its simulated result
    (``record_link_rates``: every change of link rates kept, for Chrome-trace counters;
    ``parallelism``: data-parallel replicas and ZeRO stage, ``mpsim.plans.job.data_parallel``;
    ``cluster`` and ``servers``: that many servers of a cluster, ``mpsim.hardware.cluster``;
    ``expert_load``: how a mixture of experts routes its tokens, ``mpsim.models.expert_parallel``)."""
    if parallelism is not None:  # a stage other than 0 (the default) is asked for
        check_zero_stage(strategy, parallelism.zero_stage, parallelism.hsdp, given=parallelism.zero_stage != 0)
    return plan_job(job_of(server, model, schedule=schedule, microbatch=microbatch, microbatches=microbatches,
                           n_stages=n_stages, strategy=strategy, partition=partition,
                           record_link_rates=record_link_rates, parallelism=parallelism, cluster=cluster,
                           servers=servers, runtime_profile=runtime_profile, expert_load=expert_load))


def simulate(server: str | Topology, model: str | Trace, schedule: str = DEFAULT_SCHEDULE,
             microbatch: int | None = None, microbatches: int = DEFAULT_MICROBATCHES, n_stages: int | None = None,
             strategy: str = "none",
             plan_file: PlanFile | None = None, record_link_rates: bool = False,
             partition: str = "compute", parallelism: Parallelism | None = None,
             runtime_profile: str = DEFAULT_PROFILE, expert_load: ExpertLoad = UNIFORM) -> SimResult:
    """Simulate one training iteration of ``model`` on ``server``.

    With ``plan_file`` the plan says schedule, microbatches, partition, mapping and
    actions (the trace is rescaled to its microbatch). Otherwise ``strategy`` makes the
    plan: ``microbatch`` rescales the trace (None keeps the traced size); one stage per
    GPU unless ``n_stages`` says otherwise; ``partition`` ``compute`` (balanced compute
    time, as PipeDream and DAPPLE) or ``memory`` (balanced predicted peak, mCAP).
    """
    if plan_file is not None:
        topo = load_topology(server) if isinstance(server, str) else server
        trace = load_trace(model) if isinstance(model, str) else model
        return simulate_job(job_of_plan(topo, trace, plan_file, record_link_rates, runtime_profile=runtime_profile))
    return plan(server, model, schedule, microbatch, microbatches, n_stages, strategy, partition,
                record_link_rates, parallelism, runtime_profile=runtime_profile, expert_load=expert_load).result


def load_job(server: str | None, model: str | None, plan_path: Path | None = None, seq_len: int | None = None,
             recipe: str | None = None, fine_tune: FineTune | None = None) -> tuple[Topology, Trace, PlanFile | None]:
    """The server, model and plan file a command names: each as given, else the plan's, else ``DEFAULT_SERVER`` and
    ``DEFAULT_MODEL``; the model retraced at ``seq_len`` tokens per sample and under ``recipe`` when given,
    then fine-tuned as ``fine_tune`` says (``mpsim.api.models.at_seq_len``, ``at_recipe``, ``at_finetune``).
    With a plan the trace is at its microbatch and the plan is checked against both (errors name its file).
    """
    plan_file = read_plan_file(plan_path) if plan_path else None
    topo = load_topology(server or (plan_file.server if plan_file else DEFAULT_SERVER))
    trace = retraced(load_trace(model or (plan_file.model if plan_file else DEFAULT_MODEL)), seq_len, recipe, fine_tune)
    if plan_file is not None:
        trace = trace.rescale(plan_file.microbatch)
        check_plan(plan_file, topo, trace, str(plan_path))
    return topo, trace, plan_file


def measured_warning(trace: Trace, topo: Topology) -> str | None:
    """One line when ``trace`` holds times measured on another kind of device than
    ``topo``'s GPUs (they are used as they are); else None."""
    return measured_elsewhere(trace, topo.spec.gpu.model, topo.name)


def _measured_model(model: str, microbatch: int | None, device: str, threads: int) -> Trace:
    """``validate --model``: a preset's layers measured here, or a measured trace file."""
    from mpsim.models.profiler import measure_trace
    from mpsim.models.workloads import ZOO

    if model in ZOO:
        cfg, mb, recipe = ZOO[model]
        if device.startswith("cpu") and recipe != "fp32":
            raise MpsimError(f"--model {model} trains in {recipe}; on CPU validate an fp32 preset such as gpt-tiny")
        return measure_trace(cfg, microbatch or mb, recipe, device, threads, name=model)
    trace = load_trace(model)
    if trace.spec.source.kind != "measured":
        raise MpsimError(f"--model {model}: a derived trace predicts no measured run; give a preset, a trace "
                         "made with `mpsim trace --measure`, or a mixture of experts' Hugging Face config.json")
    return trace


def validate(model: str, plan_path: Path | None = None, server: str | None = None, *, strategy: str = "none",
             schedule: str = "1f1b", microbatches: int = 4, stages: int = 2, device: str = "cpu", threads: int = 1,
             memory_mib: float | None = None, steps: int = 5, warmup: int = 2,
             parallelism: Parallelism | None = None, fine_tune: FineTune | None = None) -> dict:
    """Run a plan on this machine with the PyTorch executor and compare it with the
    simulator (:func:`mpsim.studies.hardware_check.validate_plan`): the plan file, else one made
    with ``strategy`` (and ``parallelism``'s replicas); ``server``'s topology, else this
    machine probed; ``model`` a preset measured here, a measured trace, or a mixture of
    experts' Hugging Face config.json, traced here and run with expert parallelism
    (``--ep``; ``validate_moe_plan``). With ``fine_tune`` (``--lora``, ``--qlora``,
    ``--peft-config``) ``model`` is a Llama decoder's transformers config.json, traced with
    PEFT's adapters and fine-tuned by the executor's fine-tuning worker on one stage, DDP over
    ``parallelism``'s replicas (``validate_lora_plan``; on CPU the report also holds the
    prediction with the head's backward workspace measured). Returns the report (``oom`` set
    when a run ran out)."""
    from mpsim.models.probe import probe
    from mpsim.models.profiler import check_device
    from mpsim.studies.cp_check import validate_cp_plan
    from mpsim.studies.hardware_check import RunSettings, check_processes, rank_places, validate_plan
    from mpsim.studies.lora_check import check_lora_layout, lora_config, lora_trace, validate_lora_plan
    from mpsim.studies.moe_check import moe_config, moe_trace, validate_moe_plan

    check_device(device)
    plan_file = read_plan_file(plan_path) if plan_path else None
    if parallelism is not None:
        check_zero_stage(strategy, parallelism.zero_stage, parallelism.hsdp, given=parallelism.zero_stage != 0)
    # before anything is measured or probed: the processes the run starts, against this machine
    world = len(rank_places(plan_file)) if plan_file else stages * (parallelism.stage_gpus if parallelism else 1)
    check_processes(world, device, threads, str(plan_path) if plan_path else "validate")
    hf_config = lora_config(model) if fine_tune is not None else moe_config(model)
    if fine_tune is not None and plan_file is None:
        check_lora_layout(parallelism, stages)
    if hf_config is not None and plan_file is None and stages != 1:
        raise MpsimError("validate: the executor runs a mixture of experts as one pipeline stage; give --stages 1")
    microbatch = plan_file.microbatch if plan_file else None
    if fine_tune is not None:
        trace = lora_trace(model, fine_tune, microbatch or 1)
    else:
        trace = moe_trace(model, microbatch) if hf_config else _measured_model(model, microbatch, device, threads)
    per_stage = parallelism.stage_gpus if parallelism is not None else 1
    n_devices = max(plan_file.gpus_used()) + 1 if plan_file else stages * per_stage
    topo = load_topology(server) if server else probe(device, n_devices, threads, memory_mib)[1]
    if plan_file is None:
        layout = pipeline(stages) if parallelism is None else parallelism.model_copy(update={"pipeline": stages})
        plan_file = plan_job(JobSpec(topo, trace, schedule, microbatches, layout, strategy=strategy)).plan
    settings = RunSettings(device=device, threads=threads, warmup=warmup, steps=steps,
                           capacity_bytes=int(memory_mib * 2**20) if memory_mib else None)
    source = str(plan_path) if plan_path else "<plan>"
    if fine_tune is not None:
        assert hf_config is not None  # lora_config's
        return validate_lora_plan(plan_file, topo, trace, hf_config, settings, source,
                                  measured_head=device.startswith("cpu"))
    if hf_config is not None:
        return validate_moe_plan(plan_file, topo, trace, hf_config, settings, source)
    if plan_file.context > 1:  # ring attention: validate/context_parallel.py
        return validate_cp_plan(plan_file, topo, trace, settings, source)
    return validate_plan(plan_file, topo, trace, settings, source)
