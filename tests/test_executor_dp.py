"""The executor's data-parallel replicas on CPU (gloo, torchrun): DDP and ZeRO 1 to 3, alone
and under a two-stage pipeline, on a two-layer GPT small enough for 2 cores (about 6 s a run).

What is asserted is the behaviour, read off the ranks themselves: replicas train on
different tokens yet end with identical parameters (their gradients were averaged and
their updates agree); each rank holds the share of the model states its ZeRO stage gives
it (ZeRO-1 the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the parameters too, 1/N
each), in its own tensors and in the memory tracker's peak; one result comes back per GPU,
and ``compare`` sets each beside the simulator's prediction for that GPU. The offload
strategies (ZeRO-Offload, ZeRO-Infinity) train exactly as their ZeRO stage does with the
optimizer on the device, while their optimizer (and ZeRO-Infinity's shards) live on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest

from mpsim import api
from mpsim.errors import MpsimError
from mpsim.hardware.topology import NvmeSpec, Topology
from mpsim.models.probe import probe
from mpsim.models.trace import Trace
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ModelConfig
from mpsim.plans.job import Parallelism
from mpsim.plans.plan import DataParallelPlan, PlanFile, make_plan
from mpsim.studies.hardware_check import (
    RunSettings,
    check_runnable,
    compare,
    model_config,
    rank_places,
    run_executor,
    simulate_plan,
)

CFG = ModelConfig("gpt", layers=2, hidden=64, heads=2, seq_len=32, vocab=128)
SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=2, digests=True)

#: Model states per rank as multiples of its stage's parameter bytes P (fp32 Adam: two
#: states per parameter), with two replicas: (parameters, gradients, optimizer states).
SHARE = {0: (1.0, 1.0, 2.0), 1: (1.0, 1.0, 1.0), 2: (1.0, 0.5, 1.0), 3: (0.5, 0.5, 1.0)}


@pytest.fixture(scope="module")
def tiny() -> Trace:
    return trace_model(CFG, 2, "fp32")


@pytest.fixture(scope="module")
def cpu4() -> Topology:
    return probe("cpu", devices=4, threads=1, memory_mib=2048)[1]


def _plan(trace: Trace, topo: Topology, zero: Literal[0, 1, 2, 3], stages: list[tuple[int, int]]) -> PlanFile:
    n = len(stages)
    dp = DataParallelPlan(degree=2, zero_stage=zero, replicas=[list(range(n)), list(range(n, 2 * n))])
    return make_plan(trace, topo, "1f1b", 2, stages, list(range(n)), "keep", data_parallel=dp)


def _run(plan: PlanFile, topo: Topology, trace: Trace, workdir: Path) -> tuple[list[dict], dict]:
    check_runnable(plan, topo, trace, SETTINGS)
    measured = run_executor(plan, model_config(trace), SETTINGS, topo.capacity_bytes, workdir)
    assert all(m is not None and m["oom"] is None for m in measured)
    report = compare(plan, simulate_plan(plan, topo, trace), measured)
    return measured, report  # type: ignore[return-value]


@pytest.fixture(scope="module")
def one_stage_run(tiny, cpu4, tmp_path_factory) -> Callable[[Literal[0, 1, 2, 3]], tuple[list[dict], dict]]:
    """The two replicas of the one-stage pipeline at a ZeRO stage (``_plan``), each run once
    (a torchrun launch) and shared: ``test_two_replicas_agree_and_hold_their_share`` checks
    it, and the offload strategies are set beside their ZeRO stage's run."""
    runs: dict[int, tuple[list[dict], dict]] = {}

    def run(zero: Literal[0, 1, 2, 3]) -> tuple[list[dict], dict]:
        if zero not in runs:
            runs[zero] = _run(_plan(tiny, cpu4, zero, [(0, 4)]), cpu4, tiny, tmp_path_factory.mktemp(f"zero{zero}"))
        return runs[zero]

    return run


def _stage_param_bytes(trace: Trace, plan: PlanFile, stage: int) -> int:
    a, b = plan.stages[stage].layers
    return sum(row.param_bytes for row in trace.layers[a:b])


