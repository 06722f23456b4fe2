"""The executor's tensor-parallel stages on CPU (gloo, torchrun, DTensor): tp = 2 with and
without sequence parallelism, tp = 2 x pp = 2, and FSDP2 x tp = 2, on a two-layer GPT
without dropout (about 8 s a run on 2 cores).

What is asserted is the behaviour, read off the ranks themselves: a tensor-parallel run
trains exactly as the unsharded model with the same initial weights (the loss of every
step, so the gradients and Adam's updates too, agree to float rounding); each rank holds
exactly the parameters the Megatron-LM split gives it (1/t of every matrix, of the
vocabulary and of the column-parallel biases; norms, positions and row-parallel biases
whole), with gradients and Adam's states to match; ranks sit in Megatron's order, tensor
innermost; what the executor cannot run with tensor parallelism is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.models.probe import probe
from mpsim.models.trace import Trace
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ModelConfig
from mpsim.plans.plan import DataParallelPlan, LayerAction, PlanFile, TensorParallelPlan, make_plan
from mpsim.studies.hardware_check import (
    RankPlace,
    RunSettings,
    check_runnable,
    compare,
    model_config,
    rank_grid,
    run_executor,
    simulate_plan,
)

CFG = ModelConfig("gpt", layers=2, hidden=64, heads=4, seq_len=32, vocab=128, dropout=0.0)
SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=2, digests=True)
ONE_STAGE = [(0, 4)]
TWO_STAGES = [(0, 2), (2, 4)]


def rank_params(cfg: ModelConfig, t: int, layers: range, embedding: bool, head: bool) -> int:
    """Parameters a GPT tensor-parallel rank holds (Shoeybi et al. 2019, section 3): 1/t of
    the word table, q|k|v (weights and biases), the output projection's weight, the MLP's
    weights and first bias and the decoder; positions, norms and the row-parallel biases
    whole. The executor's head keeps its own decoder (untied)."""
    h, f, v = cfg.hidden, cfg.ffn, cfg.vocab
    split = len(layers) * (3 * h * h + 3 * h + h * h + h * f + f + f * h)
    whole = len(layers) * (h + h + 4 * h)
    if embedding:
        split, whole = split + v * h, whole + cfg.seq_len * h
    if head:
        split, whole = split + v * h, whole + 2 * h
    assert split % t == 0
    return split // t + whole


@pytest.fixture(scope="module")
def tiny() -> Trace:
    return trace_model(CFG, 2, "fp32")


@pytest.fixture(scope="module")
def cpu4() -> Topology:
    return probe("cpu", devices=4, threads=1, memory_mib=2048)[1]


def _plan(trace: Trace, topo: Topology, stages: list[tuple[int, int]], t: int = 1, sp: bool = False,
          replicas: int = 1, actions: dict[int, list[LayerAction]] | None = None, zero: int = 3) -> PlanFile:
    """GPUs in Megatron's order: replica r's stage s group is r*S*t + s*t + (0..t-1)."""
    n = len(stages)
    gpus = [[(r * n + s) * t for s in range(n)] for r in range(replicas)]
    dp = None if replicas == 1 else DataParallelPlan(degree=replicas, zero_stage=zero, replicas=gpus)  # type: ignore[arg-type]
    tp = None if t == 1 else TensorParallelPlan(
        degree=t, sequence_parallel=sp, groups=[[list(range(g, g + t)) for g in row] for row in gpus])
    return make_plan(trace, topo, "1f1b", 2, stages, gpus[0], "keep", actions=actions, data_parallel=dp,
                     tensor_parallel=tp)


def _run(plan: PlanFile, topo: Topology, trace: Trace, workdir: Path) -> list[dict]:
    check_runnable(plan, topo, trace, SETTINGS)
    measured = run_executor(plan, model_config(trace), SETTINGS, topo.capacity_bytes, workdir)
    assert all(m is not None and m["oom"] is None for m in measured)
    return measured  # type: ignore[return-value]


