"""A mixture of experts with expert parallelism predicted against measured on CPU: `mpsim
validate` (the executor's expert-parallel worker under torchrun, gloo) at EP = 2 and at
EP = 2 x DP = 2, with DDP = 2 of the same model (no expert parallelism) as the control, on
the tiny Mixtral config tests/data/tiny-mixtral.json traced as `mpsim trace --hf` traces it.
Prints the markdown of reports/validation_moe_cpu.md.

    python benchmarks/validation_moe.py > reports/validation_moe_cpu.md

The topology is probed for four CPU devices first and given with --server. The gap's
attribution is measured here too: the head's real backward workspace (MemTracker, as
`mpsim trace --measure` measures it) against the one the FakeTensor trace assumes, and the
EP = 2 prediction again with the measured figure in the trace.
"""

from __future__ import annotations

import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.nn import functional as F

from mpsim import api
from mpsim.api.jobs import predicted_routed_copies
from mpsim.executor.expert_parallel import build_model
from mpsim.models.hf import trace_hf
from mpsim.models.probe import probe
from mpsim.models.profiler import backward_workspace_bytes
from mpsim.models.trace import Trace
from mpsim.plans.job import Parallelism
from mpsim.plans.plan import PlanFile
from mpsim.studies.hardware_check import simulate_plan

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-mixtral.json"
RUNS = [("EP=2", 2, 1), ("EP=2 x DP=2", 2, 2), ("DDP=2 (control, no EP)", 1, 2)]  # (label, ep, dp)
MICROBATCHES = 2
MIB = 2**20
COLUMNS = ["layout", "GPU", "ep rank", "dp rank", "predicted peak MiB", "measured MiB", "peak error", "activations MiB",
           "routed copies: predicted / received / real router", "iteration"]
HEADER = f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}"


def _layout(ep: int, dp: int) -> Parallelism:
    return Parallelism(data=dp, axes=(("expert", ep),) if ep > 1 else (), pipeline=1)


def _span(values: list[int]) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def _rows(label: str, report: dict) -> list[str]:
    rows = []
    for g in report["stages"]:
        pred, meas = g["predicted_breakdown"], g["measured_breakdown"]
        rows.append(f"| {label} | {g['gpu']} | {g['ep_rank']} | {g['dp_rank']} | "
                    f"{g['predicted_peak_bytes'] / MIB:.2f} | {g['measured_peak_bytes'] / MIB:.2f} | "
                    f"{g['peak_error_pct']:+.2f}% | "
                    f"{pred['activations'] / MIB:.2f} / {meas['activations'] / MIB:.2f} | "
                    f"{g['predicted_routed_copies']} / {_span(g['measured_routed_copies'])} / "
                    f"{_span(g['router_routed_copies'])} | "
                    f"{report['predicted_iteration_s'] * 1e3:.0f} / {report['measured_iteration_s'] * 1e3:.0f} ms |")
    return rows


class _Head(nn.Module):
    """The trace's head (final norm, vocabulary projection, cross-entropy) as one module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m: Any = self.model
        logits = m.lm_head(m.model.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def head_backward_workspace(trace: Trace) -> int:
    """The head's backward workspace measured here (``profiler.backward_workspace_bytes``)."""
    config = json.loads(CONFIG.read_text())
    torch.manual_seed(0)
    model = build_model({"hf_config": config, "seq_len": trace.spec.model["seq_len"],
                         "attention": trace.spec.model["attention"]}, 1)
    b, s = trace.spec.microbatch, trace.spec.model["seq_len"]
    x = torch.randn(b, s, config["hidden_size"], requires_grad=True)
    labels = torch.randint(0, config["vocab_size"], (b, s))
    head = _Head(model)
    return backward_workspace_bytes(head, [x, labels], lambda m, *a: m(*a))


def with_head_workspace(trace: Trace, n_bytes: int) -> Trace:
    rows = [r.model_copy(update={"bwd_workspace_bytes": n_bytes}) if r.kind == "head" else r for r in trace.layers]
    return Trace(trace.spec.model_copy(update={"layers": rows}), trace.source)


def _ep2_plan(trace: Trace, server: Path) -> PlanFile:
    return api.plan(str(server), trace, "1f1b", microbatches=MICROBATCHES, n_stages=1, parallelism=_layout(2, 1)).plan