def _assert_share(m: dict, param_bytes: int, zero: int) -> None:
    """The rank's model states are its ZeRO stage's share (``SHARE``) of the stage's."""
    held = m["model_state_bytes"]
    for kind, share in zip(("params", "grads", "optimizer"), SHARE[zero]):
        # ZeRO-1 hands out whole parameters, so its halves are as even as their sizes allow
        tolerance = 0.2 if (zero, kind) == (1, "optimizer") else 0.01
        assert held[kind] == pytest.approx(share * param_bytes, rel=tolerance), (kind, held)
    assert m["breakdown"]["optimizer"] == held["optimizer"]  # the tracker's peak holds the same states


@pytest.mark.torchrun
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_replicas_agree_and_hold_their_share(tiny, cpu4, one_stage_run, zero):
    plan = _plan(tiny, cpu4, zero, [(0, 4)])
    measured, report = one_stage_run(zero)
    assert [(m["replica"], m["stage"], m["gpu"]) for m in measured] == [(0, 0, 0), (1, 0, 1)]
    first, second = measured
    assert first["tokens_sha256"] != second["tokens_sha256"]
    assert first["params_sha256"] == second["params_sha256"]
    param_bytes = _stage_param_bytes(tiny, plan, 0)
    for m in measured:
        _assert_share(m, param_bytes, zero)
    total_optimizer = sum(m["model_state_bytes"]["optimizer"] for m in measured)
    assert total_optimizer == pytest.approx(2 * param_bytes * (2 if zero == 0 else 1), rel=0.01)
    assert [(row["replica"], row["gpu"]) for row in report["stages"]] == [(0, 0), (1, 1)]
    assert all(row["predicted_peak_bytes"] > 0 and "peak_error_pct" in row for row in report["stages"])


@pytest.mark.torchrun
def test_two_replicas_of_a_two_stage_pipeline(tiny, cpu4, tmp_path):
    plan = _plan(tiny, cpu4, 1, [(0, 2), (2, 4)])
    measured, report = _run(plan, cpu4, tiny, tmp_path)
    places = [(m["replica"], m["stage"], m["gpu"]) for m in measured]
    assert places == rank_places(plan) == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    for s in (0, 1):
        a, b = measured[s], measured[2 + s]  # stage s in replica 0 and in replica 1
        assert a["params_sha256"] == b["params_sha256"] and a["tokens_sha256"] != b["tokens_sha256"]
        for m in (a, b):
            _assert_share(m, _stage_param_bytes(tiny, plan, s), 1)
    assert measured[0]["tokens_sha256"] == measured[1]["tokens_sha256"]  # one replica, one batch
    assert [row["gpu"] for row in report["stages"]] == [0, 1, 2, 3]
    assert report["replicas"] == 2 and report["zero_stage"] == 1


#: Per strategy, the model states a rank holds on its device and on the host, as multiples
#: of its stage's parameter bytes P with two replicas: (parameters, gradients, optimizer).
OFFLOAD_SHARE = {"zero-offload": ((1.0, 0.5, 0.0), (0.5, 0.5, 1.0)),
                 "zero-infinity": ((0.0, 0.0, 0.0), (0.5, 0.5, 1.0))}


def _offload_plan(trace: Trace, topo: Topology, strategy: str, replicas: int = 2) -> PlanFile:
    return api.plan(topo, trace, "1f1b", microbatches=2, n_stages=1, strategy=strategy,
                    parallelism=Parallelism(data=replicas, pipeline=1)).plan


def _on_device(plan: PlanFile) -> PlanFile:
    """The same plan with the optimizer (and parameter shards) on the device."""
    assert plan.data_parallel is not None
    stages = [st.model_copy(update={"optimizer": "gpu"}) for st in plan.stages]
    dp = plan.data_parallel.model_copy(update={"offload_params": False})
    return plan.model_copy(update={"stages": stages, "data_parallel": dp})


