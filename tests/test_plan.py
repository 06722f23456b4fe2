"""Plan files: round trip, validation naming the offending entry, strategies' plans."""

from __future__ import annotations

import json

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.api import plan as make_strategy_plan
from mpsim.api import simulate
from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import SchemaError
from mpsim.plans.plan import LayerAction, Stripe, check_plan, make_plan, parse_plan, read_plan_file, write_plan_file


@pytest.fixture(scope="module")
def gpt():
    return load_topology("dgx1-v100"), load_trace("gpt-10.3b")


def test_plan_round_trips_bit_for_bit(tmp_path, gpt):
    topo, trace = gpt
    planned = make_strategy_plan(topo, trace, "1f1b", 2, 16, strategy="cpu-swap")
    path = tmp_path / "plan.json"
    write_plan_file(planned.plan, path)
    again = read_plan_file(path)
    assert again == planned.plan
    r1 = simulate(topo, trace, plan_file=planned.plan)
    r2 = simulate(topo, trace, plan_file=again)
    assert json.dumps(r1.to_dict()) == json.dumps(r2.to_dict())
    assert json.dumps(r1.to_dict()) == json.dumps(planned.result.to_dict())


def _plan_dict(gpt) -> dict:
    topo, trace = gpt
    p = make_plan(trace, topo, "1f1b", 16, [(0, 9), (9, 18), (18, 27), (27, 34)], [0, 1, 2, 3], "test",
                  {0: [LayerAction(layer=2, action="peer", peers=[Stripe(gpu=3, fraction=0.5),
                                                                  Stripe(gpu=4, fraction=0.5)])]})
    return json.loads(p.to_json())


BAD = [
    ("stripes do not sum to 1", lambda d: d["stages"][0]["actions"][0]["peers"][1].update(fraction=0.4),
     "stages.0.actions.0.peers: stripe fractions must sum to 1, got 0.9"),
    ("peer without an NVLink route", lambda d: d["stages"][0]["actions"][0]["peers"][1].update(gpu=5),
     "stages.0.actions.0.peers: no NVLink route from GPU 0 to GPU 5"),
    ("peer is itself", lambda d: d["stages"][0]["actions"][0]["peers"][1].update(gpu=0),
     "stages.0.actions.0.peers: GPU 0 is not a peer of GPU 0"),
    ("layer outside its stage", lambda d: d["stages"][0]["actions"][0].update(layer=12),
     "stages.0.actions.0.layer: layer 12 is not in stage 0 (layers 0..8)"),
    ("p < 1", lambda d: d["stages"][0]["actions"][0].update(split=0),
     "stages.0.actions.0.split: p must be at least 1, got 0"),
    ("split along an unsupported dimension", lambda d: d["stages"][0]["actions"][0].update(split=2, split_dim="hidden"),
     "stages.0.actions.0.split_dim: layer 2 splits along batch only"),
    ("unknown action", lambda d: d["stages"][0]["actions"][0].update(action="zip"),
     "stages.0.actions.0.action"),
    ("GPU that does not exist", lambda d: d["stages"][1].update(gpu=9),
     "stages.1.gpu: GPU 9 does not exist on dgx1-v100"),
    ("two stages on one GPU", lambda d: d["stages"][1].update(gpu=0),
     "stages.1.gpu: GPU 0 already runs stage 0"),
    ("gap between stages", lambda d: d["stages"][1].update(layers=[10, 18]),
     "stages.1.layers: expected [9, e)"),
    ("stages stop early", lambda d: d["stages"].pop(),
     "stages: the stages end at layer 27 but gpt-10.3b has 59 layers"),
    ("stripes on a host swap", lambda d: d["stages"][0]["actions"][0].update(action="host"),
     "stages.0.actions.0.peers: stripes belong to action 'peer', not 'host'"),
    ("stash on host without pipedream", lambda d: d["stages"][0].update(stash="host"),
     "stages.0.stash: 'host' applies to pipedream only"),
    ("layer listed twice", lambda d: d["stages"][0]["actions"].append({"layer": 2}),
     "stages.0.actions.1.layer: layer 2 is listed twice"),
    ("wrong schema", lambda d: d.update(schema=5), "schema: expected one of 1, 2, 3, 4, got 5"),
    ("replicas in a schema 1 file", lambda d: d.update(schema=1, data_parallel={"degree": 1, "replicas": [[0]]}),
     "data_parallel: needs schema 2"),
    ("optimizer layers with the states on the GPU", lambda d: d["stages"][0].update(optimizer_layers=[1]),
     "stages.0.optimizer_layers: names layers whose optimizer states live on the host"),
    ("optimizer layer outside its stage", lambda d: d["stages"][0].update(optimizer="host-stream",
                                                                         optimizer_layers=[1, 9]),
     "stages.0.optimizer_layers: layer 9 is not in the stage (layers 0..8)"),
    ("optimizer layer listed twice", lambda d: d["stages"][1].update(optimizer="host-update",
                                                                    optimizer_layers=[9, 9]),
     "stages.1.optimizer_layers: a layer is listed twice"),
    ("no optimizer layers", lambda d: d["stages"][0].update(optimizer="host-stream", optimizer_layers=[]),
     "stages.0.optimizer_layers: is empty"),
]