def main() -> None:
    rows: list[str] = []
    reports: dict[str, dict] = {}
    trace = trace_hf(str(CONFIG), microbatch=1, recipe="fp32")
    with tempfile.TemporaryDirectory() as tmp:
        server = Path(tmp) / "cpu4.yaml"
        server.write_text(yaml.safe_dump(probe("cpu", devices=4, threads=1)[0], sort_keys=False))
        for label, ep, dp in RUNS:
            reports[label] = api.validate(str(CONFIG), server=str(server), strategy="none", schedule="1f1b",
                                          microbatches=MICROBATCHES, stages=1, steps=3, warmup=1,
                                          parallelism=_layout(ep, dp))
            rows += _rows(label, reports[label])
        plan = _ep2_plan(trace, server)
        topo = api.load_topology(str(server))
        head_ws = head_backward_workspace(trace)
        again = simulate_plan(plan, topo, with_head_workspace(trace, head_ws)).gpus[0].peak_bytes
    head = next(r for r in trace.layers if r.kind == "head")
    ep2 = reports["EP=2"]["stages"][0]
    measured, predicted = ep2["measured_peak_bytes"], ep2["predicted_peak_bytes"]
    copies = predicted_routed_copies(plan, trace)
    moe = trace.spec.model["moe"]
    tokens = trace.spec.microbatch * trace.spec.model["seq_len"]
    print(f"""# Validation of a mixture of experts with expert parallelism on CPU

Regenerated by `python benchmarks/validation_moe.py > reports/validation_moe_cpu.md`. Each layout is
`mpsim validate --model tests/data/tiny-mixtral.json --server cpu4.yaml --ep E --dp D --stages 1
--microbatches {MICROBATCHES}` (1F1B on one stage, topology probed here for 4 CPU devices). The model is a
tiny Mixtral config ({trace.spec.model['layers']} layers, hidden {trace.spec.model['hidden']}, \
{moe['experts']} experts of width {moe['expert_ffn_hidden']}, top-{moe['top_k']},
vocabulary {trace.spec.model['vocab']}, {trace.spec.model['seq_len']} tokens a sample, microbatch \
{trace.spec.microbatch}), traced as `mpsim trace --hf CONFIG --recipe fp32`
traces it (FakeTensor, {trace.spec.model['attention']} attention, the routed experts under the stated uniform
load), and the executor (`validate/expert_parallel.py`) runs the same transformers model under torchrun with gloo:
each rank holds the dense part whole and {moe['experts']}/E experts, each MoE layer's routed copies are
dispatched to their experts' ranks and combined back with `all_to_all_single`, the dense gradients
are all-reduced over data x EP and the experts' over the expert-data-parallel group (the `dp`
dimension of a `DeviceMesh`). Each rank's peak (MemTracker) is compared with the simulator's
prediction for its GPU. Machine: {platform.machine()}, torch {reports['EP=2']['torch_version']}.
Error = (predicted - measured) / measured; target: every rank's peak within 5%. Activations:
everything but parameters, gradients and Adam's states (predicted / measured).

**Routing is forced.** The router runs for real (its top-k weights scale the experts' outputs),
but which expert each routed copy goes to is set to the trace's stated uniform load: a
microbatch's T k = {tokens} x {moe['top_k']} copies, in token order, go to the experts in contiguous blocks of
T k / E = {tokens * moe['top_k'] // moe['experts']}, so each expert-parallel rank receives exactly what the
simulator's shard sends it. Routed copies per MoE layer and microbatch: predicted (the shard's dispatch bytes over
the fp32 hidden state) / received (forced) / what the real router chose for that rank's experts,
summed over the ranks of its expert group (min-max over the measured step's {2 * MICROBATCHES} MoE layer calls).
Iteration: predicted / measured, the slowest rank.

{HEADER}
{chr(10).join(rows)}

Parameters, gradients and Adam's states agree to the byte on every rank (Adam's step
counters aside): each expert-parallel rank holds 1/E of the experts' weights, as the
simulator's shard does. Every rank's experts receive exactly the copies predicted; the real
router, left to choose, would have sent the ranks uneven shares (the real router's figures), which the
simulator models only when told (`--expert-load`).

The gap is in the activations, and it is not expert parallelism's: the control without
expert parallelism (DDP = 2, the experts whole and run by `mpsim.models.moe`'s traced code
itself) has the same activations, predicted and measured, as EP = 2 and EP = 2 x DP = 2 (the
dispatch's and combine's buffers do not raise the peak). It is the FakeTensor trace's: a
derived trace has no measured backward workspace and takes each layer's forward workspace
for it. The head's real backward (cross-entropy and the vocabulary projection) holds
{head_ws:,} bytes (MemTracker, as `mpsim trace --measure` measures it) against the
{head.workspace_bytes:,} assumed; with the measured figure in the trace the EP = 2 prediction is
{again / MIB:.2f} MiB ({100 * (again - measured) / measured:+.2f}% against {measured / MIB:.2f} measured, from \
{100 * (predicted - measured) / measured:+.2f}%). The
remaining {measured - again:,} bytes are not attributed yet.

Iteration time is not a target here: the trace is derived (no kernel table for a CPU), and gloo's
all-to-alls and reductions run on the same two cores as the compute.""")
    assert copies == ep2["predicted_routed_copies"]


if __name__ == "__main__":
    main()
