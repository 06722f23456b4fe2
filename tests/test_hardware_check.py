"""The executor against the simulator on CPU (gloo, torchrun, 2 to 4 processes, gpt-tiny).

Each run marked ``torchrun`` starts real processes and trains a few steps (about 15 s each
on 2 cores; ``-m "not torchrun"`` leaves them out). Targets (issue "Checking plans on real
hardware"): per-stage peak within 5% of the measured peak and never below it by more than
2%. Measured iteration times are printed with each report, not asserted: on a shared
machine they swing with its load.
"""

from __future__ import annotations

import pytest

from mpsim.errors import MpsimError, SchemaError
from mpsim.models.probe import probe
from mpsim.models.profiler import measure_trace
from mpsim.models.workloads import ZOO
from mpsim.plans.plan import LayerAction, make_plan
from mpsim.sim import simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.studies.hardware_check import RunSettings, check_runnable, validate_plan
from mpsim.views.measured import validation_text

SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=1)
"""The peaks and breakdowns asserted are measured at the step before the timed ones (the
executor's step 2), so one timed step is enough: more only steadied the printed time."""


@pytest.fixture(scope="module")
def tiny():
    cfg, mb, recipe = ZOO["gpt-tiny"]
    return measure_trace(cfg, mb, recipe, "cpu", threads=1, warmup=1, repeats=5, name="gpt-tiny")


@pytest.fixture(scope="module")
def cpu2():
    return probe("cpu", devices=2, threads=1, memory_mib=2048)[1]


def _plan(trace, topo, schedule, strategy, actions=None, stages=((0, 5), (5, 10)), optimizer=None):
    return make_plan(trace, topo, schedule, 4, list(stages), list(range(len(stages))), strategy, actions, optimizer)


def _assert_peaks(report, within_pct=5.0, under_pct=2.0):
    print(validation_text(report))  # with the measured iteration time, for the record
    for row in report["stages"]:
        err = row["peak_error_pct"]
        assert -under_pct <= err <= within_pct, validation_text(report)


def test_measured_trace_names_its_device_and_times_every_layer(tiny):
    assert tiny.spec.source.kind == "measured" and tiny.spec.source.device.startswith("cpu")
    assert all(r.fwd_ms and r.bwd_ms for r in tiny.layers)
    block = tiny.layers[1]
    # the backward's transients exceed the forward's largest temporary (gradients of scores, MLP)
    assert block.bwd_workspace_bytes > block.workspace_bytes
    # saved bytes from real tensors are what the FakeTensor tracer counts
    from mpsim.models.tracer import trace_model

    derived = trace_model(ZOO["gpt-tiny"][0], 4, "fp32")
    assert [r.act_bytes for r in tiny.layers] == [r.act_bytes for r in derived.layers]


def test_per_microbatch_receive_buffers_are_allocated_once(tiny, cpu2):
    plan = _plan(tiny, cpu2, "gpipe", "none")
    base = simulate_job(job_of_plan(cpu2, tiny, plan))
    kept = simulate_job(job_of_plan(cpu2, tiny, plan, runtime="torch-pipelining"))
    boundary = tiny.layers[4].output_bytes
    assert kept.gpus[0].breakdown["buffers"] >= 4 * boundary  # 4 gradient buffers on stage 0
    assert kept.gpus[1].peak_bytes - base.gpus[1].peak_bytes <= 4 * boundary


@pytest.mark.torchrun
@pytest.mark.parametrize("schedule,strategy", [("1f1b", "keep"), ("gpipe", "recompute")])
def test_keep_and_recompute_peaks(tiny, cpu2, schedule, strategy):
    actions = None
    if strategy == "recompute":
        actions = {0: [LayerAction(layer=j, action="recompute") for j in range(1, 5)],
                   1: [LayerAction(layer=j, action="recompute") for j in range(5, 9)]}
    report = validate_plan(_plan(tiny, cpu2, schedule, strategy, actions), cpu2, tiny, SETTINGS)
    assert report["oom"] is None
    _assert_peaks(report)
    for row in report["stages"]:  # weights, gradients and Adam's states are exact
        for k in ("params", "grads"):
            assert row["predicted_breakdown"][k] == row["measured_breakdown"][k]


