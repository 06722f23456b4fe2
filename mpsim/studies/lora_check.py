"""LoRA and QLoRA fine-tuning predicted against measured: a Hugging Face decoder's config traced
with PEFT's adapters (``trace_hf(..., fine_tune=...)``), the plan run by the executor's
fine-tuning worker (``validate/finetune.py``: the same transformers model, PEFT's LoRA applied
by ``peft.get_peft_model``, QLoRA's base as ``adapters.QuantizedLinear``, AdamW over the
trained parameters) and compared per GPU (``hardware_check.compare``), each row with PEFT's
trainable and total parameter counts beside the trace's.

What the worker does not run is refused in one line before anything starts
(``lora_config``, ``check_lora_layout``, ``check_lora_runnable``). ``mpsim validate --lora``
(``--qlora``, ``--peft-config``) comes here through ``mpsim.api.validate``, as a mixture of
experts goes to ``mpsim.studies.moe_check``; on CPU its report also carries the prediction with
the head's backward workspace measured here (``measured_head_rows``), since a derived trace takes
the head's forward workspace for it and under-counts the peak by that much."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpsim.datafile import read_bounded
from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.finetune import FineTune
from mpsim.models.trace import Trace
from mpsim.plans.mesh import Parallelism
from mpsim.plans.plan import PlanFile
from mpsim.signals import Stopped
from mpsim.studies import hardware_check
from mpsim.studies.hardware_check import (
    RunSettings,
    ValidateInterrupted,
    check_runnable,
    compare,
    simulate_plan,
)

WORKER_MODULE = "mpsim.executor.finetune"
"""The fine-tuning worker, run by torchrun with ``-m`` (``validate/finetune.py``)."""
LORA_FAMILIES = ("llama",)
"""Hugging Face families the worker runs (a decoder called block by block as ``LlamaModel``)."""


@dataclass(frozen=True)
class FineTuneModel:
    """What the worker builds: the Hugging Face config, the traced sequence length and
    attention kernel, and the fine-tune (``FineTune.model_dump``)."""

    hf_config: dict
    seq_len: int
    attention: str
    fine_tune: dict


def lora_config(model: str) -> dict:
    """The Hugging Face config ``validate --lora`` fine-tunes: ``model`` must name a
    transformers config.json (a JSON object with a ``model_type``) of a family the worker
    runs (``LORA_FAMILIES``); anything else (a preset, a trace, another family) is refused
    in one line."""
    path = Path(model)
    raw = None
    if path.suffix == ".json" and path.is_file():
        try:  # bounded as any model file (a trace file may come here too)
            raw = json.loads(read_bounded(path, "trace"))
        except ValueError:
            raw = None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(kind, str):
        raise MpsimError(f"--model {model}: the executor fine-tunes the model of a transformers config.json (a Llama "
                         "decoder's); give its path, not a preset or a trace")
    if kind not in LORA_FAMILIES:
        raise MpsimError(f"--model {model}: the executor fine-tunes Llama decoders (model_type "
                         f"{', '.join(LORA_FAMILIES)}), not {kind}")
    return raw


def check_lora_layout(layout: Parallelism | None, stages: int, source: str = "validate") -> None:
    """The refusals of ``check_lora_runnable`` that the asked-for layout already shows (no
    plan file), in the same words, before anything is traced, probed or planned."""
    if layout is None:
        layout = Parallelism()
    refusals = [
        (stages != 1, "one pipeline stage (give --stages 1)"),
        (layout.tensor > 1, "no tensor parallelism"),
        (layout.context > 1, "no context parallelism"),
        (layout.expert > 1, "no expert parallelism"),
        (layout.zero_stage != 0, "no ZeRO (DDP: --zero 0)"),
    ]
    for refused, needs in refusals:
        if refused:
            raise MpsimError(f"{source}: the executor fine-tunes with {needs}")


def lora_trace(config_path: str, spec: FineTune, microbatch: int = 1) -> Trace:
    """The config traced as ``mpsim trace --hf CONFIG --recipe fp32 --lora`` traces it
    (FakeTensor, PEFT's adapters on the model's transformers modules)."""
    from mpsim.models.hf import trace_hf

    return trace_hf(config_path, microbatch=microbatch, recipe="fp32", fine_tune=spec)


def check_lora_runnable(plan_file: PlanFile, trace: Trace, source: str) -> None:
    """Refuse, in one line, a plan the fine-tuning worker cannot run: a pipeline, tensor,
    context or expert parallelism, ZeRO, actions other than keep, a host optimizer, a trace
    that is no fine-tune, or a family other than Llama's."""
    dp = plan_file.data_parallel
    model = trace.spec.model
    refusals = [
        (trace.spec.finetune is None, "a fine-tuning trace (trace_hf with fine_tune)"),
        (model.get("model_type") not in LORA_FAMILIES, f"a Llama decoder (not {model.get('model_type')})"),
        (len(plan_file.stages) > 1, "one pipeline stage (give --stages 1)"),
        (plan_file.tensor_parallel is not None, "no tensor parallelism"),
        (plan_file.context > 1, "no context parallelism"),
        (plan_file.expert > 1, "no expert parallelism"),
        (dp is not None and dp.zero_stage != 0, "no ZeRO (DDP: --zero 0)"),
        (any(a.action != "keep" for st in plan_file.stages for a in st.actions), "strategy none (every layer kept)"),
        (any(st.optimizer != "gpu" for st in plan_file.stages), "the optimizer on the device"),
    ]
    for refused, needs in refusals:
        if refused:
            raise MpsimError(f"{source}: the executor fine-tunes with {needs}")


