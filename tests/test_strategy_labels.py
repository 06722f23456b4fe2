"""Every output names a plan by the strategy that made it (issue 45, "every flag means one
thing"): ``recompute-all`` is never printed as ``recompute``, which is another strategy
(the fewest checkpoints that fit)."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.errors import MpsimError
from mpsim.planners import plan_job
from mpsim.plans.job import JobSpec
from mpsim.plans.strategies import STRATEGIES, base_name, combines
from mpsim.views.html import plan_html, simulate_page, verdict_html
from mpsim.views.text import plan_text, simulate_text

MiB = 2**20


def _job(strategy: str) -> JobSpec:
    """Two GPUs of 1 GiB, four transformer layers of 100 MiB activations each: keeping
    them all (and their weights) fits, so every planner settles quickly."""
    trace = tiny_trace([layer(f"l{i}", act=100 * MiB, out=MiB, inp=MiB, params=MiB) for i in range(4)])
    return JobSpec(tiny_topology(n_gpus=2), trace, "1f1b", 4, strategy=strategy)


def _planned(strategy: str):
    try:
        job = _job(strategy)
    except MpsimError as e:  # a strategy the toy job cannot take (a ZeRO stage without replicas)
        pytest.skip(f"{strategy}: {e}")
    return plan_job(job)


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if not combines(s)])
def test_a_plan_and_its_result_carry_the_strategy_that_made_them(strategy):
    planned = _planned(strategy)
    assert planned.plan.strategy == strategy
    assert planned.result.strategy == strategy


def test_best_names_the_planner_it_took():
    planned = _planned("best")
    assert base_name(planned.result.strategy) == "best"
    assert planned.result.strategy.startswith("best (")


@pytest.mark.parametrize("strategy", ["recompute-all", "recompute-segments", "selective"])
def test_text_and_html_print_the_strategys_own_name(strategy):
    planned = _planned(strategy)
    r = planned.result
    assert simulate_text(r).splitlines()[0].endswith(f"strategy {strategy}")
    assert plan_text(planned.plan).startswith(f"plan {strategy} for ")
    assert f"strategy {strategy}" in verdict_html(r)
    assert f"plan {strategy} for " in plan_html(planned.plan)
    assert f"strategy {strategy}" in simulate_page(r, planned.plan)


def test_recompute_all_and_recompute_differ_in_name_where_their_plans_differ():
    """On the toy job recompute checkpoints nothing (everything fits) and recompute-all every
    layer: two different plans, two different names."""
    fewest, every = _planned("recompute"), _planned("recompute-all")
    assert [a.action for st in fewest.plan.stages for a in st.actions] == []
    assert {a.action for st in every.plan.stages for a in st.actions} == {"recompute"}
    assert simulate_text(fewest.result).splitlines()[0].endswith("strategy recompute")
    assert simulate_text(every.result).splitlines()[0].endswith("strategy recompute-all")