@pytest.mark.torchrun
def test_host_swap_is_never_under_predicted(tiny, cpu2):
    actions = {0: [LayerAction(layer=j, action="host") for j in (1, 2, 3)],
               1: [LayerAction(layer=j, action="host") for j in (5, 6)]}
    report = validate_plan(_plan(tiny, cpu2, "1f1b", "host", actions), cpu2, tiny, SETTINGS)
    _assert_peaks(report, within_pct=20.0)
    last = report["stages"][1]
    assert abs(last["peak_error_pct"]) <= 5


@pytest.mark.torchrun
def test_four_stages_with_split_and_host_optimizer(tiny):
    topo = probe("cpu", devices=4, threads=1, memory_mib=2048)[1]
    actions = {0: [LayerAction(layer=1, action="recompute")], 1: [LayerAction(layer=3, action="recompute")],
               3: [LayerAction(layer=8, action="recompute", split=2)]}
    plan = _plan(tiny, topo, "gpipe", "mixed", actions, stages=((0, 3), (3, 5), (5, 7), (7, 10)),
                 optimizer={3: "host-update"})
    report = validate_plan(plan, topo, tiny, SETTINGS)
    _assert_peaks(report)
    assert report["stages"][3]["measured_breakdown"]["optimizer"] == 0  # Adam's states live on the host


@pytest.mark.torchrun
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_out_of_memory_is_a_result(tiny, cpu2, schedule):
    # torch's pipelining wraps a stage's out-of-memory in its own RuntimeError (every 1F1B
    # step, GPipe's backward): the executor still reports it as a result.
    plan = _plan(tiny, cpu2, schedule, "none")
    settings = RunSettings(device="cpu", threads=1, warmup=0, steps=1, capacity_bytes=100 * 2**20)
    report = validate_plan(plan, cpu2, tiny, settings)
    oom = report["oom"]
    assert oom is not None and oom["step"] == 1 and oom["stage"] == 0
    assert oom["phase"] == "pipeline forward" and "bytes on a 104857600-byte device" in oom["message"]
    assert report["predicted_fits"] is True  # the probed topology had 2 GiB per device
    assert "OUT OF MEMORY: stage 0 (GPU 0) at step 1, pipeline forward" in validation_text(report)


