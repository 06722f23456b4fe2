"""HSDP on CPU: mpsim's simulation of a two-server ZeRO-3 job beside FSDP2 on a (replicate=2,
shard=2) ``DeviceMesh`` of four gloo processes (``validate/hsdp.py``, ``validate/hsdp_check.py``),
two processes standing for each server of ``validate/results/cpu2x2-cluster.yaml``.

Fast: the simulated GPU's model states are the closed form, 16 bytes a parameter (fp32
weights and gradients, Adam's two states) over the GPUs that shard them: a server's under
HSDP, every GPU under FSDP.

Under torchrun (about 25 s a run on 2 cores): the ranks hold exactly that share, the
replicas end with identical parameters, and each rank's peak is the simulator's within
``TOLERANCE``. Under HSDP with 1F1B, torch 2.13's FSDP2 keeps each layer's all-reduce buffer
(its reduce-scattered gradient shard, ``FSDPParamGroup._all_reduce_state``) referenced until
the layer's next backward, so one more set of sharded gradients (P/N bytes) lives through
the next microbatch's forward; the simulator holds it the same way
(``DataParallel._hold_all_reduce_buffer``), and the test checks torch still does.
"""

from __future__ import annotations

from functools import cache

import pytest

from mpsim.executor.hsdp_check import (
    check,
    executor_plan,
    hsdp_job,
    load_cluster,
    mesh_of,
    simulate,
)
from mpsim.hardware.cluster import Cluster
from mpsim.models.trace import Trace
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ZOO
from mpsim.studies.hardware_check import RunSettings

CFG, MICROBATCH, _ = ZOO["gpt-tiny"]
"""The report's model: 8 layers of 256, 128 tokens, vocabulary 512, microbatch 4. A 2-layer
version runs twice as fast but the simulator's ZeRO-3 over-prediction (one layer's
gathered parameters, about 3 MiB, on either mesh) is then 7.8% of its peak."""
SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=1, digests=True, timeout_s=120)
TOLERANCE_PCT = 4.0
"""Measured here: FSDP x4 +2.5% on gpt-tiny (the data-parallel report has FSDP x2 at +2.1%
and +2.5 to +3.0% with two stages); HSDP x4 +2.1% once the held all-reduce buffers are
dropped. The simulator over-predicts ZeRO-3 on CPU by 2-3%, so 4% leaves about 1% for
run-to-run noise of the tracker's peak (none was seen in repeated runs)."""


@cache
def cluster() -> Cluster:
    return load_cluster()


@cache
def fake_trace() -> Trace:
    return trace_model(CFG, MICROBATCH, "fp32")


def param_bytes(trace: Trace) -> int:
    return sum(row.param_bytes for row in trace.layers)


def test_cluster_file_is_two_servers_of_two_cpu_devices_over_loopback() -> None:
    c = cluster()
    assert (c.gpus_per_server, c.spec.max_servers, c.spec.fabric.kind) == (2, 2, "single-switch")
    assert c.server.name == "cpu-probe-x2"  # validate/results/cpu2.yaml, resolved beside the cluster file
    assert "loopback" in c.spec.fabric.source


@pytest.mark.parametrize("hsdp, ways", [(True, 2), (False, 4)], ids=["hsdp", "fsdp"])
def test_simulated_model_states_are_16_bytes_a_parameter_over_the_sharding_gpus(hsdp: bool, ways: int) -> None:
    trace = fake_trace()
    n_params = param_bytes(trace) // 4  # fp32
    job = hsdp_job(cluster(), trace, "1f1b", 2, hsdp)
    assert job.layout_name == ("HSDP x4" if hsdp else "FSDP x4") and job.n_gpus == 4
    sim = simulate(job)
    assert len(sim.gpus) == 2  # the engine simulates server 0; server 1 mirrors it
    for g in sim.gpus:
        assert int(g.memory_used_bytes[-1]) == 16 * n_params // ways  # weights, gradients, Adam x2 at rest
        assert g.breakdown["optimizer"] == 8 * n_params // ways


def test_the_executor_plan_and_mesh_are_the_jobs() -> None:
    for hsdp, mesh in ((True, [2, 2]), (False, [4])):
        job = hsdp_job(cluster(), fake_trace(), "1f1b", 2, hsdp)
        plan = executor_plan(job)
        assert plan.data_parallel is not None and plan.data_parallel.zero_stage == 3
        assert plan.data_parallel.replicas == [[0], [1], [2], [3]]
        assert [st.layers for st in plan.stages] == [(0, CFG.layers + 2)]
        assert mesh_of(job) == mesh


@pytest.fixture(scope="module")
def measured_trace() -> Trace:
    """The model's layers measured here (as ``mpsim validate`` measures its preset)."""
    from mpsim.models.profiler import measure_trace

    return measure_trace(CFG, MICROBATCH, "fp32", "cpu", 1, name="gpt-tiny")


def _check(trace: Trace, hsdp: bool) -> dict:
    report = check(cluster(), trace, CFG, "1f1b", 2, hsdp, SETTINGS)
    assert [(r["rank"], r["server"], r["local_gpu"]) for r in report["ranks"]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert len({r["params_sha256"] for r in report["ranks"]}) == 1  # replicas on their own tokens, one model
    assert len({tuple(r["losses"]) for r in report["ranks"]}) == 4
    return report


def _assert_states(report: dict, trace: Trace, ways: int) -> None:
    """Each rank holds 1/ways of the weights and gradients and 2/ways in Adam's states (its
    step counters aside), as the simulation does."""
    p = param_bytes(trace)
    for r in report["ranks"]:
        held = r["measured_model_state_bytes"]
        assert held["params"] == held["grads"] == p // ways
        assert 0 <= held["optimizer"] - 2 * p // ways < 4 * 128  # a 4-byte step count per tensor (101 here)
        assert r["predicted_states_bytes"] == 4 * p // ways


@pytest.mark.torchrun
def test_fsdp_over_four_ranks_peaks_as_simulated(measured_trace: Trace) -> None:
    report = _check(measured_trace, hsdp=False)
    _assert_states(report, measured_trace, 4)
    for r in report["ranks"]:
        assert abs(r["peak_error_pct"]) <= TOLERANCE_PCT, r


@pytest.mark.torchrun
def test_hsdp_shards_inside_a_server_and_peaks_as_simulated_plus_torchs_held_buffers(measured_trace: Trace) -> None:
    report = _check(measured_trace, hsdp=True)
    _assert_states(report, measured_trace, 2)
    held = param_bytes(measured_trace) // 2  # one more set of sharded gradients (module doc), now simulated
    for r in report["ranks"]:
        assert abs(r["peak_error_pct"]) <= TOLERANCE_PCT, r
        # torch still holds the buffers: if this fails, FSDP2 frees them and the simulation should stop holding them
        assert r["measured_peak_bytes"] > r["predicted_peak_bytes"] - held / 2, r