@pytest.mark.parametrize("case,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_plan_names_the_offending_entry(gpt, case, mutate, message):
    topo, trace = gpt
    d = _plan_dict(gpt)
    mutate(d)
    with pytest.raises(SchemaError) as exc:
        check_plan(parse_plan(d, "p.json"), topo, trace, "p.json")
    assert message in str(exc.value)
    assert str(exc.value).startswith("p.json: ")


def test_split_of_an_unsplittable_layer_is_refused():
    topo = tiny_topology(n_gpus=1)
    trace = tiny_trace([layer("a"), layer("b")])
    plan = make_plan(trace, topo, "gpipe", 1, [(0, 2)], [0], "test", {0: [LayerAction(layer=1, split=2)]})
    with pytest.raises(SchemaError, match=r"stages.0.actions.0.split: layer 1 \(b\) cannot be split"):
        check_plan(plan, topo, trace)


@pytest.mark.parametrize("strategy", ["recompute", "cpu-swap"])
def test_strategies_fit_what_none_does_not(gpt, strategy):
    """GPT-10.3B does not fit a DGX-1 under DAPPLE alone (MPress Fig. 8a); recomputation
    and GPU-CPU swap make it fit, at a cost in iteration time."""
    topo, trace = gpt
    none = simulate(topo, trace, "1f1b", 2, 16)
    r = simulate(topo, trace, "1f1b", 2, 16, strategy=strategy)
    assert not none.fits and r.fits
    assert r.iteration_s > none.iteration_s
    assert all(g.peak_bytes <= g.capacity_bytes for g in r.gpus)


def test_recompute_all_plan_checkpoints_every_transformer_layer(gpt):
    topo, trace = gpt
    planned = make_strategy_plan(topo, trace, "1f1b", 2, 16, strategy="recompute-all")
    actions = [(a.layer, a.action) for st in planned.plan.stages for a in st.actions]
    assert actions == [(j, "recompute") for j, r in enumerate(trace.layers) if r.kind == "transformer"]


def test_d2d_swaps_only_to_nvlink_neighbours_with_spare_memory():
    """GPT-5.3B at microbatch 3 overflows an early stage only (stage 1: 33.6 GiB): D2D swap
    moves its activations to neighbours that have room, and every GPU fits."""
    topo, trace = load_topology("dgx1-v100"), load_trace("gpt-5.3b")
    planned = make_strategy_plan(topo, trace, "1f1b", 3, 16, strategy="d2d")
    r = planned.result
    peers = [(st.gpu, x.gpu) for st in planned.plan.stages for a in st.actions for x in a.peers]
    assert peers and all(topo.nvlinks_between(g, q) for g, q in peers)
    assert r.fits
    assert any(g.breakdown["peer_swap"] for g in r.gpus) or any(g.saved_at_peak["peer"] for g in r.gpus)


def test_a_plan_without_tensor_parallelism_or_virtual_stages_is_written_as_schema_2(tmp_path):
    """Schema 3's fields are left out at their defaults, so an older reader takes the file."""
    from mpsim.api import job_of, plan_job

    plan = plan_job(job_of("dgx1-v100", "gpt-5.3b", strategy="recompute")).plan
    data = json.loads(plan.to_json())
    assert data["schema"] == 2 and "tensor_parallel" not in data and "virtual_stages" not in data
    assert parse_plan(data) == plan


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("degree", "2", "tensor_parallel.degree: Input should be a valid integer"),
    ("degree", 2.0, "tensor_parallel.degree: Input should be a valid integer"),
    ("sequence_parallel", "yes", "tensor_parallel.sequence_parallel: Input should be a valid boolean"),
])
def test_schema_3_numbers_are_numbers_not_strings_or_floats(field, value, expected):
    """A group's degree written "2" or a flag "yes" is refused in one line, not coerced."""
    tensor: dict[str, object] = {"degree": 2, "sequence_parallel": False, "groups": [[[0, 1]]]}
    tensor[field] = value
    data = {"schema": 3, "model": "m", "server": "s", "microbatch": 1, "microbatches": 1, "schedule": "gpipe",
            "stages": [{"gpu": 0, "layers": [0, 1]}], "tensor_parallel": tensor}
    with pytest.raises(SchemaError, match=expected):
        parse_plan(data, "p.json")