@pytest.mark.torchrun
def test_validate_command_reports_out_of_memory_under_1f1b_and_exits_1(capsys):
    from mpsim.cli import main

    code = main(["validate", "--strategy", "none", "--schedule", "1f1b", "--memory-mib", "100",
                 "--steps", "1", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "OUT OF MEMORY: stage 0 (GPU 0) at step 1, pipeline forward" in out
    assert "executor failed" not in out + err


def test_an_out_of_memory_wrapped_by_the_pipeline_is_found():
    from mpsim.executor.executor import StageOutOfMemory, out_of_memory_in

    oom = StageOutOfMemory("backward tried to hold 5 bytes on a 4-byte device")
    try:
        try:
            raise oom
        except StageOutOfMemory as inner:
            raise RuntimeError("[Stage 0] failed to run backward\nkwargs: {}") from inner
    except RuntimeError as wrapped:
        assert out_of_memory_in(wrapped) is oom
        try:
            raise ValueError("while handling it") from None
        except ValueError as unrelated:
            assert out_of_memory_in(unrelated) is None
    assert out_of_memory_in(RuntimeError("not memory")) is None


def test_bad_plans_and_devices_are_refused_before_running(tiny, cpu2):
    plan = _plan(tiny, cpu2, "1f1b", "none")
    with pytest.raises(MpsimError, match="no CUDA GPU"):
        check_runnable(plan, cpu2, tiny, RunSettings(device="cuda"))
    pipedream = _plan(tiny, cpu2, "pipedream", "none")
    with pytest.raises(MpsimError, match="PipeDream"):
        check_runnable(pipedream, cpu2, tiny, SETTINGS)
    short = tiny.with_layers(6)
    with pytest.raises(SchemaError, match="stages"):
        check_runnable(plan, cpu2, short, SETTINGS)
    too_fine = _plan(tiny, cpu2, "1f1b", "none", {0: [LayerAction(layer=1, split=8)]})
    with pytest.raises(MpsimError, match="splits a microbatch of 4 into 8"):
        check_runnable(too_fine, cpu2, tiny, SETTINGS)
    segments = plan.model_copy(update={"recompute_checkpoints": "segment"})
    with pytest.raises(MpsimError, match="checkpoints every recomputed layer on its own"):
        check_runnable(segments, cpu2, tiny, SETTINGS)


# -- how a failed launch is read (torchrun faked: each attempt writes what a real one did) ----

def _fake_runs(monkeypatch, attempts: list[tuple[int, list[int], str]]):
    """Each attempt: torchrun's exit code, the ranks that wrote their result, its stderr."""
    import subprocess

    from mpsim.studies import hardware_check as hc

    calls: list[int] = []

    def launch(cmd, env, settings, workdir):
        code, wrote, stderr = attempts[len(calls)]
        calls.append(code)
        out = workdir / "ranks"
        out.mkdir(parents=True, exist_ok=True)
        for r in wrote:
            (out / f"rank{r}.json").write_text(f'{{"rank": {r}, "oom": null}}')
        return subprocess.CompletedProcess(cmd, code, "", stderr)

    monkeypatch.setattr(hc, "_launch", launch)
    monkeypatch.setattr(hc, "rank_places", lambda plan: [(0, 0, 0), (1, 0, 0)])
    return calls


ABORT = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  exitcode  : -6 (pid: 1)"


def _run_fake(tmp_path):
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import ModelConfig
    from mpsim.studies.hardware_check import run_executor

    cfg = ModelConfig("gpt", 1, 64, 2, 32, 128)
    plan = make_plan(trace_model(cfg, 1, "fp32"), probe("cpu", devices=2, threads=1)[1], "gpipe", 1,
                     [(0, 3)], [0], "keep")
    return run_executor(plan, cfg, RunSettings(), None, tmp_path)


def test_a_rank_killed_by_a_signal_is_run_once_more(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, [(1, [0], ABORT), (0, [0, 1], "")])
    assert [r["rank"] for r in _run_fake(tmp_path)] == [0, 1] and calls == [1, 0]


def test_a_run_whose_ranks_all_reported_stands_though_one_crashed_after(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, [(1, [0, 1], ABORT)])
    assert len(_run_fake(tmp_path)) == 2 and calls == [1]


def test_a_rank_that_fails_without_a_signal_after_another_reported_is_not_retried(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, [(1, [0], "ChildFailedError:\n  exitcode  : 1 (pid: 1)"), (0, [0, 1], "")])
    with pytest.raises(MpsimError, match="the executor failed"):
        _run_fake(tmp_path)
    assert calls == [1]


def test_validation_sets_the_reserved_prediction_beside_max_memory_reserved(tiny, cpu2):
    """A CUDA rank reports ``max_memory_reserved``; the report gives the allocator model's
    prediction beside it, per stage, with its error (here from a hand-made measurement: a
    rank that reserved 10% more than predicted, and one on CPU that reports none)."""
    from mpsim.studies.hardware_check import compare, simulate_plan

    plan = _plan(tiny, cpu2, "1f1b", "keep")
    predicted = simulate_plan(plan, cpu2, tiny)
    reserved = [predicted.gpus[g].reserved().reserved_peak_bytes for g in (0, 1)]
    assert all(r >= predicted.gpus[g].peak_bytes for g, r in enumerate(reserved))
    kinds = ("params", "grads", "optimizer", "activations")
    measured = [{"peak_bytes": predicted.gpus[0].peak_bytes, "breakdown": dict.fromkeys(kinds, 0), "step_s": 0.1,
                 "reserved_bytes": int(reserved[0] * 1.1), "oom": None},
                {"peak_bytes": predicted.gpus[1].peak_bytes, "breakdown": dict.fromkeys(kinds, 0), "step_s": 0.1,
                 "reserved_bytes": None, "oom": None}]
    report = compare(plan, predicted, measured)  # type: ignore[arg-type]
    first, second = report["stages"]
    assert first["predicted_reserved_bytes"] == reserved[0]
    assert first["reserved_error_pct"] == pytest.approx(100 * (1 / 1.1 - 1), abs=0.01)
    assert "measured_reserved_bytes" not in second
    assert "reserved MiB, predicted / measured: stage 0 " in validation_text(dict(report, device="cuda:0"))
