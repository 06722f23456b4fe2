"""Parallel layouts by name, the set the studies search, the global batch held fixed, and
the studies answering with the layout that fits or runs fastest."""

from __future__ import annotations

import json

import pytest
import yaml

from mpsim.cli import main
from mpsim.data.catalog import load_topology, load_trace, shipped_topologies
from mpsim.errors import MpsimError
from mpsim.hardware.topology import parse_topology
from mpsim.plans.job import JobSpec, data_parallel
from mpsim.plans.layouts import (
    candidate_layouts,
    microbatches_per_replica,
    on_layout,
    parse_layout,
    short_name,
)
from mpsim.studies import bounds
from mpsim.studies.capacity import fits_layouts
from mpsim.studies.choose import choose
from mpsim.units import GiB


@pytest.mark.parametrize(("name", "data", "zero", "stages", "label"), [
    ("pp8", 1, 0, 8, "pipeline x8"),
    ("ddp8", 8, 0, 1, "DDP x8"),
    ("zero1x8", 8, 1, 1, "ZeRO-1 x8"),
    ("zero2x4", 4, 2, 1, "ZeRO-2 x4"),
    ("fsdp8", 8, 3, 1, "FSDP x8"),
    ("zero3x8", 8, 3, 1, "FSDP x8"),
    ("ddp2xpp4", 2, 0, 4, "DDP x2 x pipeline x4"),
    ("fsdp2xpp4", 2, 3, 4, "FSDP x2 x pipeline x4"),
    ("zero2x4xpp2", 4, 2, 2, "ZeRO-2 x4 x pipeline x2"),
])
def test_layout_names_parse_and_label_as_describe_does(name, data, zero, stages, label):
    p = parse_layout(name)
    assert (p.data, p.zero_stage, p.pipeline) == (data, zero, stages)
    assert label == p.describe(stages)
    assert parse_layout(short_name(p, stages)) == p


@pytest.mark.parametrize("bad", ["pp", "dp8", "fsdp", "zero4x2", "xpp4", "ddp2xpp", "pipeline8", "ddp8x", "tp",
                                 "pp2xtp2", "tp2x", "fsdp2tp2", "tpsp2"])
def test_a_bad_layout_name_is_one_line_listing_the_forms(bad):
    with pytest.raises(MpsimError) as err:
        parse_layout(bad)
    text = str(err.value)
    assert "\n" not in text and repr(bad) in text and "pp8" in text and "fsdp2xpp4" in text


def test_a_zero_degree_is_refused_in_one_line_naming_the_layout():
    with pytest.raises(MpsimError, match=r"^layout 'pp0': pipeline"):
        parse_layout("pp0")


def _names(topo_name: str, which: str, schedule: str | None = None) -> list[str]:
    return [short_name(p, p.pipeline or 1) for p in candidate_layouts(load_topology(topo_name), which, schedule)]


def test_every_layout_of_8_gpus():
    assert _names("dgx1-v100", "all")[:13] == [
        "pp8", "ddp2xpp4", "zero1x2xpp4", "zero2x2xpp4", "fsdp2xpp4", "ddp4xpp2", "zero1x4xpp2", "zero2x4xpp2",
        "fsdp4xpp2", "ddp8", "zero1x8", "zero2x8", "fsdp8"]
    assert _names("dgx1-v100", "3d") == _names("dgx1-v100", "all")[13:] == [
        "tp2spxpp4", "ddp2xtp2spxpp2", "zero1x2xtp2spxpp2", "fsdp2xtp2spxpp2", "ddp4xtp2sp", "zero1x4xtp2sp",
        "fsdp4xtp2sp", "tp4spxpp2", "ddp2xtp4sp", "zero1x2xtp4sp", "fsdp2xtp4sp", "tp8sp"]
    assert _names("dgx1-v100", "pipeline,data") == ["pp8", "ddp8", "zero1x8", "zero2x8", "fsdp8"]
    assert _names("dgx1-v100", "hybrid") == _names("dgx1-v100", "all")[1:9]