def run_worker(plan: PlanFile, model: FineTuneModel, settings: RunSettings, capacity_bytes: int | None,
               workdir: Path) -> list[dict | None]:
    """``hardware_check.run_executor`` with the fine-tuning worker: torchrun, one process per
    replica; the per-rank results in rank order."""
    job = {"plan": json.loads(plan.to_json()), "model": model.__dict__, "device": settings.device,
           "threads": settings.threads, "seed": settings.seed, "warmup": settings.warmup, "steps": settings.steps,
           "capacity_bytes": capacity_bytes, "digests": settings.digests}
    world = len(hardware_check.rank_places(plan))
    workdir = workdir.resolve()
    job_path = workdir / "job.json"
    job_path.write_text(json.dumps(job, indent=1))
    out = workdir / "ranks"
    hardware_check.executor_module()  # the package mpsim.executor is installed
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", WORKER_MODULE, "--job", str(job_path), "--out", str(out)]
    scratch = workdir / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(settings.threads), PYTHONUNBUFFERED="1", TMPDIR=str(scratch))
    try:
        return hardware_check._run_attempts(cmd, env, settings, workdir, out, world)
    finally:
        with hardware_check._signals.held():
            shutil.rmtree(scratch, ignore_errors=True)


def _run_stoppable(plan: PlanFile, model: FineTuneModel, settings: RunSettings, capacity_bytes: int | None,
                   workdir: Path | None) -> list[dict | None]:
    """``run_worker`` in ``workdir``, else in a scratch folder removed after, as
    ``hardware_check.measure`` runs the executor: Ctrl-C or SIGTERM ends torchrun and its
    ranks and raises ``ValidateInterrupted`` (the scratch folder removed)."""
    with hardware_check._signals.installed():
        try:
            if workdir is not None:
                return run_worker(plan, model, settings, capacity_bytes, workdir)
            scratch = None
            try:
                with hardware_check._signals.held():
                    scratch = Path(tempfile.mkdtemp(prefix="mpsim-validate-lora-"))
                return run_worker(plan, model, settings, capacity_bytes, scratch)
            finally:
                if scratch is not None:
                    with hardware_check._signals.held():
                        shutil.rmtree(scratch, ignore_errors=True)
        except Stopped as exc:
            raise ValidateInterrupted(exc.signum) from None
        except KeyboardInterrupt:  # raised some other way (the handler turns SIGINT into Stopped)
            raise ValidateInterrupted(signal.SIGINT) from None