@pytest.fixture(scope="module")
def unsharded(tiny, cpu4, tmp_path_factory) -> dict[int, list[float]]:
    """The last stage's loss at every step of the plain one- and two-stage pipelines."""
    out = {}
    for stages in (ONE_STAGE, TWO_STAGES):
        measured = _run(_plan(tiny, cpu4, stages), cpu4, tiny, tmp_path_factory.mktemp("unsharded"))
        out[len(stages)] = measured[-1]["losses"]
    return out


def _assert_same_losses(measured: list[dict], reference: list[float]) -> None:
    last = [m for m in measured if m["stage"] == max(x["stage"] for x in measured)]
    for m in last:
        assert len(m["losses"]) == len(reference) == 4  # 1 setup, 1 measured, 2 timed steps
        assert m["losses"] == pytest.approx(reference, rel=2e-6, abs=0), m["losses"]


@pytest.mark.torchrun
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_trains_as_the_unsharded_model_and_holds_its_shard(tiny, cpu4, unsharded, sp, tmp_path):
    plan = _plan(tiny, cpu4, ONE_STAGE, t=2, sp=sp)
    measured = _run(plan, cpu4, tiny, tmp_path)
    assert [(m["replica"], m["stage"], m["tp_rank"], m["gpu"]) for m in measured] == [(0, 0, 0, 0), (0, 0, 1, 1)]
    _assert_same_losses(measured, unsharded[1])
    expected = 4 * rank_params(CFG, 2, range(2), embedding=True, head=True)
    for m in measured:
        held = m["model_state_bytes"]
        assert held["params"] == held["grads"] == expected
        assert held["optimizer"] - 2 * expected < 4 * 64  # Adam's two states, and its step counters
        assert m["breakdown"]["params"] == expected  # the tracker sees the shards, not the whole tensors
    assert measured[0]["params_sha256"] == measured[1]["params_sha256"]  # one model, gathered


@pytest.mark.torchrun
def test_tp2_x_pp2_runs_megatron_order_and_trains_as_the_pipeline(tiny, cpu4, unsharded, tmp_path):
    plan = _plan(tiny, cpu4, TWO_STAGES, t=2, sp=True)
    measured = _run(plan, cpu4, tiny, tmp_path)
    places = [RankPlace(m["replica"], m["stage"], m["tp_rank"], m["gpu"]) for m in measured]
    assert places == rank_grid(plan) == [RankPlace(0, 0, 0, 0), RankPlace(0, 0, 1, 1), RankPlace(0, 1, 0, 2),
                                         RankPlace(0, 1, 1, 3)]
    _assert_same_losses(measured, unsharded[2])
    first = 4 * rank_params(CFG, 2, range(1), embedding=True, head=False)
    last = 4 * rank_params(CFG, 2, range(1), embedding=False, head=True)
    assert [m["model_state_bytes"]["params"] for m in measured] == [first, first, last, last]


@pytest.mark.torchrun
def test_fsdp_over_tensor_parallel_shards(tiny, cpu4, unsharded, tmp_path):
    plan = _plan(tiny, cpu4, ONE_STAGE, t=2, replicas=2)
    measured = _run(plan, cpu4, tiny, tmp_path)
    assert [(m["replica"], m["tp_rank"], m["gpu"]) for m in measured] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert len({m["params_sha256"] for m in measured}) == 1  # replicas agree
    assert measured[0]["tokens_sha256"] != measured[2]["tokens_sha256"]
    assert measured[0]["losses"][0] == pytest.approx(unsharded[1][0], rel=2e-6)  # replica 0: the same batch
    quarter = 4 * rank_params(CFG, 2, range(2), embedding=True, head=True) / 2
    for m in measured:  # FSDP2 splits each tensor-parallel shard over the two replicas
        assert m["model_state_bytes"]["params"] == pytest.approx(quarter, rel=0.01)


