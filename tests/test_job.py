"""The job as one type: JobSpec is checked once, in one line, and the planners' registry
is the one list of strategies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.planners.best import SINGLE
from mpsim.planners.context import make_context
from mpsim.planners.mcap import mcap_partition
from mpsim.planners.registry import STRATEGIES, strategy_named
from mpsim.plans.job import JobSpec, Parallelism, job_of, pipeline
from mpsim.plans.schedule import check_microbatch


def _job(**fields) -> JobSpec:
    return JobSpec(load_topology("dgx1-v100"), load_trace("gpt-5.3b"), **fields)


def _refusal(make) -> str:
    with pytest.raises(MpsimError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_job_holds_its_fields_and_derives_the_stage_count():
    job = _job(schedule="gpipe", microbatches=8)
    traced = load_trace("gpt-5.3b").microbatch
    assert (job.n_stages, job.microbatch, job.schedule, job.strategy) == (8, traced, "gpipe", "none")
    assert _job(parallelism=pipeline(4)).n_stages == 4
    assert job_of("dgx1-v100", "gpt-5.3b", microbatch=3).microbatch == 3


@pytest.mark.parametrize("changes, named", [
    (dict(schedule="gpipe"), "use --schedule 1f1b"),
    (dict(microbatches=6), "multiple"),
    (dict(partition="memory"), "partitioned by compute time"),
])
def test_interleaved_stages_follow_megatrons_rules_or_are_refused_in_one_line(changes, named):
    layout = Parallelism(pipeline=4, virtual_stages=2)
    kwargs = {"parallelism": layout, "microbatches": 8} | changes
    message = _refusal(lambda: _job(**kwargs))
    assert named in message
    assert _job(parallelism=layout, microbatches=8).model_stages == 8


def test_sequence_parallel_without_tensor_parallelism_is_refused():
    message = _refusal(lambda: _job(parallelism=Parallelism(sequence_parallel=True)))
    assert "sequence parallel" in message and "tensor-parallel degree of 2 or more" in message


@pytest.mark.parametrize("layout, stages, name", [
    (Parallelism(data=8), 1, "DDP x8"),
    (Parallelism(data=2, zero_stage=3), 4, "FSDP x2 x pipeline x4"),
    (Parallelism(data=4, zero_stage=2, pipeline=2), 2, "ZeRO-2 x4 x pipeline x2"),
])
def test_data_parallel_replicas_share_the_gpus_with_the_pipeline(layout, stages, name):
    job = _job(parallelism=layout, microbatches=8)
    assert (job.n_stages, job.layout_name) == (stages, name)


def test_more_replicas_than_gpus_are_refused_in_one_line():
    message = _refusal(lambda: _job(parallelism=Parallelism(data=4, pipeline=4)))
    assert message == "4 replicas of 4 stages need 16 GPUs but dgx1-v100 has 8"


@pytest.mark.parametrize("make, says", [
    (lambda: _job(parallelism=pipeline(9)), "9 stages need 9 GPUs but dgx1-v100 has 8"),
    (lambda: pipeline(0), "the number of stages must be at least 1, got 0"),
    (lambda: _job(schedule="zigzag"), "unknown schedule 'zigzag'"),
    (lambda: _job(microbatches=4), "1f1b needs at least as many microbatches as stages"),
    (lambda: _job(partition="random"), "unknown partition 'random': expected one of compute, memory"),
    (lambda: _job(strategy="magic"), "unknown strategy 'magic': expected one of none, recompute,"),
    (lambda: _job().but(strategy="magic"), "unknown strategy 'magic'"),
    (lambda: check_microbatch(0), "microbatch must be a positive integer, got 0"),
    (lambda: check_microbatch(True), "microbatch must be a positive integer, got True"),
    (lambda: job_of("dgx1-v100", "gpt-5.3b", microbatch=-1), "microbatch must be a positive integer, got -1"),
])
def test_bad_jobs_are_refused_in_one_line(make, says):
    assert says in _refusal(make)


def test_the_registry_is_the_one_list_of_strategies_and_best_tries_the_ones_it_marks():
    assert list(STRATEGIES)[-1] == "best" and strategy_named("tsplit").name == "tsplit"
    # the order best tried them in before the registry (ties go to the first tried)
    assert SINGLE == ("none", "recompute", "selective", "cpu-swap", "host-swap", "d2d", "mpress", "tsplit")
    assert {s.keeps for s in STRATEGIES.values()} == {"keep", "recompute", "selective"}


@pytest.mark.parametrize("strategy, recompute, selective", [
    ("recompute-segments", True, False), ("selective", False, True), ("cpu-swap", False, False)])
def test_the_memory_partition_predicts_the_peak_as_the_strategy_keeps(strategy, recompute, selective):
    job = _job(partition="memory", strategy=strategy)
    expected = mcap_partition(job.trace, job.schedule, job.n_stages, job.microbatches, recompute, selective)
    assert make_context(job, strategy_named(strategy).keeps).stages == list(expected)


def test_every_registered_planner_imports_and_checking_a_name_imports_none():
    assert all(callable(s.planner_fn()) for s in STRATEGIES.values())
    code = "import sys, mpsim.plans.job as j; j.check_strategy('mpress'); print('mpsim.planners' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_strategy_help_is_the_registry_s():
    from mpsim.plans.strategies import STRATEGY_HELP

    described = [s for s in STRATEGIES.values() if s.help is not None]
    assert [s.name for s in described][:3] == ["none", "recompute", "recompute-segments"]
    positions = [STRATEGY_HELP.index(f"; {s.name}" if i else f": {s.name}") for i, s in enumerate(described)]
    assert positions == sorted(positions)  # in the registry's order
    assert all(f"{s.name} ({s.help})" in STRATEGY_HELP for s in described if s.help)
