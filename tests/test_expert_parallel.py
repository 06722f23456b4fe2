"""Expert parallelism: the shard's bytes against the formula, the busiest GPU's load, an
exact timeline of an MoE layer's all-to-alls, the expert gradients' own group, refusals."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.errors import MpsimError
from mpsim.models.expert_parallel import UNIFORM, ExpertLoad, expert_shard, parse_expert_load
from mpsim.plans.job import JobSpec
from mpsim.plans.mesh import Parallelism, describe, parse_layout
from mpsim.sim import Job, simulate_job

MS = 1e-3
MB = 10**6


def _moe_row(name: str = "moe", params: int = 1000, expert_params: int = 800, experts: int = 4, top_k: int = 2,
             dispatch: int = MB, act: int = 0, expert_act: int = 0, expert_share: float = 1.0) -> dict:
    row = layer(name, 1.0, 2.0, act=act, params=params)
    row.update(experts=experts, experts_per_token=top_k, expert_params=expert_params, dispatch_bytes=dispatch,
               expert_act_bytes=expert_act, expert_fwd_flops=row["fwd_flops"] * expert_share,
               expert_bwd_flops=row["bwd_flops"] * expert_share)
    return row


def _job(rows: list[dict], n_gpus: int, layout: str, load: ExpertLoad = UNIFORM, gbps: float = 1.0) -> JobSpec:
    topo = tiny_topology(n_gpus=n_gpus, nvlink_gbps=gbps)
    return JobSpec(topo, tiny_trace(rows), "gpipe", 1, parse_layout(layout), expert_load=load)


def test_the_expert_axis_reads_and_prints_like_the_others() -> None:
    p = parse_layout("ddp2xep4")
    assert p.axes == (("expert", 4),) and p.replicas == 8
    assert describe(p, 1) == "DDP x2 x EP x4"
    assert Parallelism(axes=(("expert", 8),)).describe(1) == "EP x8"


@pytest.mark.parametrize("ep", [2, 4])
def test_a_gpu_holds_the_dense_part_and_one_in_ep_of_the_experts(ep: int) -> None:
    """Weights, gradients and optimizer states: 2, 2 and 12 bytes a parameter of the
    dense part plus expert_params / ep."""
    trace = tiny_trace([_moe_row(params=1000, expert_params=800)])
    row = expert_shard(trace, ep).layers[0]
    kept = 200 + 800 // ep
    assert (row.params, row.param_bytes, row.grad_bytes, row.optimizer_bytes) == (kept, 2 * kept, 2 * kept, 12 * kept)
    assert row.expert_params == 800 // ep and row.experts == 4 // ep
    assert expert_shard(trace, ep).spec.params == kept


def test_the_busiest_gpu_carries_its_load_in_saved_bytes_and_all_to_alls() -> None:
    """E = 4 over 2 GPUs, busiest expert 1/2 of the tokens: that GPU gets 1/2 + 1/6 of them,
    4/3 of the mean."""
    load = ExpertLoad(busiest_share=0.5)
    assert load.rank_factor(4, 2) == pytest.approx(4 / 3)
    row = expert_shard(tiny_trace([_moe_row(act=900, expert_act=600)]), 2, load).layers[0]
    assert (row.act_bytes, row.expert_act_bytes, row.dispatch_bytes) == (1100, 800, round(MB * 4 / 3))


@pytest.mark.parametrize(("share", "experts", "ep", "factor"), [
    (0.125, 8, 8, 1.0),  # uniform
    (0.5, 8, 8, 4.0),  # one expert a GPU: the busiest GPU's share x 8
    (1.0, 8, 2, 2.0),  # every token to one expert: one GPU does all of it
])
def test_a_stated_busiest_share_gives_the_busiest_gpus_factor(share, experts, ep, factor) -> None:
    assert ExpertLoad(busiest_share=share).rank_factor(experts, ep) == pytest.approx(factor)


def test_a_measured_histogram_takes_the_busiest_block_of_experts(tmp_path) -> None:
    path = tmp_path / "load.json"
    path.write_text('{"tokens": [40, 10, 10, 20, 5, 5, 5, 5]}')
    load = parse_expert_load(str(path))
    assert load.rank_factor(8, 4) == pytest.approx(4 * 0.5)  # experts 0-1 hold 50 of 100
    assert load.rank_factor(8, 2) == pytest.approx(2 * 0.8)
    with pytest.raises(MpsimError, match="lists 8 experts, but the layers have 16"):
        load.rank_factor(16, 4)


@pytest.mark.parametrize("bad", ["0", "1.5", "nan", "-3%", "no-such-file.json"])
def test_a_bad_expert_load_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(MpsimError) as exc:
        parse_expert_load(bad)
    assert "\n" not in str(exc.value)


def test_a_layer_waits_for_its_dispatch_and_combine() -> None:
    """Two GPUs, one NVLink of 1 GB/s each way; a dense layer then an MoE layer sending
    1 MB a GPU per all-to-all (0.5 MB to the peer: 0.5 ms). F: l0 [0, 1], moe [1, 2],
    its all-to-alls [2, 3]; B: moe [3, 5], [5, 6]; l0 [6, 8]."""
    r = simulate_job(Job(_job([layer("l0", 1.0, 2.0), _moe_row(params=0, expert_params=0)], 2, "ep2")))
    nccl = sorted((round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans
                  if s.name.startswith("expert parallel"))
    assert nccl == [(2.0, 3.0), (5.0, 6.0)]
    assert r.gpus[0].costs_s["ep_comm_s"] == pytest.approx(2 * MS)
    assert r.iteration_s == pytest.approx(8 * MS)


def test_the_busiest_gpu_is_slower_by_its_load() -> None:
    """Busiest expert 1/2 of 4: the MoE layer's compute and all-to-alls take 4/3 as long.
    F: l0 [0, 1], moe [1, 7/3], a2a [7/3, 11/3]; B: moe +8/3, a2a +4/3, l0 +2."""
    rows = [layer("l0", 1.0, 2.0), _moe_row(params=0, expert_params=0)]
    r = simulate_job(Job(_job(rows, 2, "ep2", ExpertLoad(busiest_share=0.5))))
    assert r.iteration_s == pytest.approx((1 + 4 / 3 + 4 / 3 + 8 / 3 + 4 / 3 + 2) * MS)


def test_expert_gradients_reduce_over_the_expert_data_group_only() -> None:
    """EP x2 x DDP x2 on 4 GPUs: the dense gradients are all-reduced over all 4, the
    experts' over the 2 GPUs holding the same experts; EP x4 alone reduces no expert
    gradient at all."""
    rows = [_moe_row(params=1000, expert_params=800, dispatch=0)]
    both = simulate_job(Job(_job(rows, 4, "ddp2xep2")))
    labels = [s.name for s in both.spans if s.lane == "nccl"]
    assert any("expert gradients" in n for n in labels) and any(n.startswith("all-reduce of layers") for n in labels)
    alone = simulate_job(Job(_job(rows, 4, "ep4")))
    assert not any("expert gradients" in s.name for s in alone.spans)


def test_expert_parallelism_is_refused_for_a_dense_model_and_uneven_experts() -> None:
    with pytest.raises(MpsimError, match="no mixture-of-experts layers"):
        _job([layer("l0")], 2, "ep2")
    with pytest.raises(MpsimError, match="3 experts do not split over an expert-parallel degree of 2"):
        _job([_moe_row(experts=3, top_k=1)], 2, "ep2")


def test_dense_traces_and_files_are_unchanged_by_the_moe_fields() -> None:
    trace = tiny_trace([layer("l0")])
    assert "experts" not in trace.to_json() and trace.active_params == trace.spec.params
    moe = tiny_trace([_moe_row(params=1000, expert_params=800, experts=4, top_k=1)])
    assert moe.active_params == 200 + 800 / 4


def test_zero1_splits_dense_states_over_data_x_expert_and_the_experts_over_data() -> None:
    """ZeRO-1 x2 x EP x2 on 4 GPUs, 1000 parameters of which 800 in 4 experts: a GPU keeps
    200 dense + 400 expert parameters; their optimizer states (12 bytes each) over 4 and
    over 2 GPUs: 12 x 200 / 4 + 12 x 400 / 2 = 3000 bytes."""
    rows = [_moe_row(params=1000, expert_params=800, dispatch=0)]
    r = simulate_job(Job(_job(rows, 4, "zero1x2xep2")))
    assert r.gpus[0].breakdown["optimizer"] == 12 * 200 // 4 + 12 * 400 // 2
    labels = [s.name for s in r.spans if s.lane == "nccl"]
    assert any(n.startswith("reduce-scatter of layers 0-0 expert gradients") for n in labels)
    assert "all-gather of updated expert parameters" in labels


@pytest.mark.parametrize("layout", ["zero2x2xep2", "fsdp2xep2"])
def test_zero2_and_fsdp_with_experts_are_refused_in_one_line(layout: str) -> None:
    with pytest.raises(MpsimError, match="ZeRO-1 .* is simulated; ZeRO-2, FSDP and HSDP are not yet"):
        _job([_moe_row()], 4, layout)


def test_searches_offer_expert_layouts_to_a_mixture_of_experts_only() -> None:
    from mpsim.plans.layouts import candidate_layouts, short_name

    topo = tiny_topology(n_gpus=4)
    moe, dense = tiny_trace([_moe_row(experts=4)] * 2), tiny_trace([layer("a"), layer("b")])
    names = {short_name(p, p.pipeline or 1) for p in candidate_layouts(topo, "data", trace=moe)}
    assert {"ddp2xep2", "zero1x2xep2", "ep4", "zero1x1xep4", "ddp4", "fsdp4"} <= names
    experts = {short_name(p, p.pipeline or 1) for p in candidate_layouts(topo, "expert", trace=moe)}
    assert "ep2xpp2" in experts and all("ep" in n for n in experts)
    assert not any(p.expert > 1 for p in candidate_layouts(topo, "all", trace=dense))
    with pytest.raises(MpsimError, match="no layout fits"):
        candidate_layouts(topo, "expert", trace=dense)


def test_choose_tokens_searches_expert_degrees_that_divide_the_experts() -> None:
    from mpsim.data.catalog import load_cluster
    from mpsim.studies.scale import shapes

    cluster = load_cluster("dgx-h100-superpod")
    moe = tiny_trace([_moe_row(experts=8)] * 4)
    degrees = {s.expert for s in shapes(cluster, moe, (1,))}
    assert degrees == {1, 2, 4, 8}
    assert all(s.zero_stage == 1 and s.tensor == 1 for s in shapes(cluster, moe, (1,)) if s.expert > 1)
    assert {s.expert for s in shapes(cluster, tiny_trace([layer("a")] * 4), (1,))} == {1}


def test_an_overlapping_runtime_hides_all_to_alls_behind_the_layers_gemms() -> None:
    """Roofline times (no measured ms): the MoE layer's forward is 1e9 FLOPs at 1 TFLOP/s
    of matmul rate (1 ms, all GEMM); its two all-to-alls (0.5 ms each) hide behind it under
    megatron-core-ep-overlap, and sit after it under the default."""
    moe = _moe_row(params=0, expert_params=0)
    moe.update(fwd_ms=None, bwd_ms=None)
    topo = tiny_topology(n_gpus=2, nvlink_gbps=1.0)
    runs = {}
    for profile in ("megatron-lm", "megatron-core-ep-overlap"):
        job = JobSpec(topo, tiny_trace([moe]), "gpipe", 1, parse_layout("ep2"), runtime_profile=profile)
        runs[profile] = simulate_job(Job(job))
    exposed = runs["megatron-lm"].iteration_s - runs["megatron-core-ep-overlap"].iteration_s
    assert exposed == pytest.approx(2 * MS, rel=1e-6)  # both passes' all-to-alls hidden: 1 ms each
    assert runs["megatron-core-ep-overlap"].gpus[0].costs_s["ep_comm_s"] == pytest.approx(2 * MS)


@pytest.mark.parametrize("field", ["expert_params", "expert_act_bytes", "expert_fwd_flops", "expert_bwd_flops",
                                   "dispatch_bytes"])
def test_a_dense_row_with_an_expert_field_is_refused(field: str) -> None:
    row = layer("l0", act=10, params=10)
    row[field] = 1
    with pytest.raises(MpsimError, match="expert fields need experts > 0"):
        tiny_trace([row])