def test_ranks_are_tensor_innermost(tiny, cpu4):
    assert [p.gpu for p in rank_grid(_plan(tiny, cpu4, TWO_STAGES, t=2, replicas=2))] == list(range(8))
    tp = TensorParallelPlan(degree=2, groups=[[[0, 2], [1, 3]]])  # the stages' GPUs 0 and 1, their partners 2, 3
    plan = make_plan(tiny, cpu4, "1f1b", 2, TWO_STAGES, [0, 1], "keep", tensor_parallel=tp)
    assert [(p.stage, p.tp_rank, p.gpu) for p in rank_grid(plan)] == [(0, 0, 0), (0, 1, 2), (1, 0, 1), (1, 1, 3)]


def test_what_tensor_parallel_runs_cannot_do_is_refused(tiny, cpu4):
    check_runnable(_plan(tiny, cpu4, ONE_STAGE, t=2, sp=True), cpu4, tiny, SETTINGS)
    with pytest.raises(MpsimError, match="FSDP2 only"):
        check_runnable(_plan(tiny, cpu4, ONE_STAGE, t=2, replicas=2, zero=1), cpu4, tiny, SETTINGS)
    swap = {0: [LayerAction(layer=1, action="host")]}
    with pytest.raises(MpsimError, match="swaps whole tensors"):
        check_runnable(_plan(tiny, cpu4, ONE_STAGE, t=2, actions=swap), cpu4, tiny, SETTINGS)
    recompute = {0: [LayerAction(layer=1, action="recompute")]}
    check_runnable(_plan(tiny, cpu4, ONE_STAGE, t=2, actions=recompute), cpu4, tiny, SETTINGS)
    with pytest.raises(MpsimError, match="does not divide gpt-2l-64h.s heads 4, kv_heads 4, ffn_hidden 256, vocab 128"):
        check_runnable(_plan(tiny, cpu4, ONE_STAGE, t=3), cpu4, tiny, SETTINGS)
    bert = trace_model(ModelConfig("bert", layers=1, hidden=32, heads=2, seq_len=16, vocab=64), 1, "fp32")
    with pytest.raises(MpsimError, match="GPT and Llama only"):
        check_runnable(_plan(bert, cpu4, [(0, 3)], t=2), cpu4, bert, SETTINGS)


def test_compare_sets_each_rank_beside_the_prediction_for_its_gpu(tiny, cpu4):
    plan = _plan(tiny, cpu4, TWO_STAGES, t=2, sp=True)
    predicted = simulate_plan(plan, cpu4, tiny)
    measured = [{"peak_bytes": 1000 + g, "breakdown": {"params": g}, "step_s": 0.5 + g} for g in range(4)]
    report = compare(plan, predicted, measured)  # type: ignore[arg-type]
    rows = report["stages"]
    assert [(r["stage"], r["tp_rank"], r["gpu"], r["measured_peak_bytes"]) for r in rows] == [
        (0, 0, 0, 1000), (0, 1, 1, 1001), (1, 0, 2, 1002), (1, 1, 3, 1003)]
    assert [r["predicted_peak_bytes"] for r in rows] == [predicted.gpus[g].peak_bytes for g in range(4)]
    assert rows[0]["predicted_peak_bytes"] == rows[1]["predicted_peak_bytes"]  # a group is predicted as its first
    assert report["tensor"] == 2 and report["sequence_parallel"] and report["measured_iteration_s"] == 3.5


def test_interleaved_plans_are_refused(tiny, cpu4):
    chunks = make_plan(tiny, cpu4, "1f1b", 2, [(0, 1), (1, 2), (2, 3), (3, 4)], [0, 1, 0, 1], "keep")
    plan = chunks.model_copy(update={"schema_": 3, "virtual_stages": 2})  # two chunks on each of two GPUs
    with pytest.raises(MpsimError, match="no interleaved 1F1B yet"):
        check_runnable(plan, cpu4, tiny, SETTINGS)
