"""The parallel layout as a device mesh: ranks and groups, the one name grammar, the
layout checks of a job, and a new axis added as new code (``mpsim.plans.mesh``)."""

from __future__ import annotations

import json
import math

import pytest
import toy_axis  # noqa: F401 - registers the mirror axis
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.cli import main
from mpsim.data.catalog import load_cluster, load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.plans.cluster_placement import place_on_cluster
from mpsim.plans.job import JobSpec, job_of
from mpsim.plans.layouts import parse_layout as layouts_parse
from mpsim.plans.mesh import (
    AxisKind,
    DeviceMesh,
    Parallelism,
    describe,
    layout_name,
    parse_layout,
    register_axis,
)
from mpsim.sim import Job, simulate_job

# -- the mesh ------------------------------------------------------------------------------------


@st.composite
def meshes(draw: st.DrawFn) -> DeviceMesh:
    names = draw(st.permutations(["tensor", "data", "pipeline", "mirror"]))
    k = draw(st.integers(1, 4))
    return DeviceMesh(tuple((n, draw(st.integers(1, 4))) for n in names[:k]))


@given(meshes(), st.data())
@settings(max_examples=200, deadline=None, derandomize=True)
def test_groups_along_any_axes_partition_the_mesh(mesh: DeviceMesh, data: st.DataObject) -> None:
    axes = tuple(data.draw(st.lists(st.sampled_from(mesh.names), min_size=1, unique=True)))
    groups = mesh.groups(axes)
    assert sorted(r for g in groups for r in g) == list(range(mesh.size))
    assert all(len(g) == mesh.size_of(*axes) for g in groups)
    for g in groups:  # a group's ranks differ only along its axes
        others = [n for n in mesh.names if n not in axes]
        assert len({tuple(mesh.coords(r)[n] for n in others) for r in g}) == 1
        assert all(mesh.rank(mesh.coords(r)) == r for r in g)


def test_ranks_follow_megatrons_order_innermost_first() -> None:
    mesh = Parallelism(data=2, tensor=4, pipeline=3).mesh(3)
    assert mesh.names == ("tensor", "data", "pipeline")
    for t in range(4):
        for d in range(2):
            for p in range(3):
                assert mesh.rank({"tensor": t, "data": d, "pipeline": p}) == t + 4 * (d + 2 * p)
    assert mesh.group("tensor", 9) == (8, 9, 10, 11)
    assert mesh.group("data", 9) == (9, 13)
    assert mesh.group("pipeline", 9) == (1, 9, 17)
    assert mesh.group(("tensor", "data"), 0) == tuple(range(8))


def test_a_mesh_refuses_unknown_and_repeated_axes_in_one_line() -> None:
    with pytest.raises(MpsimError, match="unknown mesh axis 'sequence'"):
        DeviceMesh((("sequence", 2),))
    with pytest.raises(MpsimError, match="names each axis once"):
        DeviceMesh((("data", 2), ("data", 2)))
    with pytest.raises(MpsimError, match="outside the mesh"):
        DeviceMesh((("data", 2),)).coords(2)


# -- names ---------------------------------------------------------------------------------------

NAMES = ["pp8", "pp4v2", "ddp8", "zero1x8", "zero2x4", "fsdp8", "hsdp16", "ddp2xpp4", "fsdp2xpp4", "tp8",
         "tp4spxpp2", "zero1x2xtp2spxpp2", "fsdp2xtp4", "zero2x2xtp2xpp2v2", "ddp2xmir2xpp2", "mir4", "mir2xtp4sp"]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_round_trips(name: str) -> None:
    p = parse_layout(name)
    assert layout_name(p, p.pipeline or 1) == name
    assert layouts_parse(name) == p  # the studies' parser is this one


def test_names_and_words_agree() -> None:
    assert parse_layout("zero3x8") == parse_layout("fsdp8")
    words = {n: describe(p, p.pipeline or 1) for n in ("ddp2xpp4", "tp4spxpp2", "hsdp16", "ddp2xmir2xpp2")
             for p in [parse_layout(n)]}
    assert words == {"ddp2xpp4": "DDP x2 x pipeline x4", "tp4spxpp2": "TP x4+SP x pipeline x2",
                     "hsdp16": "HSDP x16", "ddp2xmir2xpp2": "DDP x2 x MIRROR x2 x pipeline x2"}


