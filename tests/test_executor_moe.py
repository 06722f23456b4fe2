"""The executor's mixture of experts with expert parallelism on CPU (gloo, torchrun): a tiny
Mixtral config (tests/data/tiny-mixtral.json: 2 layers, 4 experts, top-2) traced as
`mpsim trace --hf` traces it and run as the same transformers model, its experts split
over two ranks, the copies dispatched and combined with all-to-alls (about 15 s a run on
2 cores).

What is asserted, read off the ranks themselves: at EP = 2 every rank's peak is within 5%
of the simulator's prediction for its GPU, with the parameters, gradients and Adam's
states to the byte (Adam's step counters aside), and its experts receive exactly the
routed copies the simulator's shard sends them; the forced dispatch computes what the
traced uniform-load code computes (EP = 2 trains with the same losses as two DDP replicas
of the unsplit model on the same tokens); what the executor cannot run with a mixture of
experts is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra")

from mpsim import api  # noqa: E402
from mpsim.errors import MpsimError  # noqa: E402
from mpsim.hardware.topology import Topology  # noqa: E402
from mpsim.models.hf import trace_hf  # noqa: E402
from mpsim.models.probe import probe  # noqa: E402
from mpsim.models.trace import Trace  # noqa: E402
from mpsim.plans.job import Parallelism  # noqa: E402
from mpsim.plans.plan import PlanFile  # noqa: E402
from mpsim.studies.hardware_check import RunSettings  # noqa: E402
from mpsim.studies.moe_check import check_moe_runnable, validate_moe_plan  # noqa: E402
from mpsim.studies.moe_check import moe_config as _moe_config  # noqa: E402

CONFIG = Path(__file__).parent / "data" / "tiny-mixtral.json"
SETTINGS = RunSettings(device="cpu", threads=1, warmup=0, steps=2, digests=True)
ADAM_STEP_COUNTERS = 1024
"""Bytes Adam's step counters may add to the measured optimizer states (one scalar per tensor)."""


@pytest.fixture(scope="module")
def tiny() -> Trace:
    return trace_hf(str(CONFIG), microbatch=1, recipe="fp32")


@pytest.fixture(scope="module")
def cpu2() -> Topology:
    return probe("cpu", devices=2, threads=1, memory_mib=2048)[1]


def _plan(trace: Trace, topo: Topology, ep: int = 1, dp: int = 1, stages: int = 1, zero: int = 0) -> PlanFile:
    axes = (("expert", ep),) if ep > 1 else ()
    layout = Parallelism(data=dp, axes=axes, pipeline=stages, zero_stage=zero)  # type: ignore[arg-type]
    return api.plan(topo, trace, "1f1b", microbatches=2, n_stages=stages, parallelism=layout).plan


def _ranks(workdir: Path, world: int) -> list[dict]:
    return [json.loads((workdir / "ranks" / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ep2_run(tiny, cpu2, tmp_path_factory) -> tuple[PlanFile, dict, Path]:
    """The EP=2 plan run once (a torchrun launch), its report and the folder of its ranks'
    results: both tests below read it."""
    plan = _plan(tiny, cpu2, ep=2)
    workdir = tmp_path_factory.mktemp("ep2")
    return plan, validate_moe_plan(plan, cpu2, tiny, _moe_config(str(CONFIG)) or {}, SETTINGS, workdir=workdir), workdir


@pytest.mark.torchrun
def test_ep2_peaks_within_5_percent_and_routed_copies_as_predicted(ep2_run):
    plan, report, workdir = ep2_run
    rows = report["stages"]
    assert [(r["gpu"], r["ep_rank"], r["dp_rank"]) for r in rows] == [(0, 0, 0), (1, 1, 0)]
    for r in rows:
        assert abs(r["peak_error_pct"]) <= 5.0, r
        pred, held = r["predicted_breakdown"], r["measured_model_state_bytes"]
        assert held["params"] == pred["params"] and held["grads"] == pred["grads"]
        assert 0 <= held["optimizer"] - pred["optimizer"] <= ADAM_STEP_COUNTERS
        calls = 2 * plan.microbatches  # MoE layers x microbatches in the measured step
        assert r["measured_routed_copies"] == [r["predicted_routed_copies"]] * calls
        assert len(r["router_routed_copies"]) == calls
    # the real router's choices, summed over both ranks' experts, are every routed copy of the group
    per_call = [sum(c) for c in zip(*(r["router_routed_copies"] for r in rows))]
    assert set(per_call) == {2 * rows[0]["predicted_routed_copies"]}
    ranks = _ranks(workdir, 2)
    assert ranks[0]["tokens_sha256"] != ranks[1]["tokens_sha256"]
    assert ranks[0]["params_sha256"] != ranks[1]["params_sha256"]  # each holds its own experts


@pytest.mark.torchrun
def test_ep2_trains_as_two_ddp_replicas_of_the_traced_experts(tiny, cpu2, ep2_run, tmp_path):
    """The same tokens per rank; the experts whole and run by ``moe.uniform_experts_forward``
    in the DDP run. Adam is invariant to a constant scale of a gradient, so this pins the
    gradients' direction (each expert's holds both ranks' tokens), not their scale."""
    validate_moe_plan(_plan(tiny, cpu2, dp=2), cpu2, tiny, _moe_config(str(CONFIG)) or {}, SETTINGS, workdir=tmp_path)
    ep, dp = _ranks(ep2_run[2], 2), _ranks(tmp_path, 2)
    for a, b in zip(ep, dp, strict=True):
        assert a["tokens_sha256"] == b["tokens_sha256"]
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert dp[0]["params_sha256"] == dp[1]["params_sha256"]  # the DDP replicas agree


def test_moe_plans_the_executor_cannot_run_are_refused_in_one_line(tiny, cpu2):
    check_moe_runnable(_plan(tiny, cpu2, ep=2), tiny, "<plan>")
    check_moe_runnable(_plan(tiny, cpu2, dp=2), tiny, "<plan>")
    uneven = Trace(tiny.spec.model_copy(update={"model": {**tiny.spec.model, "seq_len": 33}}))  # 66 copies, 4 experts
    cases = [(_plan(tiny, cpu2, stages=2), tiny, "one pipeline stage"),
             (_plan(tiny, cpu2, dp=2, zero=1), tiny, "no ZeRO"),
             (_plan(tiny, cpu2, ep=2), uneven, "split evenly over the experts")]
    for plan, trace, needs in cases:
        with pytest.raises(MpsimError, match=needs) as err:
            check_moe_runnable(plan, trace, "<plan>")
        assert "\n" not in str(err.value)


def test_validate_takes_moe_configs_only_of_the_families_it_runs(tmp_path):
    assert _moe_config(str(CONFIG)) is not None
    assert _moe_config("gpt-tiny") is None
    deepseek = tmp_path / "deepseek.json"
    deepseek.write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(MpsimError, match="not deepseek_v3"):
        _moe_config(str(deepseek))
    with pytest.raises(MpsimError, match="give --stages 1"):
        api.validate(str(CONFIG), stages=2, parallelism=Parallelism(axes=(("expert", 2),)))