def test_every_layout_of_4_gpus():
    assert _names("titanrtx-x4-pcie", "all") == [
        "pp4", "ddp2xpp2", "zero1x2xpp2", "zero2x2xpp2", "fsdp2xpp2", "ddp4", "zero1x4", "zero2x4", "fsdp4",
        "tp2spxpp2", "ddp2xtp2sp", "zero1x2xtp2sp", "fsdp2xtp2sp", "tp4sp"]
    assert _names("titanrtx-x4-pcie", "data") == ["ddp4", "zero1x4", "zero2x4", "fsdp4"]


def test_3d_layouts_leave_out_degrees_the_model_does_not_split():
    """GPT-5.3B has 30 heads: tensor parallel over 2 GPUs, not 4 or 8."""
    layouts = candidate_layouts(load_topology("dgx1-v100"), "3d", trace=load_trace("gpt-5.3b"))
    assert {p.tensor for p in layouts} == {2} and len(layouts) == 7


@pytest.mark.parametrize("name", ["pp8", "pp4v2", "tp8", "tp4spxpp2", "zero1x2xtp2spxpp2", "fsdp2xtp4",
                                  "ddp2xtp2xpp2v2"])
def test_layout_names_read_back(name):
    p = parse_layout(name)
    assert short_name(p, p.pipeline or 1) == name


def test_names_and_words_mix_in_order_without_repeats_and_too_big_names_are_left_out():
    assert _names("titanrtx-x4-pcie", "fsdp4,pipeline,fsdp8,zero3x4") == ["fsdp4", "pp4"]
    with pytest.raises(MpsimError, match="no layout fits the 4 GPU"):
        candidate_layouts(load_topology("titanrtx-x4-pcie"), "fsdp8")


def test_pipedream_searches_pipelines_only():
    assert _names("dgx1-v100", "all", "pipedream") == ["pp8"]


@pytest.mark.parametrize(("name", "schedule", "global_m", "per_replica"), [
    ("pp8", "1f1b", 16, 16),
    ("fsdp8", "1f1b", 16, 2),
    ("ddp2xpp4", "1f1b", 16, 8),
    ("zero1x4xpp2", "1f1b", 6, 2),     # ceil(6 / 4) = 2, the pipeline of 2 needs 2
    ("ddp4xpp2", "1f1b", 4, 2),       # ceil(4 / 4) = 1, raised to one per stage
    ("ddp4xpp2", "gpipe", 4, 1),      # GPipe needs no minimum
    ("fsdp8", "1f1b", 12, 2),         # ceil(12 / 8)
])
def test_the_global_batch_is_held_fixed_across_layouts(name, schedule, global_m, per_replica):
    p = parse_layout(name)
    assert microbatches_per_replica(global_m, p, p.pipeline or 1, schedule) == per_replica
    job = JobSpec(load_topology("dgx1-v100"), load_trace("gpt-5.3b"), schedule, 16)
    assert on_layout(job, p, global_m).microbatches == per_replica


def test_a_bad_count_of_microbatches_is_refused():
    with pytest.raises(MpsimError, match="--global-microbatches must be from 1"):
        microbatches_per_replica(0, data_parallel(8, 3, 1), 1, "1f1b")


# -- the studies answer with the layout ---------------------------------------------------------