@given(data=st.integers(1, 64), zero=st.sampled_from([0, 1, 2, 3]), tensor=st.sampled_from([1, 2, 4, 8]),
       sp=st.booleans(), stages=st.integers(1, 16), v=st.integers(1, 4), mirror=st.sampled_from([1, 2, 3]))
@settings(max_examples=300, deadline=None, derandomize=True)
def test_any_layout_prints_a_name_that_parses_back(data: int, zero: int, tensor: int, sp: bool, stages: int,
                                                   v: int, mirror: int) -> None:
    p = Parallelism(data=data, zero_stage=zero, tensor=tensor, sequence_parallel=sp and tensor > 1,  # type: ignore[arg-type]
                    pipeline=stages, virtual_stages=v if stages > 1 else 1,
                    axes=(("mirror", mirror),) if mirror > 1 else ())
    assert parse_layout(layout_name(p, stages)) == p


@pytest.mark.parametrize("bad", ["", "x", "ddp2x", "pp2xddp2", "tp2sp2", "ddp", "mir2xddp2", "zero4x2", "pp0"])
def test_bad_names_are_refused_in_one_line(bad: str) -> None:
    with pytest.raises(MpsimError) as exc:
        parse_layout(bad)
    assert "\n" not in str(exc.value)


def test_a_new_axis_must_not_clash() -> None:
    with pytest.raises(MpsimError, match="already registered"):
        register_axis(AxisKind("mirror", order=31, name_position=10, replicates=True, token="mir"))
    with pytest.raises(MpsimError, match="token must be new"):
        register_axis(AxisKind("other", order=31, name_position=11, replicates=True, token="tp"))
    with pytest.raises(MpsimError, match="between data and tensor"):
        register_axis(AxisKind("late", order=31, name_position=25, replicates=True, token="late"))


# -- the job's layout checks ---------------------------------------------------------------------


def test_a_named_pipeline_depth_is_the_one_that_runs() -> None:
    """The page's ``ddp2xpp2`` on 8 GPUs ran as ``DDP x2 x pipeline x4`` and ``pp4`` as
    ``pipeline x8``: ``job_of`` let a missing stage count overwrite the layout's."""
    for name, words, used in (("ddp2xpp2", "DDP x2 x pipeline x2", 4), ("pp4", "pipeline x4", 4)):
        job = job_of("dgx-a100-80gb", "gpt-5.3b", microbatch=1, microbatches=4, parallelism=parse_layout(name))
        assert (job.layout_name, job.gpus_used, job.n_gpus) == (words, used, 8)
    with pytest.raises(MpsimError, match="has 2 stage\\(s\\) but 4 were asked for"):
        job_of("dgx-a100-80gb", "gpt-5.3b", n_stages=4, parallelism=parse_layout("ddp2xpp2"))


def test_replicas_that_do_not_divide_the_gpus_are_refused_unless_the_depth_is_given() -> None:
    with pytest.raises(MpsimError, match="DDP x3 x pipeline x2 uses 6 of the 8 GPUs of dgx-a100-80gb"):
        job_of("dgx-a100-80gb", "gpt-5.3b", parallelism=Parallelism(data=3))
    job = job_of("dgx-a100-80gb", "gpt-5.3b", microbatch=1, n_stages=2, parallelism=Parallelism(data=3))
    assert (job.gpus_used, job.n_gpus) == (6, 8)


