"""Context parallelism (issue 49): the axis, one GPU's shard of a trace, the ring's
timeline on hand-built traces, the Ulysses all-to-alls' bytes, and refusals."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.kernel_records import AttentionKernel
from mpsim.models.context_parallel import context_shard, ring_blocks, ulysses_bytes
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ModelConfig
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.plans.mesh import parse_layout
from mpsim.sim import layout as layout_mod
from mpsim.sim import simulate_job
from mpsim.sim.layout import Job

MS = 1e-3
SEQ = 8192
SMALL = ModelConfig(family="llama", layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1536, seq_len=SEQ,
                    vocab=4096, attention="flash")


@pytest.fixture(scope="module")
def whole():
    return trace_model(SMALL, 1, "mixed-bf16", "small")


@pytest.mark.parametrize("c", [2, 4, 8])
def test_each_gpu_saves_one_cth_of_every_layer_as_the_causal_balance_divides_it(whole, c):
    """Mirrored chunks give every GPU s/c tokens and 1/c of the causal attention: its saved
    bytes and FLOPs per layer are the unsplit row's over c, its attention blocks' FLOPs sum
    to the row's attention FLOPs over c."""
    shard = context_shard(whole, c)
    for row, part in zip(whole.layers, shard.layers, strict=True):
        assert part.act_bytes == round(row.act_bytes / c)
        assert part.fwd_flops == pytest.approx(row.fwd_flops / c)
        assert part.params == row.params and part.optimizer_bytes == row.optimizer_bytes
        blocks = [k for k in part.fwd_kernels if isinstance(k, AttentionKernel)]
        assert sum(k.flops * k.count for k in blocks) == pytest.approx(row.fwd_attention_flops / c, rel=1e-12)