def test_choose_names_the_layout_of_the_fastest_plan_on_a_shipped_server(capsys):
    # llama-3-8b on a DGX A100 80GB with no memory savings: 8 FSDP replicas (2 microbatches
    # each) beat the pipeline of 8 stages (16 microbatches), both fitting
    report = choose("llama-3-8b", ["dgx-a100-80gb"], strategies=("none",), layouts="pipeline,fsdp8")
    row = report.rows[0]
    assert row.fits and row.layout == "FSDP x8" and row.result.replicas == 8 and row.result.microbatches == 2
    # the pipeline's time floor is above FSDP's iteration: the closed-form tier never simulates it
    # (under either partition)
    assert {t.layout for t in row.tried} == {"FSDP x8"} and row.decided_by_floors == 2
    with bounds.without_floors():
        every = choose("llama-3-8b", ["dgx-a100-80gb"], strategies=("none",), layouts="pipeline,fsdp8").rows[0]
    tried = {t.layout: t for t in every.tried}
    assert set(tried) == {"pipeline x8", "FSDP x8"} and tried["pipeline x8"].fits
    assert every.samples_per_s == row.samples_per_s > tried["pipeline x8"].samples_per_s
    assert row.to_dict()["layout"] == "FSDP x8" and "FSDP x8" in report.recommendation
    code = main(["choose", "--model", "llama-3-8b", "--servers", "dgx-a100-80gb", "--strategy", "none",
                 "--layouts", "pp8,fsdp8", "--json", "-"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["layouts"] == "pp8,fsdp8" and d["rows"][0]["layout"] == "FSDP x8"


def _dgx1_with(capacity_gib: float):
    """The DGX-1 with GPUs of ``capacity_gib`` usable: between the peaks of the two layouts below."""
    d = yaml.safe_load(shipped_topologies()["dgx1-v100"].read_text())
    d["gpu"]["memory_mib"] = capacity_gib * 1024 + d["gpu"]["reserved_mib"]
    d["name"] = "dgx1-37gb"
    return parse_topology(d, "dgx1-37gb.yaml")


def test_a_model_too_big_for_the_pipeline_is_answered_with_fsdp_where_it_fits():
    # 38 transformer layers of GPT-5.3B's shape: the pipeline of 8 peaks at 38.05 GiB on
    # its first stage, 8 FSDP replicas at 35.67 GiB (16 P / 8 per GPU plus one microbatch's
    # activations of the whole model); GPUs of 37 GiB hold only the latter
    topo = _dgx1_with(37.0)
    trace = load_trace("gpt-5.3b").with_layers(38)
    report = choose(trace, [topo], strategies=("none",), layouts="pipeline,fsdp8", headroom_gib=0.0)
    row = report.rows[0]
    pipeline = next(t for t in row.tried if t.layout == "pipeline x8")
    assert not pipeline.fits and pipeline.max_peak_bytes > topo.capacity_bytes
    assert row.fits and row.layout == "FSDP x8" and row.max_peak_bytes <= topo.capacity_bytes <= 37 * GiB
    job = JobSpec(topo, trace, "1f1b", 16)
    [answer] = fits_layouts(job, "gpt", [trace], ("none",), "pipeline,fsdp8", 16)
    best = answer.best_row(0)
    assert best.result.fits and best.result.layout == "FSDP x8"
    assert not answer.reports[0].rows[0].result.fits  # the pipeline's row
    top = answer.largest
    assert top is not None and top[1].result.layout == "FSDP x8" and top[1].layers >= 38


def test_choose_passes_over_a_faster_plan_at_risk_for_a_safe_one_and_says_so():
    """The same 37 GiB GPUs: FSDP peaks at 35.67 GiB, leaving less than the default 1 GiB
    headroom once the allocator's reserve and the CUDA context are counted; the pipeline
    under the memory-balanced partition fits with room, slower, and stands for the server."""
    topo = _dgx1_with(37.0)
    trace = load_trace("gpt-5.3b").with_layers(38)
    row = choose(trace, [topo], strategies=("none",), layouts="pipeline,fsdp8").rows[0]
    assert row.fits and not row.at_risk and row.layout == "pipeline x8"
    assert row.faster_at_risk is not None and row.faster_at_risk.layout == "FSDP x8"
    assert row.faster_at_risk.samples_per_s > row.samples_per_s
    report = choose(trace, [topo], strategies=("none",), layouts="pipeline,fsdp8")
    assert "a faster plan on dgx1-37gb (FSDP x8, 8.64 samples/s) is at risk: GPU " in report.recommendation
    assert report.to_dict()["rows"][0]["faster_at_risk"]["layout"] == "FSDP x8"


def test_the_cli_refuses_a_bad_layout_in_one_line(capsys):
    code = main(["choose", "--model", "gpt-5.3b", "--servers", "dgx1-v100", "--layouts", "fsdp"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown layout 'fsdp'" in err and len(err.strip().splitlines()) == 1
