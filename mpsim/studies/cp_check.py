"""``mpsim validate`` with context parallelism: the plan run by the executor's context-parallel
worker (``validate/context_parallel.py``: each rank's load-balanced 1/c of every sequence,
ring attention over gloo point-to-point, gradients reduced over data x context) and
compared per GPU with the simulator's prediction (``mpsim.models.context_parallel``'s
shard, the context axis of ``mpsim.plans.context_parallel``), each row with its context
and data-parallel rank and the losses the rank recorded.

What the worker does not run is refused in one line before anything starts
(``check_cp_runnable``)."""

from __future__ import annotations

from pathlib import Path

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.trace import Trace
from mpsim.plans.plan import PlanFile
from mpsim.studies.hardware_check import RunSettings, check_runnable, measure, model_config

CP_ATTENTION = ("flash", "mem-efficient")
"""Attention backends the worker splits (its ring runs their fused kernel, block by block)."""
CP_FAMILIES = ("gpt", "llama")
"""Model families the worker runs: causal decoders (BERT's bidirectional layers are not run)."""


def check_cp_runnable(plan_file: PlanFile, trace: Trace, source: str) -> None:
    """Refuse, in one line, a context-parallel plan the executor cannot run
    (``validate/context_parallel.py``): a pipeline, tensor or expert parallelism, ZeRO,
    actions other than keep, a host optimizer, attention other than ring attention over a
    fused kernel (flash, mem-efficient), a model other than a causal GPT or a Llama of the
    megatron framework, or a sequence that does not cut into 2c equal chunks."""
    c = plan_file.context
    context_attention = plan_file.mesh.context_attention if plan_file.mesh is not None else "ring"
    dp = plan_file.data_parallel
    model = trace.spec.model
    family, attention = model.get("family"), model.get("attention", "eager")
    seq = int(model.get("seq_len") or 0)
    refusals = [
        (len(plan_file.stages) > 1, "one pipeline stage (give --stages 1)"),
        (plan_file.tensor_parallel is not None, "no tensor parallelism"),
        (plan_file.expert > 1, "no expert parallelism"),
        (dp is not None and dp.zero_stage != 0, "no ZeRO (DDP: --zero 0)"),
        (any(a.action != "keep" for st in plan_file.stages for a in st.actions), "strategy none (every layer kept)"),
        (any(st.optimizer != "gpu" for st in plan_file.stages), "the optimizer on the device"),
        (context_attention != "ring", f"ring attention (--cp-attention ring, not {context_attention})"),
        (family not in CP_FAMILIES, f"a causal GPT or Llama (not {family})"),
        (family == "llama" and model.get("framework", "megatron") != "megatron",
         "Llama layers of the megatron framework (RoPE tables built in each layer)"),
        (attention not in CP_ATTENTION, f"flash or mem-efficient attention (not {attention})"),
        (seq % (2 * c) != 0, f"a sequence that cuts into 2 x {c} equal chunks (not {seq} tokens)"),
    ]
    for refused, needs in refusals:
        if refused:
            raise MpsimError(f"{source}: the executor runs context parallelism with {needs}")


def validate_cp_plan(plan_file: PlanFile, topo: Topology, trace: Trace, settings: RunSettings,
                     source: str = "<plan>", workdir: Path | None = None) -> dict:
    """``validate_plan`` for context parallelism: checked (``check_runnable``,
    ``check_cp_runnable``), simulated, run by the executor's context-parallel worker and
    compared per GPU; each row gains its ``cp_rank``, ``dp_rank`` and ``losses`` (the
    context group's, per step). ``workdir``: run there and keep the job and the ranks'
    results (else a scratch folder)."""
    if plan_file.context < 2:
        raise MpsimError(f"{source}: the plan has no context axis of 2 or more GPUs")
    check_runnable(plan_file, topo, trace, settings, source)
    check_cp_runnable(plan_file, trace, source)
    report, measured = measure(plan_file, topo, trace, model_config(trace), settings, workdir)
    for row, m in zip(report["stages"], measured, strict=True):
        if m is not None and not m.get("oom"):
            row.update(cp_rank=m["cp_rank"], dp_rank=m["dp_rank"], losses=m["losses"])
    report.update(context_parallel=plan_file.context, context_attention="ring")
    return report