def test_cli_dp3_on_8_gpus_is_refused_in_one_line_and_runs_on_6_of_8_when_asked(capsys) -> None:
    assert main(["simulate", "--server", "dgx-a100-80gb", "--model", "gpt-5.3b", "--dp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpsim: error: DDP x3 x pipeline x2 uses 6 of the 8 GPUs") and err.count("\n") == 1
    assert main(["simulate", "--server", "dgx-a100-80gb", "--model", "gpt-5.3b", "--microbatch", "1", "--dp", "3",
                 "--stages", "2", "--microbatches", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("FITS on every GPU it uses") and first.endswith("runs on 6 of 8 GPUs")


def test_a_full_layout_says_nothing_of_idle_gpus() -> None:
    r = simulate_job(Job(job_of("dgx-a100-80gb", "gpt-5.3b", microbatch=1, microbatches=8,
                                parallelism=parse_layout("ddp2xpp4"))))
    assert (r.gpus_used, r.gpus_available, r.runs_on) == (8, 8, None)


# -- a new axis is new code ----------------------------------------------------------------------


def _same_run(a: object, b: object) -> None:
    ra, rb = simulate_job(Job(a)), simulate_job(Job(b))  # type: ignore[arg-type]
    assert ra.iteration_s == rb.iteration_s and ra.samples_per_s == rb.samples_per_s
    assert [g.peak_bytes for g in ra.gpus] == [g.peak_bytes for g in rb.gpus]
    assert ra.replicas == rb.replicas


def test_the_mirror_axis_runs_on_a_server_as_the_data_axis_it_copies() -> None:
    """On an NVSwitch server every group of GPUs is alike, so two mirrors of two DDP
    replicas reduce gradients exactly as four DDP replicas do."""
    topo, trace = load_topology("dgx-a100-80gb"), load_trace("gpt-5.3b").rescale(1)
    mirrored = JobSpec(topo, trace, "1f1b", 4, parse_layout("ddp2xmir2xpp2"))
    assert mirrored.parallelism.replicas == 4 and mirrored.samples_per_iteration == 4 * 4
    _same_run(mirrored, JobSpec(topo, trace, "1f1b", 4, parse_layout("ddp4xpp2")))
    r = simulate_job(Job(mirrored))
    assert r.layout == "DDP x2 x MIRROR x2 x pipeline x2" and r.replicas == 4


def test_the_mirror_axis_runs_on_a_cluster_between_tensor_and_data() -> None:
    cluster = load_cluster("dgx-a100-superpod")
    trace = load_trace("llama-3-8b").rescale(1)
    p = parse_layout("mir2xtp8")
    placed = place_on_cluster(cluster.gpus_per_server, p.mesh(1))
    assert (placed.servers, placed.across) == (1, 2)  # tensor inside a server, the mirrors across two
    job = JobSpec(cluster.server, trace, "1f1b", 2, p, cluster=cluster, servers=2)
    _same_run(job, JobSpec(cluster.server, trace, "1f1b", 2, parse_layout("ddp2xtp8"), cluster=cluster, servers=2))


def test_sharded_states_beside_another_replicating_axis_are_refused() -> None:
    with pytest.raises(MpsimError, match="ZeRO shards over the data, expert and context axes"):
        job_of("dgx-a100-80gb", "gpt-5.3b", parallelism=parse_layout("fsdp2xmir2xpp2"))


def test_mesh_size_is_every_gpu_the_job_uses() -> None:
    p = parse_layout("zero1x2xtp2spxpp2")
    assert p.mesh(2).size == p.stage_gpus * 2 == 8 == math.prod(s for _, s in p.mesh(2).axes)


# -- plan files: schema 4 carries the mesh -------------------------------------------------------


def _hsdp_job(hsdp: bool) -> JobSpec:
    cluster = load_cluster("dgx-a100-superpod")
    layout = Parallelism(data=16, zero_stage=3, hsdp=hsdp, pipeline=1)
    return JobSpec(cluster.server, load_trace("gpt-5.3b").rescale(1), "1f1b", 2, layout, cluster=cluster, servers=2)


def test_a_plan_of_a_layout_schema_3_cannot_name_is_written_as_schema_4_and_read_back() -> None:
    from mpsim.planners.registry import plan_job
    from mpsim.plans.plan import parse_plan
    from mpsim.sim.layout import parallelism_of_plan

    topo, trace = load_topology("dgx-a100-80gb"), load_trace("gpt-5.3b").rescale(1)
    plan = plan_job(JobSpec(topo, trace, "1f1b", 4, parse_layout("ddp2xmir2xpp2"))).plan
    data = json.loads(plan.to_json())
    assert data["schema"] == 4
    assert data["mesh"] == {"layout": "ddp2xmir2xpp2", "axes": [["tensor", 1], ["mirror", 2], ["data", 2],
                                                                ["pipeline", 2]]}
    again = parse_plan(data)
    assert again == plan and parallelism_of_plan(again) == parse_layout("ddp2xmir2xpp2")
    hsdp = plan_job(_hsdp_job(True)).plan
    assert hsdp.schema_ == 4 and hsdp.mesh is not None and hsdp.mesh.layout == "hsdp16"
    fsdp = plan_job(_hsdp_job(False)).plan
    assert fsdp.schema_ == 2 and fsdp.mesh is None  # the oldest schema that says it


@pytest.mark.parametrize(("mesh", "message"), [
    ({"layout": "ddp2xpp2", "axes": [["tensor", 1], ["data", 2], ["pipeline", 2]]}, "needs schema 4"),
    ({"layout": "ddp4xmir2xpp2", "axes": [["tensor", 1], ["mirror", 2], ["data", 4], ["pipeline", 2]]},
     "mesh.layout: ddp4xmir2xpp2 names replicas 8 but the plan has 4"),
    ({"layout": "ddp2xmir2xpp2", "axes": [["tensor", 1], ["data", 2], ["mirror", 2], ["pipeline", 2]]},
     "mesh.axes: ddp2xmir2xpp2 is the mesh"),
    ({"layout": "ddp2xwhat2", "axes": [["data", 2]]}, "mesh.layout: unknown layout"),
])
def test_a_mesh_that_contradicts_its_plan_is_refused_in_one_line(mesh: dict, message: str) -> None:
    from mpsim.errors import SchemaError
    from mpsim.planners.registry import plan_job
    from mpsim.plans.plan import check_plan, parse_plan

    topo, trace = load_topology("dgx-a100-80gb"), load_trace("gpt-5.3b").rescale(1)
    data = json.loads(plan_job(JobSpec(topo, trace, "1f1b", 4, parse_layout("ddp2xmir2xpp2"))).plan.to_json())
    data["mesh"] = mesh
    if message == "needs schema 4":
        data["schema"] = 3
    with pytest.raises(SchemaError, match=message) as exc:
        check_plan(parse_plan(data, "p.json"), topo, trace, "p.json")
    assert "\n" not in str(exc.value)


def test_hsdp_is_not_served_its_fsdp_twins_simulation() -> None:
    """The simulated-plan cache was keyed by the plan's JSON, which said nothing of HSDP:
    in one process every HSDP job got its FSDP twin's result (``choose --tokens -j 1``)."""
    from mpsim.planners import context
    from mpsim.planners.registry import plan_job

    context._SIMULATED.clear()
    alone = plan_job(_hsdp_job(True)).result
    context._SIMULATED.clear()
    plan_job(_hsdp_job(False))
    after_twin = plan_job(_hsdp_job(True)).result
    assert after_twin.iteration_s == alone.iteration_s and after_twin.layout == "HSDP x16"
    assert after_twin.iteration_s != plan_job(_hsdp_job(False)).result.iteration_s


# -- one carrier from the planner to the engine --------------------------------------------------


def test_a_planners_layouts_carry_its_placement_instead_of_deriving_it_again(monkeypatch) -> None:
    """The job is laid on its hardware once (``lay``): the context holds it and every plan
    it simulates runs on it, with no placement or shard worked out again."""
    from mpsim.planners import context
    from mpsim.sim import layout as layout_module

    job = JobSpec(load_topology("dgx-a100-80gb"), load_trace("llama-3-8b").rescale(1), "1f1b", 4,
                  parse_layout("fsdp2xtp2spxpp2"))
    ctx = context.make_context(job)
    assert ctx.laid == layout_module.lay(job)
    assert len(ctx.replicas) == 2 and ctx.tp_groups and ctx.shard is not None

    def again(*_: object) -> object:
        raise AssertionError("derived again")

    monkeypatch.setattr(layout_module, "place_job", again)
    monkeypatch.setattr(layout_module, "stage_trace", again)
    context._SIMULATED.clear()
    layout = layout_module.layout_of_plan(ctx.plan("none"), job, checked=True, laid=ctx.laid)
    assert layout.laid is ctx.laid and layout.replicas == ctx.replicas and layout.shard is ctx.shard
    assert ctx.simulate(ctx.plan("none")).layout == "FSDP x2 x TP x2+SP x pipeline x2"


def test_more_stages_than_layers_is_refused_by_the_job_not_by_the_engine() -> None:
    """Found by fuzzing (tests/test_fuzz_mesh_and_files.py): a job of 8 stages on a 6-layer
    model was built and failed only when simulated."""
    from helpers import layer, tiny_trace

    trace = tiny_trace([layer() for _ in range(6)])
    with pytest.raises(MpsimError, match="cannot split 6 layers into 8 non-empty stages: use at most 6 stages"):
        JobSpec(load_topology("dgx1-v100"), trace, "1f1b", 8, Parallelism(pipeline=8))
