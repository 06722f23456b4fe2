"""One job: load a server and a model, plan and simulate, read and write plan files, and
validate a plan on this machine (torch, imported when asked)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # torch and the launch formats: imported when a job is validated
    from mpsim.launch.formats import Where
    from mpsim.launch.job import LaunchJob
    from mpsim.models.workloads import ModelConfig
    from mpsim.studies.hardware_check import RunSettings


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
    if plan_file is not None and plan_file.finetune is not None and fine_tune is None:
        if model is None:
            raise MpsimError(f"{plan_path}: the plan is for a fine-tune ({plan_file.finetune.describe()}); give "
                             "--model, the model it was traced from")
        fine_tune = plan_file.finetune  # the plan's fine-tune, as its file says
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
        cfg, mb, recipe = _preset(model, device)
        return measure_trace(cfg, microbatch or mb, recipe, device, threads, name=model)
    return _measured_file(model)


def _preset(model: str, device: str) -> tuple[ModelConfig, int, str]:
    """A preset's shape, microbatch and recipe; one line for a recipe the CPU does not train."""
    from mpsim.models.workloads import ZOO

    cfg, mb, recipe = ZOO[model]
    if device.startswith("cpu") and recipe != "fp32":
        raise MpsimError(f"--model {model} trains in {recipe}; on CPU validate an fp32 preset such as gpt-tiny")
    return cfg, mb, recipe


def _measured_file(model: str) -> Trace:
    trace = load_trace(model)
    if trace.spec.source.kind != "measured":
        raise MpsimError(f"--model {model}: a derived trace predicts no measured run; give a preset, a trace "
                         "made with `mpsim trace --measure`, or a mixture of experts' Hugging Face config.json")
    return trace