def validate_lora_plan(plan_file: PlanFile, topo: Topology, trace: Trace, hf_config: dict, settings: RunSettings,
                       source: str = "<plan>", workdir: Path | None = None, measured_head: bool = False) -> dict:
    """``validate_plan`` for a LoRA or QLoRA fine-tune: checked, simulated, run by the
    fine-tuning worker and compared per GPU; each row gains ``predicted_trainable_params``
    (the trace's) and ``peft_params`` (PEFT's trainable and total count on the rank).
    ``workdir``: run there and keep the job and the ranks' results (else a scratch folder).
    ``measured_head`` (CPU only): the prediction again with the head's backward workspace
    measured in this process (``measured_head_rows``), beside the plain one."""
    check_runnable(plan_file, topo, trace, settings, source)
    check_lora_runnable(plan_file, trace, source)
    assert trace.spec.finetune is not None
    model = FineTuneModel(hf_config, int(trace.spec.model["seq_len"]), str(trace.spec.model["attention"]),
                          trace.spec.finetune.model_dump())
    if measured_head and not settings.device.startswith("cpu"):
        raise MpsimError(f"{source}: the head's backward workspace is measured on CPU only")
    predicted = simulate_plan(plan_file, topo, trace)
    capacity = settings.capacity_bytes if settings.capacity_bytes is not None else topo.capacity_bytes
    measured = _run_stoppable(plan_file, model, settings, capacity, workdir)
    report: dict[str, Any] = compare(plan_file, predicted, measured)
    report.update(device=settings.device, torch_version=torch.__version__, fine_tune=trace.spec.finetune.describe(),
                  predicted_trainable_params=trace.trained_params, predicted_params=trace.spec.params)
    for row, m in zip(report["stages"], measured, strict=True):
        row["predicted_trainable_params"] = trace.trained_params
        if m is not None and not m.get("oom"):
            row.update(peft_params=m["peft_params"], losses=m["losses"])
    if measured_head:
        measured_head_rows(report, plan_file, topo, trace, model)
    return report


def measured_head_rows(report: dict, plan_file: PlanFile, topo: Topology, trace: Trace, model: FineTuneModel) -> None:
    """The plan simulated again with the head's backward workspace measured in this process
    on CPU (``validate/finetune.py``'s ``head_backward_workspace``, as ``mpsim trace
    --measure`` measures a layer) instead of the forward's a derived trace takes for it:
    ``report["head_backward_workspace_bytes"]`` (the trace's and the measured) and, per row,
    ``predicted_peak_bytes_measured_head`` and, where the rank measured, its
    ``peak_error_pct_measured_head``. The plain prediction stays the report's."""
    from mpsim.executor.finetune import head_backward_workspace

    head = next(r for r in trace.spec.layers if r.kind == "head")
    traced = head.bwd_workspace_bytes if head.bwd_workspace_bytes is not None else head.workspace_bytes
    n_bytes = head_backward_workspace(model.__dict__, plan_file.microbatch)
    again = simulate_plan(plan_file, topo, with_head_backward_workspace(trace, n_bytes))
    report["head_backward_workspace_bytes"] = {"trace": traced, "measured": n_bytes}
    for row in report["stages"]:
        peak = again.gpus[row["gpu"]].peak_bytes
        row["predicted_peak_bytes_measured_head"] = peak
        if "measured_peak_bytes" in row:
            measured = row["measured_peak_bytes"]
            row["peak_error_pct_measured_head"] = 100.0 * (peak - measured) / measured if measured else float("nan")


def with_head_backward_workspace(trace: Trace, n_bytes: int) -> Trace:
    """``trace`` with its head's backward workspace set to ``n_bytes`` (measured:
    ``validate/finetune.py``'s ``head_backward_workspace``), as ``mpsim trace --measure``
    records it; a derived trace has none and takes the head's forward workspace for it."""
    rows = [r.model_copy(update={"bwd_workspace_bytes": n_bytes}) if r.kind == "head" else r
            for r in trace.spec.layers]
    return Trace(trace.spec.model_copy(update={"layers": rows}), trace.source)