@pytest.mark.torchrun
@pytest.mark.parametrize(("strategy", "zero"), [("zero-offload", 2), ("zero-infinity", 3)])
def test_offload_trains_as_its_zero_stage_with_the_states_on_the_host(tiny, cpu4, one_stage_run, strategy, zero,
                                                                    tmp_path):
    plan = _offload_plan(tiny, cpu4, strategy)
    assert plan.data_parallel is not None and plan.data_parallel.zero_stage == zero
    assert {st.optimizer for st in plan.stages} == {"host-update"}
    assert plan.data_parallel.offload_params == (zero == 3)
    measured, report = _run(plan, cpu4, tiny, tmp_path)
    # the reference: the plan with the optimizer (and shards) on the device, which is the
    # one-stage ZeRO plan test_two_replicas_agree_and_hold_their_share runs but for its name
    # and its recompute of layer 1 (asserted here; recomputing changes no number), so its run
    twin = _on_device(plan)
    assert twin.model_copy(update={"strategy": "keep", "stages": [st.model_copy(update={"actions": []})
                                                                  for st in twin.stages]}) == \
        _plan(tiny, cpu4, zero, [(0, 4)])
    reference, _ = one_stage_run(zero)
    digests = {m["params_sha256"] for m in measured + reference}
    assert len(digests) == 1  # replicas agree, and Adam on the host updates as on the device
    param_bytes = _stage_param_bytes(tiny, plan, 0)
    on_device, on_host = OFFLOAD_SHARE[strategy]
    for m in measured:
        for kind, dev, host in zip(("params", "grads", "optimizer"), on_device, on_host):
            assert m["model_state_bytes"][kind] == pytest.approx(dev * param_bytes, rel=0.01), (kind, m)
            assert m["host_state_bytes"][kind] == pytest.approx(host * param_bytes, rel=0.01), (kind, m)
        assert m["breakdown"].get("optimizer", 0) == 0  # the tracker's peak holds no optimizer states
    assert all("measured_host_state_bytes" in row for row in report["stages"])


def test_offload_refusals_name_what_the_executor_cannot_run(tiny, cpu4):
    infinity = _offload_plan(tiny, cpu4, "zero-infinity")
    assert infinity.data_parallel is not None
    check_runnable(infinity, cpu4, tiny, SETTINGS)
    check_runnable(_offload_plan(tiny, cpu4, "zero-offload"), cpu4, tiny, SETTINGS)
    with_nvme = Topology(cpu4.spec.model_copy(update={"nvme": NvmeSpec(capacity_gib=1.0, read_gbps=1.0,
                                                                          write_gbps=1.0)}))
    on_nvme = infinity.model_copy(update={"data_parallel": infinity.data_parallel.model_copy(
        update={"offload_device": "nvme"})})
    with pytest.raises(MpsimError, match="offloads to host memory only"):
        check_runnable(on_nvme, with_nvme, tiny, SETTINGS)
    only_params = _on_device(infinity).model_copy(update={"data_parallel": infinity.data_parallel})
    with pytest.raises(MpsimError, match="moves parameter shards and the optimizer to the host together"):
        check_runnable(only_params, cpu4, tiny, SETTINGS)
    only_optimizer = infinity.model_copy(update={"data_parallel": _on_device(infinity).data_parallel})
    with pytest.raises(MpsimError, match="moves parameter shards and the optimizer to the host together"):
        check_runnable(only_optimizer, cpu4, tiny, SETTINGS)


def test_a_host_optimizer_with_zero_1_is_refused(tiny, cpu4):
    dp = DataParallelPlan(degree=2, zero_stage=1, replicas=[[0], [1]])
    plan = make_plan(tiny, cpu4, "1f1b", 2, [(0, 4)], [0], "keep", optimizer={0: "host-update"},
                     data_parallel=dp)
    with pytest.raises(MpsimError, match="host Adam is ZeRO-Offload's"):
        check_runnable(plan, cpu4, tiny, SETTINGS)
    ddp = plan.model_copy(update={"data_parallel": dp.model_copy(update={"zero_stage": 0})})
    check_runnable(ddp, cpu4, tiny, SETTINGS)  # DDP's gradients can still go to a host Adam


def test_ranks_without_replicas_are_the_stages(tiny, cpu4):
    plan = make_plan(tiny, cpu4, "1f1b", 2, [(0, 2), (2, 4)], [3, 1], "keep")
    assert rank_places(plan) == [(0, 0, 3), (0, 1, 1)]