@pytest.mark.parametrize("c", [2, 4])
def test_the_token_wise_part_of_a_shard_is_a_real_trace_at_the_shorter_sequence(whole, c):
    """Checked against a trace traced at s/c: the same saved bytes, and outside attention
    the same FLOPs (attention is not the short trace's: its queries see the whole sequence)."""
    from dataclasses import replace

    short = trace_model(replace(SMALL, seq_len=SEQ // c), 1, "mixed-bf16", "short")
    shard = context_shard(whole, c)
    for part, real in zip(shard.layers, short.layers, strict=True):
        assert part.act_bytes == pytest.approx(real.act_bytes, abs=4)  # the head's loss scalar is not per token
        assert part.fwd_flops - part.fwd_attention_flops == pytest.approx(real.fwd_flops - real.fwd_attention_flops)
        assert part.bwd_flops - part.bwd_attention_flops == pytest.approx(real.bwd_flops - real.bwd_attention_flops)


def test_ring_blocks_are_one_causal_diagonal_and_c_minus_1_unmasked_halves():
    k = AttentionKernel(batch=1, heads=8, kv_heads=2, s_q=4096, s_k=4096, head_dim=64, causal=True)
    diagonal, half = ring_blocks(k, 4)
    assert (diagonal.s_q, diagonal.s_k, diagonal.causal, diagonal.count) == (1024, 1024, True, 1)
    assert (half.s_q, half.s_k, half.causal, half.count) == (1024, 512, False, 3)
    assert diagonal.flops + 3 * half.flops == pytest.approx(k.flops / 4, rel=1e-12)


def test_ulysses_all_to_alls_send_q_k_v_and_the_output_of_the_local_tokens(whole):
    """Closed form, per GPU and layer: q, k, v of s/c tokens, b s/c (h + 2 h_kv) d x 2 bytes,
    then the output b s/c h d x 2 bytes; the backward the same two in reverse."""
    c, row = 2, context_shard(whole, 2, "all-to-all").layers[1]
    h, kv, d = 8, 2, 64
    qkv, out = SEQ // c * (h + 2 * kv) * d * 2, SEQ // c * h * d * 2
    assert [(x.op, x.n_bytes) for x in row.fwd_collectives] == [("all-to-all", qkv), ("all-to-all", out)]
    assert [(x.op, x.n_bytes) for x in row.bwd_collectives] == [("all-to-all", out), ("all-to-all", qkv)]
    kernel = next(k for k in whole.layers[1].fwd_kernels if isinstance(k, AttentionKernel))
    assert ulysses_bytes(kernel, c, 2) == (qkv, out)
    attention = [k for k in row.fwd_kernels if isinstance(k, AttentionKernel)]
    assert [(k.heads, k.kv_heads, k.s_q) for k in attention] == [(h // 2, kv // 2, SEQ)]


def test_the_ring_sends_each_kv_block_c_minus_1_times_and_twice_as_much_backward(whole):
    c, row = 8, context_shard(whole, 8).layers[1]
    kv = 2 * (SEQ // c) * 2 * 64 * 2  # k and v of s/c tokens, 2 KV heads of 64, bf16
    assert [(x.op, x.n_bytes, x.steps, x.axis) for x in row.fwd_collectives] == [("send-recv", kv, 7, "context")]
    assert [(x.op, x.n_bytes, x.steps) for x in row.bwd_collectives] == [("send-recv", 2 * kv, 7)]
    assert row.workspace_bytes == round(whole.layers[1].workspace_bytes / c) + 2 * kv


# --- the ring's timeline on hand-built rows ------------------------------------------------


def _ring_run(monkeypatch, fwd_bytes: int, bwd_bytes: int):
    """Two layers of 1 ms forward and 2 ms backward, all of it attention (0.5 TFLOP/s on the
    toy GPU), on a context group of 2 over one 1 GB/s NVLink: one ring step each pass,
    hidden behind the last half of its attention (0.5 ms forward, 1 ms backward)."""
    ring = {"op": "send-recv", "axis": "context", "steps": 1}
    rows = [dict(layer(f"l{i}", 1.0, 2.0, out=4, inp=4 if i else 0), fwd_attention_flops=5e8,
                 bwd_attention_flops=1e9, fwd_collectives=[dict(ring, n_bytes=fwd_bytes)],
                 bwd_collectives=[dict(ring, n_bytes=bwd_bytes)]) for i in range(2)]
    shard = tiny_trace(rows)
    monkeypatch.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
    monkeypatch.setattr("mpsim.plans.job.check_context_parallel", lambda *a: None)
    par = Parallelism(axes=(("context", 2),), pipeline=1)
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=2, nvlink_gbps=1.0), shard, "gpipe", 1, par)))
    ring_spans = sorted((round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans
                        if s.name.startswith("context parallel"))
    end_ms = max(s.end_s for s in r.spans if s.lane == "compute" and s.name[0] != "U") / MS
    return r, ring_spans, round(end_ms, 9)


def test_a_ring_step_shorter_than_its_blocks_hides_entirely(monkeypatch):
    """Sends of 0.4 ms forward and 0.8 ms backward start with the pass's second half and end
    inside it: F l0 [0, 1] send [0.5, 0.9]; l1 [1, 2] send [1.5, 1.9]; B l1 [2, 4] send
    [3, 3.8]; l0 [4, 6] send [5, 5.8]. The iteration is the compute alone."""
    r, spans, end_ms = _ring_run(monkeypatch, 400_000, 800_000)
    assert spans == [(0.5, 0.9), (1.5, 1.9), (3.0, 3.8), (5.0, 5.8)]
    assert end_ms == 6.0
    assert r.gpus[0].costs_s["cp_comm_s"] == pytest.approx(2.4e-3)


def test_a_ring_step_longer_than_its_blocks_is_exposed_by_the_difference(monkeypatch):
    """Sends of 1.5 ms each pass: exposed 1 ms past each forward (window 0.5 ms) and 0.5 ms
    past each backward (window 1 ms): F l0 [0, 2] send [0.5, 2]; l1 [2, 4] send [2.5, 4];
    B l1 [4, 6.5] send [5, 6.5]; l0 [6.5, 9] send [7.5, 9]."""
    _, spans, end_ms = _ring_run(monkeypatch, 1_500_000, 1_500_000)
    assert spans == [(0.5, 2.0), (2.5, 4.0), (5.0, 6.5), (7.5, 9.0)]
    assert end_ms == 9.0


# --- the axis in jobs ------------------------------------------------------------------------


def test_the_context_axis_shares_samples_and_joins_the_gradient_reduction(whole):
    p = parse_layout("fsdp2xcp4")
    assert (p.context, p.replicas, p.sample_ways, p.shard_ways()) == (4, 8, 2, 8)
    assert p.describe(1) == "FSDP x2 x CP x4" and parse_layout("ddp2xcp4xtp2").describe(1) == "DDP x2 x CP x4 x TP x2"
    job = JobSpec(load_topology("dgx-h100"), whole, "1f1b", 3, p)
    assert job.samples_per_iteration == 2 * 3


def test_a_context_parallel_job_runs_less_per_gpu_and_says_so(whole):
    topo = load_topology("dgx-h100")
    alone = simulate_job(Job(JobSpec(topo, whole, "1f1b", 1, parse_layout("ddp8"))))
    split = simulate_job(Job(JobSpec(topo, whole, "1f1b", 1, parse_layout("ddp2xcp4"))))
    assert split.layout == "DDP x2 x CP x4"
    assert split.gpus[0].peak_bytes < alone.gpus[0].peak_bytes
    assert split.gpus[0].costs_s["cp_comm_s"] > 0
    assert split.samples_per_s == pytest.approx(2 / split.iteration_s)


@pytest.mark.parametrize(("layout", "attention", "match"), [
    ("cp3", "ring", "does not split into 6 equal chunks"),
    ("cp4", "all-to-all", "2 key/value heads .* do not split over context parallel x4"),
])
def test_what_the_context_axis_cannot_run_is_refused_in_one_line(whole, layout, attention, match):
    p = parse_layout(layout).model_copy(update={"context_attention": attention})
    with pytest.raises(MpsimError, match=match) as err:
        JobSpec(load_topology("dgx-h100"), whole, "1f1b", 1, p)
    assert "\n" not in str(err.value)


def test_eager_attention_is_refused_for_context_parallelism():
    from dataclasses import replace

    eager = trace_model(replace(SMALL, attention="eager", seq_len=1024), 1, "mixed-bf16", "eager")
    with pytest.raises(MpsimError, match="splits fused attention"):
        JobSpec(load_topology("dgx-h100"), eager, "1f1b", 1, parse_layout("cp2"))


# --- searches --------------------------------------------------------------------------------


def test_the_context_word_searches_every_degree_that_splits_the_sequence(whole):
    from mpsim.plans.layouts import candidate_layouts, short_name

    topo = load_topology("dgx-h100")
    names = [short_name(p, 1) for p in candidate_layouts(topo, "context", trace=whole)]
    assert "ddp4xcp2" in names and "fsdp1xcp8" in names and "zero1x2xcp2xtp2sp" in names
    assert all("cp" in n for n in names)
    assert not any("cp" in short_name(p, p.pipeline or 1) for p in candidate_layouts(topo, "all", trace=whole))


def test_all_3d_and_data_include_context_parallelism_from_a_long_sequence():
    from dataclasses import replace

    from mpsim.plans.layouts import LONG_CONTEXT_TOKENS, candidate_layouts

    long = trace_model(replace(SMALL, seq_len=LONG_CONTEXT_TOKENS), 1, "mixed-bf16", "long")
    topo = load_topology("dgx-h100")
    assert any(p.context == 8 for p in candidate_layouts(topo, "all", trace=long))
    assert any(p.context == 4 and p.tensor == 2 for p in candidate_layouts(topo, "3d", trace=long))
    data = [p for p in candidate_layouts(topo, "data", trace=long) if p.context > 1]
    assert data and all(p.tensor == 1 and p.pipeline == 1 for p in data)
    assert not any(p.context > 1 for p in candidate_layouts(topo, "data", trace=trace_model(
        replace(SMALL, seq_len=LONG_CONTEXT_TOKENS // 2), 1, "mixed-bf16", "shorter")))


def test_the_cluster_search_carves_context_groups_out_of_the_replicas_and_shares_their_samples():
    """On a server TP x2 leaves 4 replicas; a context group of 4 makes them one sample way,
    so a batch of 4 samples runs 4 microbatches."""
    from dataclasses import replace

    from mpsim.data.catalog import load_cluster
    from mpsim.studies.scale import ClusterPoint, Shape, job_of_point, shapes

    cluster = load_cluster("dgx-h100-superpod")
    long = trace_model(replace(SMALL, seq_len=32768, layers=4), 1, "mixed-bf16", "long")
    found = shapes(cluster, long, (1,))
    assert {s.context for s in found} >= {1, 2, 4, 8, 16, 32, 64}
    point = ClusterPoint("dgx-h100-superpod", "long", 1, Shape(2, 1, 3, False, 1, context=4), 4)
    job = job_of_point(point, cluster, long)
    assert job is not None and job.microbatches == 4 and job.samples_per_iteration == 4
    assert (job.parallelism.data, job.parallelism.context, job.parallelism.replicas) == (1, 4, 4)


def test_a_plan_file_keeps_the_context_axis_and_its_attention(whole, tmp_path):
    """plan writes the mesh with its attention; simulate --plan reads the same layout back."""
    from mpsim.planners.registry import plan_job
    from mpsim.plans.plan import read_plan_file, write_plan_file
    from mpsim.sim.layout import parallelism_of_plan

    p = parse_layout("ddp4xcp2").model_copy(update={"context_attention": "all-to-all"})
    assert p.describe(1) == "DDP x4 x CP x2 (all-to-all)"
    planned = plan_job(JobSpec(load_topology("dgx-h100"), whole, "1f1b", 1, p))
    write_plan_file(planned.plan, tmp_path / "plan.json")
    back = read_plan_file(tmp_path / "plan.json")
    assert back.mesh is not None and back.mesh.context_attention == "all-to-all"
    assert parallelism_of_plan(back) == p


def test_a_layer_whose_sends_hide_frees_its_workspace_before_the_next_layer_allocates(monkeypatch):
    """Pieces of 0.3 ms forward, 0.6 ms backward, their sends hidden beside the last part of
    their attention (0.07 ms forward): the compute is one sleep of the piece's length, not
    two that sum to it an ulp short, so each layer's workspace is freed at the instant the
    next one's is taken and the peak holds one layer's workspace, not two."""
    ring = {"op": "send-recv", "axis": "context", "steps": 1}
    rows = [dict(layer(f"l{i}", 0.3, 0.6, out=4, inp=4 if i else 0, workspace=100_000, act=1000),
                 fwd_attention_flops=7e7, bwd_attention_flops=1.4e8, fwd_collectives=[dict(ring, n_bytes=50_000)],
                 bwd_collectives=[dict(ring, n_bytes=50_000)]) for i in range(3)]
    shard = tiny_trace(rows)
    monkeypatch.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
    monkeypatch.setattr("mpsim.plans.job.check_context_parallel", lambda *a: None)
    par = Parallelism(axes=(("context", 2),), pipeline=1)
    r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=2, nvlink_gbps=1.0), shard, "gpipe", 2, par)))
    assert r.gpus[0].breakdown["workspace"] == 100_000


def test_a_model_without_attention_is_refused_for_context_parallelism():
    blocks = tiny_trace([layer(f"conv{i}", kind="other") for i in range(2)])
    with pytest.raises(MpsimError, match="has no attention layers"):
        JobSpec(tiny_topology(n_gpus=2), blocks, "1f1b", 1, parse_layout("cp2"))


def test_fsdp_shards_the_states_over_data_times_context_as_fsdp_over_all_gpus(whole):
    """torchtitan's FSDP and Megatron-Core's distributed optimizer shard over DP x CP: FSDP x2
    x CP x4 holds the same model states per GPU as FSDP x8."""
    topo = load_topology("dgx-h100")
    split = simulate_job(Job(JobSpec(topo, whole, "1f1b", 1, parse_layout("fsdp2xcp4"))))
    flat = simulate_job(Job(JobSpec(topo, whole, "1f1b", 1, parse_layout("fsdp8"))))
    for key in ("optimizer", "grads"):
        assert split.gpus[0].breakdown[key] == flat.gpus[0].breakdown[key] > 0


def test_a_context_group_across_servers_runs_its_ring_through_the_nics(whole):
    """CP x16 on two DGX H100s: the group is the simulated server's 8 GPUs on 2 servers, a
    ring step leaving each server through a NIC (``ContextGroup.ring_hops``)."""
    from mpsim.data.catalog import load_cluster
    from mpsim.sim.layout import resolve

    cluster = load_cluster("dgx-h100-superpod")
    job = JobSpec(cluster.server, whole, "1f1b", 1, parse_layout("cp16"), cluster=cluster, servers=2)
    layout = resolve(Job(job))
    assert layout.context_group(0) == (tuple(range(8)), 2)
    r = simulate_job(Job(job))
    assert r.gpus[0].costs_s["cp_comm_s"] > 0 and r.fits


def test_context_with_expert_parallelism_nests_the_groups_as_megatron_core_orders_them():
    """Mixtral on 8 GPUs as EP x4 x CP x2 (context innermost, then expert): the context
    groups are pairs, an expert group every second GPU, and the GPUs holding the same
    experts (their gradients' group) a context pair; each GPU routes half the copies EP x4
    alone routes, and four samples train at a time."""
    from mpsim.data.catalog import load_trace
    from mpsim.sim.layout import resolve, stage_trace

    trace = load_trace("mixtral-8x7b").rescale(1)
    job = JobSpec(load_topology("dgx-h100"), trace, "1f1b", 1, parse_layout("ep4xcp2"), strategy="none")
    layout = resolve(Job(job))
    assert layout.context_group(0) == ((0, 1), 1)
    assert layout.expert_group(0) == ((0, 2, 4, 6), 1)
    assert layout.expert_data_group(0) == ((0, 1), 1)
    assert job.samples_per_iteration == 4 and job.parallelism.expert_shard_ways() == 2
    both = stage_trace(job, "mpress")
    alone = stage_trace(JobSpec(load_topology("dgx-h100"), trace, "1f1b", 1, parse_layout("ddp2xep4")), "mpress")
    assert both is not None and alone is not None
    moe = next(i for i, r in enumerate(alone.layers) if r.dispatch_bytes)
    assert both.layers[moe].dispatch_bytes == alone.layers[moe].dispatch_bytes // 2
    assert both.layers[moe].expert_params == alone.layers[moe].expert_params
    r = simulate_job(Job(job))
    assert r.gpus[0].costs_s["cp_comm_s"] > 0 and r.gpus[0].costs_s["ep_comm_s"] > 0


def test_a_context_layout_too_big_for_the_server_is_named_in_the_refusal(whole):
    with pytest.raises(MpsimError, match=r"^CP x2 x TP x8 needs 16 GPUs but dgx-h100 has 8$"):
        parse_layout("cp2xtp8").stages_on(load_topology("dgx-h100"))


def test_the_context_word_is_read_with_spaces_as_every_word_is(whole):
    from mpsim.plans.layouts import candidate_layouts

    assert any(p.context > 1 for p in candidate_layouts(load_topology("dgx-h100"), "data, context", trace=whole))
