"""The simulator against the recorded H100 runs in validate/results/h100/.

Each record is `mpsim validate --device cuda` on one H100 80GB HBM3 (torch 2.11.0+cu130):
the measured trace and probed topology it used are recorded beside it. Here the plan is
made and simulated again from those files, with no GPU, and its prediction is held to the
measured peak and step time: a change to the simulator that moves a GPU prediction away
from what the GPU did fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from mpsim.data.catalog import load_topology, load_trace
from mpsim.planners import plan_job
from mpsim.plans.job import JobSpec, Parallelism, pipeline
from mpsim.plans.plan import read_plan_file
from mpsim.studies.hardware_check import simulate_plan

RECORDS = Path(__file__).resolve().parents[1] / "validate" / "results" / "h100"
#: Peak error allowed per record (predicted - measured) / measured. Keep, recompute and
#: selective recompute land within 1.2%; host swap is over-predicted (reports/validation_h100.md).
PEAK_TOLERANCE = {"none": 0.02, "recompute": 0.02, "selective": 0.02, "host": 0.10}


def _plan(name: str, record: dict, topo, trace):
    if name == "host":
        return read_plan_file(RECORDS / "plan_host.json")
    # recorded as "recompute" when that name checkpointed every layer, as recompute-all does now
    strategy = {"recompute": "recompute-all"}.get(record["strategy"], record["strategy"])
    job = JobSpec(topo, trace, record["schedule"], record["microbatches"], pipeline(1), strategy=strategy)
    return plan_job(job).plan


@pytest.mark.parametrize("name", sorted(PEAK_TOLERANCE))
def test_recorded_h100_run_is_predicted(name):
    record = json.loads((RECORDS / f"validate_{name}.json").read_text())
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["oom"] is None
    topo = load_topology(str(RECORDS / "probe.yaml"))
    trace = load_trace(str(RECORDS / "trace_fp32.json"))
    plan = _plan(name, record, topo, trace)
    result = simulate_plan(plan, topo, trace)
    measured_peak = record["stages"][0]["measured_peak_bytes"]
    predicted_peak = result.gpus[0].peak_bytes
    assert predicted_peak == pytest.approx(measured_peak, rel=PEAK_TOLERANCE[name])
    assert predicted_peak >= 0.98 * measured_peak  # never under by more than 2%
    # iteration within the 25% the validation targets allow (measured: +3% to +6%)
    assert result.iteration_s == pytest.approx(record["measured_iteration_s"], rel=0.25)


DP_RECORDS = RECORDS.parent / "h100_dp"
#: validate/gpu_dp_checks.sh on one H100: FSDP2 over a one-GPU mesh, reshard after forward on
#: and off (the gathered copy of every layer held to the last backward), and the same job
#: without ZeRO. Predicted within +1.3%, +0.7% and +0.8% when recorded.
DP_RUNS: dict[str, tuple[Literal[0, 1, 2, 3], bool]] = {"fsdp1": (3, True), "fsdp1_no_reshard": (3, False),
                                                        "ddp1": (0, True)}


@pytest.mark.parametrize("name", sorted(DP_RUNS))
def test_recorded_h100_fsdp_run_is_predicted(name):
    zero, reshard = DP_RUNS[name]
    record = json.loads((DP_RECORDS / f"validate_{name}.json").read_text())
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["oom"] is None
    assert (record["zero_stage"] or 0) == zero  # None: a plan with no data_parallel block
    topo = load_topology(str(DP_RECORDS / "probe.yaml"))
    trace = load_trace(str(DP_RECORDS / "trace_fp32.json"))
    layout = Parallelism(data=1, zero_stage=zero, pipeline=1, reshard_after_forward=reshard)
    plan = plan_job(JobSpec(topo, trace, record["schedule"], record["microbatches"], layout)).plan
    result = simulate_plan(plan, topo, trace)
    measured_peak = record["stages"][0]["measured_peak_bytes"]
    assert result.gpus[0].peak_bytes == pytest.approx(measured_peak, rel=0.02)
    assert result.gpus[0].peak_bytes >= 0.98 * measured_peak
    assert result.iteration_s == pytest.approx(record["measured_iteration_s"], rel=0.25)


OFFLOAD_RECORDS = RECORDS.parent / "h100_offload"


def test_recorded_h100_zero_infinity_peak_is_predicted():
    """OFFLOAD=1 validate/gpu_dp_checks.sh on one H100: ZeRO-Infinity as FSDP2 with CPU offload
    over a one-GPU mesh (parameter, gradient and Adam shards in host memory). The peak was
    predicted within 0.8%. The step was under-predicted by 54% even with the probe's own
    rate of torch's CPU Adam on the executor's one thread (0.127 Gparams/s): FSDP2's CPU
    work around it (gradient accumulation on the host) is not modelled, so time is not
    held here."""
    record = json.loads((OFFLOAD_RECORDS / "validate_zinf1.json").read_text())
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["oom"] is None
    topo = load_topology(str(OFFLOAD_RECORDS / "probe.yaml"))
    trace = load_trace(str(OFFLOAD_RECORDS / "trace_fp32.json"))
    job = JobSpec(topo, trace, record["schedule"], record["microbatches"], Parallelism(data=1, pipeline=1),
                  strategy="zero-infinity")
    result = simulate_plan(plan_job(job).plan, topo, trace)
    measured_peak = record["stages"][0]["measured_peak_bytes"]
    assert result.gpus[0].peak_bytes == pytest.approx(measured_peak, rel=0.02)