def validate_from(path: Path, fmt: str | None, model: str, server: str | None, settings: RunSettings,
                  memory_mib: float | None = None) -> dict:
    """``validate --from``: the plan a framework's configuration states (``mpsim.launch``), run
    here with the executor and compared with the simulator as ``validate --plan`` does.

    The configuration is read (``fmt``, else its suffix's) as training ``model`` (a preset,
    whose shape a derived trace gives the reader; or a measured trace) on ``server``, else on
    this machine probed (on CPU one device per ``settings.threads`` cores until the
    configuration says how many processes it starts, then probed again for that many).
    A length the configuration leaves to the training script is the model's. The plan is
    made as ``mpsim.launch.job.simulate`` makes it (the mesh, microbatches, the strategy its
    recomputation and offload name, the first N layers of each stage recomputed for the
    block method) but from the model measured here at the configuration's microbatch and
    the topology above. Refused in one line: a configuration whose sequence length or recipe
    is not the measured model's (naming both), a mixture of experts' or fine-tune's
    config.json, and whatever the executor refuses for a plan."""
    import tempfile

    import yaml

    from mpsim.api.launch import format_of
    from mpsim.launch.formats import Where
    from mpsim.models.probe import probe
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import ZOO
    from mpsim.studies.cp_check import validate_cp_plan
    from mpsim.studies.hardware_check import check_processes, validate_plan
    from mpsim.studies.moe_check import moe_config

    source, device, threads = str(path), settings.device, settings.threads
    if moe_config(model) is not None:
        raise MpsimError(f"validate --from {source}: --model {model} is a mixture of experts' config.json, which the "
                         "executor runs from its own layout; validate it with --ep and --stages 1 instead of --from")
    name = format_of(path, fmt)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MpsimError(f"--from {path}: cannot read it ({type(e).__name__}: {e})") from None
    if model in ZOO:
        cfg, mb, recipe = _preset(model, device)
        shape = trace_model(cfg, mb, recipe, name=model)
    else:
        shape = _measured_file(model)
    devices = 1 if device.startswith("cuda") else max(1, (os.cpu_count() or 1) // threads)
    if server:
        topo, probed = load_topology(server), None
    else:
        probed, topo = probe(device, devices, threads, memory_mib)
    with tempfile.TemporaryDirectory(prefix="mpsim-validate-from-") as scratch:
        # the readers load the model and the server by name: a preset's derived trace, this machine's probe
        model_file = model
        if model in ZOO:
            model_file = str(Path(scratch) / "model.json")
            Path(model_file).write_text(shape.to_json(), encoding="utf-8")
        server_file = server
        if probed is not None:
            server_file = str(Path(scratch) / "server.yaml")
            Path(server_file).write_text(yaml.safe_dump(probed, sort_keys=False), encoding="utf-8")
        assert server_file is not None
        launch = _read_launch(name, text, source, Where(model=model_file, server=server_file), shape.seq_len or 1)
    _check_measured_as(launch, shape, model, source)
    check_processes(launch.gpus, device, threads, source)
    if probed is not None and not device.startswith("cuda") and launch.gpus != devices:
        topo = probe(device, launch.gpus, threads, memory_mib)[1]  # as validate --plan probes for its processes
    plan_file, trace = _plan_of_launch(launch, topo, _measured_model(model, launch.microbatch, device, threads))
    if plan_file.context > 1:  # ring attention: validate/context_parallel.py
        report = validate_cp_plan(plan_file, topo, trace, settings, source)
    else:
        report = validate_plan(plan_file, topo, trace, settings, source)
    report["configuration"] = {"file": source, "format": name}
    return report


def _check_measured_as(launch: LaunchJob, shape: Trace, model: str, source: str) -> None:
    """One line when the configuration trains at another sequence length or in another
    recipe than ``model`` is measured (``shape``: its trace), naming both."""
    seq_len, recipe = shape.seq_len or 1, shape.spec.precision.recipe
    theirs, ours = [], []
    if launch.seq_len != seq_len:
        theirs.append(f"at sequence length {launch.seq_len}")
        ours.append(f"at {seq_len}")
    if launch.recipe != recipe:
        theirs.append(f"in {launch.recipe}")
        ours.append(f"in {recipe}")
    if theirs:
        raise MpsimError(f"validate --from {source}: the configuration trains {' '.join(theirs)} but {model} is "
                         f"measured {' '.join(ours)}; the executor runs the model as measured here (give a model "
                         "measured as the configuration trains it)")


def _plan_of_launch(launch: LaunchJob, topo: Topology, trace: Trace) -> tuple[PlanFile, Trace]:
    """The plan ``launch`` states, made as ``mpsim.launch.job.simulate`` makes it but with
    ``trace`` (measured here) on ``topo``, and the trace at the plan's microbatch."""
    from mpsim.launch.job import _first_layers_recomputed

    job = job_of(topo, trace, microbatch=launch.microbatch, microbatches=launch.microbatches,
                 n_stages=launch.pipeline, strategy=launch.strategy, parallelism=launch.parallelism(),
                 runtime_profile=launch.runtime)
    if launch.recompute_layers is None:
        return plan_job(job).plan, job.trace
    # Megatron-LM's --recompute-method block: the first N transformer layers of each stage
    return _first_layers_recomputed(plan_job(job.but(strategy="none")).plan, job, launch.recompute_layers), job.trace


def _read_launch(name: str, text: str, source: str, where: Where, seq_len: int) -> LaunchJob:
    """The configuration read as it says itself; where it leaves the sequence length to the
    training script (DeepSpeed's or Accelerate's without an mpsim header), at ``seq_len``.
    Only ``where.seq_len`` differs between the two reads, so a first refusal that the second
    read does not repeat was for the length left unsaid."""
    from dataclasses import replace

    from mpsim.launch.formats import parse

    try:
        return parse(name, text, source, where)
    except MpsimError:
        return parse(name, text, source, replace(where, seq_len=seq_len))


def validate(model: str, plan_path: Path | None = None, server: str | None = None, *, strategy: str = "none",
             schedule: str = "1f1b", microbatches: int = 4, stages: int = 2, device: str = "cpu", threads: int = 1,
             memory_mib: float | None = None, steps: int = 5, warmup: int = 2,
             parallelism: Parallelism | None = None, fine_tune: FineTune | None = None,
             from_path: Path | None = None, from_format: str | None = None) -> dict:
    """Run a plan on this machine with the PyTorch executor and compare it with the
    simulator (:func:`mpsim.studies.hardware_check.validate_plan`): the plan file, else the plan a
    framework's configuration states (``from_path``, :func:`validate_from`), else one made
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
    if from_path is not None:
        if plan_path is not None:
            raise MpsimError("validate: --from and --plan each give the whole job: give one of them")
        if parallelism is not None or fine_tune is not None:
            raise MpsimError(f"validate --from {from_path}: the configuration states the layout; leave the layout and "
                             "fine-tune options out")
        settings = RunSettings(device=device, threads=threads, warmup=warmup, steps=steps,
                               capacity_bytes=int(memory_mib * 2**20) if memory_mib else None)
        return validate_from(from_path, from_format, model, server, settings, memory_mib)
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
