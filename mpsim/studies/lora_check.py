"""LoRA and QLoRA fine-tuning predicted against measured: a Hugging Face decoder's config traced
with PEFT's adapters (``trace_hf(..., fine_tune=...)``), the plan run by the executor's
fine-tuning worker (``validate/finetune.py``: the same transformers model, PEFT's LoRA applied
by ``peft.get_peft_model``, QLoRA's base as ``adapters.QuantizedLinear``, AdamW over the
trained parameters) and compared per GPU (``hardware_check.compare``), each row with PEFT's
trainable and total parameter counts beside the trace's.

What the worker does not run is refused in one line before anything starts
(``check_lora_runnable``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.finetune import FineTune
from mpsim.models.trace import Trace
from mpsim.plans.plan import PlanFile
from mpsim.studies import hardware_check
from mpsim.studies.hardware_check import RunSettings, check_runnable, compare, simulate_plan

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
        shutil.rmtree(scratch, ignore_errors=True)


def validate_lora_plan(plan_file: PlanFile, topo: Topology, trace: Trace, hf_config: dict, settings: RunSettings,
                       source: str = "<plan>", workdir: Path | None = None) -> dict:
    """``validate_plan`` for a LoRA or QLoRA fine-tune: checked, simulated, run by the
    fine-tuning worker and compared per GPU; each row gains ``predicted_trainable_params``
    (the trace's) and ``peft_params`` (PEFT's trainable and total count on the rank).
    ``workdir``: run there and keep the job and the ranks' results (else a scratch folder)."""
    check_runnable(plan_file, topo, trace, settings, source)
    check_lora_runnable(plan_file, trace, source)
    assert trace.spec.finetune is not None
    model = FineTuneModel(hf_config, int(trace.spec.model["seq_len"]), str(trace.spec.model["attention"]),
                          trace.spec.finetune.model_dump())
    predicted = simulate_plan(plan_file, topo, trace)
    capacity = settings.capacity_bytes if settings.capacity_bytes is not None else topo.capacity_bytes
    if workdir is not None:
        measured = run_worker(plan_file, model, settings, capacity, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="mpsim-validate-lora-") as tmp:
            measured = run_worker(plan_file, model, settings, capacity, Path(tmp))
    report: dict[str, Any] = compare(plan_file, predicted, measured)
    report.update(device=settings.device, torch_version=torch.__version__, fine_tune=trace.spec.finetune.describe(),
                  predicted_trainable_params=trace.trained_params, predicted_params=trace.spec.params)
    for row, m in zip(report["stages"], measured, strict=True):
        row["predicted_trainable_params"] = trace.trained_params
        if m is not None and not m.get("oom"):
            row.update(peft_params=m["peft_params"], losses=m["losses"])
    return report


def with_head_backward_workspace(trace: Trace, n_bytes: int) -> Trace:
    """``trace`` with its head's backward workspace set to ``n_bytes`` (measured:
    ``validate/finetune.py``'s ``head_backward_workspace``), as ``mpsim trace --measure``
    records it; a derived trace has none and takes the head's forward workspace for it."""
    rows = [r.model_copy(update={"bwd_workspace_bytes": n_bytes}) if r.kind == "head" else r
            for r in trace.spec.layers]
    return Trace(trace.spec.model_copy(update={"layers": rows}), trace.source)
