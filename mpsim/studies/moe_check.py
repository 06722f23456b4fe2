"""``mpsim validate`` for a mixture of experts: its Hugging Face config traced here, the plan
run by the executor's expert-parallel worker (``validate/expert_parallel.py``: each rank's
block of experts, the routed copies sent with all-to-alls, routing forced to the trace's
uniform load) and compared per GPU, each rank's routed copies per MoE layer beside the
simulator's (``mpsim.models.expert_parallel``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mpsim.datafile import read_bounded
from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.trace import Trace
from mpsim.plans.plan import PlanFile
from mpsim.studies.hardware_check import RunSettings, check_runnable, measure

MOE_FAMILIES = ("mixtral", "olmoe", "qwen3_moe")
"""Hugging Face MoE families ``validate`` runs (routed experts only: ``validate/expert_parallel.py``)."""


def moe_config(model: str) -> dict | None:
    """``model``'s Hugging Face config when it names a config.json of a mixture of experts
    (a JSON file with a ``model_type`` of ``moe.FAMILIES``), else None; one line for an MoE
    family the executor does not run."""
    from mpsim.models import moe

    path = Path(model)
    if path.suffix != ".json" or not path.is_file():
        return None
    try:  # bounded as any model file (a trace file may come here too)
        raw = json.loads(read_bounded(path, "trace"))
    except ValueError:
        return None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind not in moe.FAMILIES:
        return None
    if kind not in MOE_FAMILIES:
        raise MpsimError(f"--model {model}: the executor runs the MoE families {', '.join(MOE_FAMILIES)}, not {kind} "
                         "(not shared experts, DeepSeek's group-limited router or gpt-oss)")
    return raw


def moe_trace(model: str, microbatch: int | None) -> Trace:
    """The MoE config traced as ``mpsim trace --hf CONFIG --recipe fp32`` traces it (FakeTensor,
    uniform routing); the executor runs the same transformers model."""
    from mpsim.models.hf import trace_hf

    return trace_hf(model, microbatch=microbatch, recipe="fp32")


def check_moe_runnable(plan_file: PlanFile, trace: Trace, source: str) -> None:
    """Refuse, in one line, an MoE plan the executor cannot run (``validate/expert_parallel.py``):
    a pipeline, tensor parallelism, ZeRO, actions other than keep, a host optimizer, a
    capacity factor, or routed copies that do not split evenly over the experts."""
    dp = plan_file.data_parallel
    block = trace.spec.model.get("moe") or {}
    refusals = [
        (len(plan_file.stages) > 1, "one pipeline stage (give --stages 1)"),
        (plan_file.tensor_parallel is not None, "no tensor parallelism"),
        (dp is not None and dp.zero_stage != 0, "no ZeRO (DDP: --zero 0)"),
        (any(a.action != "keep" for st in plan_file.stages for a in st.actions), "strategy none (every layer kept)"),
        (any(st.optimizer != "gpu" for st in plan_file.stages), "the optimizer on the device"),
        (block.get("capacity_factor") is not None, "no capacity factor"),
        (plan_file.microbatch * trace.spec.model["seq_len"] * block.get("top_k", 1) % max(1, block.get("experts", 1)),
         "routed copies (microbatch x sequence x top-k) that split evenly over the experts"),
    ]
    for refused, needs in refusals:
        if refused:
            raise MpsimError(f"{source}: the executor runs a mixture of experts with {needs}")


def validate_moe_plan(plan_file: PlanFile, topo: Topology, trace: Trace, hf_config: dict, settings: RunSettings,
                      source: str = "<plan>", workdir: Path | None = None) -> dict:
    """``validate_plan`` for a mixture of experts: checked, simulated, run by the executor's
    expert-parallel worker (``validate/expert_parallel.py``) and compared per GPU, with
    each rank's routed copies per MoE layer beside the simulator's (``_routed_rows``).
    ``workdir``: run there and keep the job and the ranks' results (else a scratch folder)."""
    check_runnable(plan_file, topo, trace, settings, source)
    check_moe_runnable(plan_file, trace, source)
    model = HfModel(hf_config, trace.spec.model["seq_len"], trace.spec.model["attention"])
    report, measured = measure(plan_file, topo, trace, model, settings, workdir)  # the worker reads hf_config
    _routed_rows(report, plan_file, trace, measured)
    report.update(expert_parallel=plan_file.expert, routing="forced to the trace's uniform load",
                  hf_config=hf_config)
    return report


@dataclass(frozen=True)
class HfModel:
    """What the executor's expert-parallel worker builds: the Hugging Face config, the
    traced sequence length and attention kernel."""

    hf_config: dict
    seq_len: int
    attention: str


def predicted_routed_copies(plan_file: PlanFile, trace: Trace) -> int:
    """Routed copies one GPU's experts receive per MoE layer and microbatch, as the
    simulator's shard says (its dispatch bytes over the fp32 hidden state; the busiest
    GPU's under the job's load, uniform here)."""
    from mpsim.models.expert_parallel import expert_shard

    shard = expert_shard(trace.rescale(plan_file.microbatch), plan_file.expert)
    rows = [r for r in shard.layers if r.experts]
    return rows[0].dispatch_bytes // (trace.spec.model["hidden"] * 4) if rows else 0


def _routed_rows(report: dict, plan_file: PlanFile, trace: Trace, measured: list[dict | None]) -> None:
    """Each GPU's row gains the routed copies per MoE layer call: predicted, received
    (forced) and what the real router chose for its experts."""
    predicted = predicted_routed_copies(plan_file, trace)
    for row, m in zip(report["stages"], measured, strict=True):
        row["predicted_routed_copies"] = predicted
        if m is not None and m.get("routed"):
            row["measured_routed_copies"] = m["routed"]["received_per_call"]
            row["router_routed_copies"] = m["routed"]["router_per_call"]
            row.update(ep_rank=m["ep_rank"], dp_rank=m["dp_rank"])
