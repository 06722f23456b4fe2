"""Every per-process cache of computed answers is an ``mpsim.caches.Lru`` keyed by all its
value depends on: equal contents share an entry, and a change to any input it depends on
does not (a cache keyed by too little answers one job with another's result, as the
simulated-plan cache did for HSDP, ``tests/test_mesh.py``)."""

from __future__ import annotations

import pytest

from mpsim.caches import Lru
from mpsim.data.catalog import load_cluster, load_topology, load_trace
from mpsim.models.tensor_parallel import shard_trace
from mpsim.planners import cache as planner_cache
from mpsim.planners.context import make_context
from mpsim.plans.job import JobSpec
from mpsim.plans.mesh import Parallelism, parse_layout
from mpsim.sim import engine
from mpsim.sim.layout import Job, resolve
from mpsim.timing.costs import cost_model

# -- the cache itself ----------------------------------------------------------------------------


def test_the_least_recently_used_entry_goes_first() -> None:
    lru: Lru[str, int] = Lru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3 and len(lru) == 2
    made: list[str] = []

    def make(key: str, value: int) -> int:
        made.append(key)
        return value

    assert lru.remember("a", lambda: make("a", 9)) == 1 and made == []
    assert lru.remember("d", lambda: make("d", 4)) == 4 and made == ["d"]
    assert "c" not in lru  # a was used after c
    with pytest.raises(ValueError, match="at least one entry"):
        Lru(0)


# -- each cache, keyed by what its value depends on ----------------------------------------------


def test_cost_models_are_shared_by_content_and_not_across_gpus() -> None:
    trace = load_trace("gpt-5.3b")
    a100, h100 = load_topology("dgx-a100-80gb").spec.gpu, load_topology("dgx-h100").spec.gpu
    assert cost_model(trace, a100) is cost_model(load_trace("gpt-5.3b"), a100)
    assert cost_model(trace, a100) is not cost_model(trace, h100)
    assert cost_model(trace.rescale(trace.microbatch + 1), a100) is not cost_model(trace, a100)
    slower = a100.model_copy(update={"memory_bandwidth_gbps": a100.memory_bandwidth_gbps / 2})
    assert sum(cost_model(trace, slower).layer_times.fwd_s) > sum(cost_model(trace, a100).layer_times.fwd_s)


def test_shards_differ_by_degree_sequence_parallel_and_what_the_runtime_saves() -> None:
    trace = load_trace("llama-3-8b").rescale(1)
    keys = [(2, False, False), (4, False, False), (2, True, False), (2, True, True)]
    shards = [shard_trace(trace, *k) for k in keys]
    assert len({id(s) for s in shards}) == len(keys)
    assert shard_trace(trace, 2, True, True) is shards[3]
    assert shard_trace(trace, 2, False, True) is shards[0]  # saving the gathered input only matters under SP
    assert shards[2].layers[1].act_bytes != shards[3].layers[1].act_bytes


def test_stage_programs_are_shared_only_by_equal_stages() -> None:
    topo, trace = load_topology("dgx-a100-80gb"), load_trace("gpt-5.3b").rescale(1)
    engine._PROGRAMS.clear()
    engine.simulate_layout(resolve(Job(JobSpec(topo, trace, "1f1b", 8, Parallelism(pipeline=4)))))
    after_pipeline = len(engine._PROGRAMS)
    engine.simulate_layout(resolve(Job(JobSpec(topo, trace, "1f1b", 8, Parallelism(pipeline=4)))))
    assert len(engine._PROGRAMS) == after_pipeline == 4  # the same job: every stage's program reused
    engine.simulate_layout(resolve(Job(JobSpec(topo, trace, "1f1b", 8, parse_layout("fsdp2xpp4")))))
    assert len(engine._PROGRAMS) == 8  # sharded states: programs of their own
    engine.simulate_layout(resolve(Job(JobSpec(load_topology("dgx-h100"), trace, "1f1b", 8,
                                               Parallelism(pipeline=4)))))
    assert len(engine._PROGRAMS) == 12  # another server


def test_planner_answers_differ_by_layout_and_by_cluster() -> None:
    trace = load_trace("gpt-5.3b").rescale(1)
    superpod, p4d = load_cluster("dgx-a100-superpod"), load_cluster("aws-p4d")
    fsdp = Parallelism(data=16, zero_stage=3, pipeline=1)
    hsdp = fsdp.model_copy(update={"hsdp": True})
    contexts = [make_context(JobSpec(c.server, trace, "1f1b", 2, p, cluster=c, servers=2))
                for c, p in ((superpod, fsdp), (superpod, hsdp), (p4d, fsdp))]
    keys = {planner_cache.job_key("none", ctx) for ctx in contexts}
    assert len(keys) == 3
    again = make_context(JobSpec(superpod.server, load_trace("gpt-5.3b").rescale(1), "1f1b", 2, fsdp,
                                 cluster=superpod, servers=2))
    assert planner_cache.job_key("none", again) == planner_cache.job_key("none", contexts[0])


def test_every_cache_of_a_job_keys_its_runtime_profile() -> None:
    """The same job under two runtime profiles: planner answers, simulated plans and stage
    programs each kept apart (the planner cache once handed one profile's answer to the other)."""
    topo, trace = load_topology("dgx-h100"), load_trace("llama-3-8b")
    tp = Parallelism(tensor=8, sequence_parallel=True, pipeline=1)
    base, overlap = (make_context(JobSpec(topo, trace, "1f1b", 2, tp, runtime_profile=p))
                     for p in ("megatron-lm", "megatron-core-tp-overlap"))
    assert planner_cache.job_key("none", base) != planner_cache.job_key("none", overlap)
    plan = base.plan("none")
    assert base.simulation_key(plan) != overlap.simulation_key(plan)
    engine._PROGRAMS.clear()
    r_base, r_overlap = base.simulate(plan), overlap.simulate(plan)
    assert len(engine._PROGRAMS) == 2 and r_overlap.iteration_s < r_base.iteration_s
