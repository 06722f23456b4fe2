"""Planner answers are cached by content, never by names or object identity."""

from helpers import layer, tiny_topology, trace_dict

from mpsim.models.trace import parse_trace
from mpsim.planners import plan_job
from mpsim.planners.cache import job_key
from mpsim.planners.context import make_context
from mpsim.plans.job import JobSpec


def two_traces_with_one_name():
    small = trace_dict([layer("a", act=100, out=10, kind="embedding"), layer("b", act=100, inp=10, out=10)])
    big = trace_dict([layer("a", act=100, out=10, kind="embedding"), layer("b", act=900_000, inp=10, out=10)])
    assert small["name"] == big["name"] and small["params"] == big["params"]
    return parse_trace(small, "small.json"), parse_trace(big, "big.json")


def test_traces_with_one_name_and_size_get_their_own_answers():
    topo = tiny_topology(n_gpus=2)
    small, big = two_traces_with_one_name()
    a = plan_job(JobSpec(topo, small, "1f1b", 2, strategy="none")).result
    b = plan_job(JobSpec(topo, big, "1f1b", 2, strategy="none")).result
    assert a.max_peak_bytes < b.max_peak_bytes


def test_equal_contents_share_a_key_and_a_copy_loaded_again_hits_it():
    topo = tiny_topology(n_gpus=2)
    small, _ = two_traces_with_one_name()
    again, _ = two_traces_with_one_name()
    ctx_a = make_context(JobSpec(topo, small, "1f1b", 2))
    ctx_b = make_context(JobSpec(tiny_topology(n_gpus=2), again, "1f1b", 2))
    assert small is not again and job_key("none", ctx_a) == job_key("none", ctx_b)
    assert plan_job(JobSpec(topo, small, "1f1b", 2)) is plan_job(JobSpec(tiny_topology(n_gpus=2), again, "1f1b", 2))
