"""Tensor and sequence parallelism: the traced shard against Korthikanti et al. 2022's
Table 2 and exact parameter counts, the collectives it records, the vocabulary-parallel
loss against PyTorch's, the engine's timeline on a hand-built shard, and placement."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import layer, tiny_topology, tiny_trace, topology_dict
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.hardware.topology import parse_topology
from mpsim.models import tp_ops
from mpsim.models.tp_ops import TensorShard
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import ModelConfig
from mpsim.plans.job import JobSpec, Parallelism, job_of
from mpsim.plans.layouts import parse_layout
from mpsim.plans.mesh import DeviceMesh
from mpsim.sim import layout as layout_mod
from mpsim.sim import simulate_job
from mpsim.sim.collectives import ring_bottleneck
from mpsim.sim.layout import Job
from mpsim.sim.placement import place_groups

MS = 1e-3
GPT = ModelConfig("gpt", 2, 3072, 24, 1024, 1000)
"""A GPT shape whose heads split 8 ways; eager attention, dropout 0.1 (Korthikanti's setting)."""
S, B, H, A = 1024, 2, 3072, 24


def _layer(cfg: ModelConfig, t: int, sp: bool = False, recipe: str = "mixed-fp16"):
    return trace_model(cfg, B, recipe, shard=TensorShard(t, sp)).layers


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_activations_per_layer_follow_korthikanti_table_2(t, sp):
    """Table 2: sbh(10 + 24/t + 5as/(ht)) without sequence parallelism, sbh/t (34 + 5as/h)
    with it; selective recompute drops the 5as/h term (what the attention core keeps)."""
    if t == 1 and sp:
        pytest.skip("sequence parallelism needs t > 1")
    row = _layer(GPT, t, sp)[1]
    sbh = S * B * H
    full = sbh / t * (34 + 5 * A * S / H) if sp else sbh * (10 + 24 / t + 5 * A * S / (H * t))
    selective = sbh / t * 34 if sp else sbh * (10 + 24 / t)
    assert row.act_bytes == pytest.approx(full, rel=0.02)
    assert row.act_bytes - row.attention_core_bytes == pytest.approx(selective, rel=0.02)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_flash_attention_shards_keep_the_flash_saved_tensors(t):
    """Flash keeps q, k, v, its output (which is the output projection's input: one
    tensor) and an fp32 log-sum-exp (4sba/t bytes) instead of the s x s tensors and the
    attention's dropout mask (regenerated from the seed): sbh(10 + 24/t) + 4sba/t."""
    row = _layer(dataclasses.replace(GPT, attention="flash"), t)[1]
    assert row.act_bytes == pytest.approx(S * B * H * (10 + 24 / t) + 4 * S * B * A / t, rel=0.005)
    assert row.attention_core_bytes == (2 * S * B * H + 4 * S * B * A) // t  # the output and log-sum-exp


@pytest.mark.parametrize("cfg", [GPT, ModelConfig("bert", 2, 1024, 16, 512, 1000),
                                 ModelConfig("llama", 2, 1024, 16, 512, 1000, ffn_hidden=2816, kv_heads=4,
                                             dropout=0.0, attention="flash")], ids=["gpt", "bert", "llama-gqa"])
@pytest.mark.parametrize("t", [2, 4])
def test_shards_add_up_to_the_layer_exactly(cfg, t):
    """t shards of a layer hold its parameters with the replicated ones (norms, the
    row-parallel biases) counted t times; the vocabulary's rows are split t ways."""
    shard, whole = _layer(cfg, t), _layer(cfg, 1)
    h = cfg.hidden
    replicated = {"gpt": 4 * h + 2 * h, "bert": 4 * h + 2 * h, "llama": 2 * h}[cfg.family]
    assert t * shard[1].params - (t - 1) * replicated == whole[1].params
    rows = -(-cfg.vocab // t)
    assert whole[0].params - shard[0].params == (cfg.vocab - rows) * h
    assert whole[-1].params - shard[-1].params == (cfg.vocab - rows) * h * (1 + (cfg.family == "bert") / h)


def test_a_layer_records_megatrons_collectives():
    """Without SP: one all-reduce of the sbh activation after the attention and one after
    the MLP, each way. With SP: all-gather and reduce-scatter in their place, and in the
    backward the column-parallel layers gather their saved shard again."""
    act = S * B * H * 2
    plain, seq = _layer(GPT, 2)[1], _layer(GPT, 2, sp=True)[1]
    assert [(c.op, c.n_bytes) for c in plain.fwd_collectives] == [("all-reduce", act)] * 2
    assert [(c.op, c.n_bytes) for c in plain.bwd_collectives] == [("all-reduce", act)] * 2
    assert [c.op for c in seq.fwd_collectives] == ["all-gather", "reduce-scatter"] * 2
    assert [c.op for c in seq.bwd_collectives] == ["all-gather", "all-gather", "reduce-scatter"] * 2
    assert {c.n_bytes for c in seq.fwd_collectives + seq.bwd_collectives} == {act}


def test_vocabulary_parallel_cross_entropy_is_cross_entropy_on_one_rank():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    with tp_ops.recording(tp_ops.CommProbe()) as probe:
        ours = tp_ops.vocab_parallel_cross_entropy(logits, labels, TensorShard(2))
        (g_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.view(-1, 11), labels.view(-1))
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.allclose(ours, ref) and torch.allclose(g_ours, g_ref, atol=1e-6)
    assert [op for op, _ in probe.forward] == ["all-reduce"] * 3 and probe.backward == []


def test_a_shard_module_outside_the_tracer_says_so():
    with pytest.raises(RuntimeError, match="under the tracer only"):
        tp_ops.row_parallel_output(torch.ones(1, 2, 4), TensorShard(2))


def _hand_shard():
    """Two layers of 1 ms forward and 2 ms backward, each with two all-reduces of 500 kB
    forward and backward (a ring of 2 at 1 GB/s: 500 kB per hop, 0.5 ms each)."""
    ar = [{"op": "all-reduce", "n_bytes": 500_000}] * 2
    rows = [dict(layer(f"l{i}", 1.0, 2.0, out=4, inp=4 if i else 0), fwd_collectives=ar, bwd_collectives=ar)
            for i in range(2)]
    return tiny_trace(rows)


def test_each_layer_waits_for_its_collectives(monkeypatch):
    """F: l0 [0, 1], its all-reduces [1, 2]; l1 [2, 3], [3, 4]. B: l1 [4, 6], [6, 7]; l0
    [7, 9], [9, 10]. Both GPUs of the group are reported alike."""
    topo, shard = tiny_topology(n_gpus=2, nvlink_gbps=1.0), _hand_shard()
    monkeypatch.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
    monkeypatch.setattr("mpsim.plans.job.check_shardable", lambda *a: None)
    r = simulate_job(Job(JobSpec(topo, shard, "gpipe", 1, Parallelism(tensor=2))))
    nccl = sorted((round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans if s.lane == "nccl")
    assert nccl == [(1.0, 2.0), (3.0, 4.0), (6.0, 7.0), (9.0, 10.0)]
    compute = sorted((s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans
                     if s.lane == "compute" and s.name != "U0")
    assert compute == [("B0", 4.0, 10.0), ("F0", 0.0, 4.0)]
    assert r.gpus[0].costs_s["tp_comm_s"] == pytest.approx(4 * MS)
    assert dataclasses.replace(r.gpus[1], gpu=0) == r.gpus[0]


def test_a_recomputed_layer_runs_its_forward_collectives_again(monkeypatch):
    """l1 recomputed: its backward piece re-runs the forward (1 ms) and then its forward's
    and backward's all-reduces together (2 ms): B = l1 [4, 7], [7, 9]; l0 [9, 11], [11, 12]."""
    from mpsim.plans.plan import LayerAction

    topo, shard = tiny_topology(n_gpus=2, nvlink_gbps=1.0), _hand_shard()
    monkeypatch.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
    monkeypatch.setattr("mpsim.plans.job.check_shardable", lambda *a: None)
    spec = JobSpec(topo, shard, "gpipe", 1, Parallelism(tensor=2))
    base = layout_mod.resolve(Job(spec))
    recompute = dataclasses.replace(base, actions=({1: LayerAction(layer=1, action="recompute")},))
    from mpsim.sim import simulate_layout

    r = simulate_layout(recompute)
    nccl = sorted((round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans if s.lane == "nccl")
    assert nccl == [(1.0, 2.0), (3.0, 4.0), (7.0, 9.0), (11.0, 12.0)]


def test_tensor_groups_go_on_the_fastest_links():
    """A chain of NVLink pairs 0-1, 1-2, 2-3 (the rest over PCIe): groups of 2 take the
    pairs 0-1 and 2-3, never 1-2 (which would leave 0 and 3 on PCIe)."""
    topo = parse_topology(topology_dict(n_gpus=4, nvlink_gbps=10.0, pcie_gbps=1.0), "chain.yaml")
    _, groups = place_groups(topo, DeviceMesh((("tensor", 2), ("data", 2), ("pipeline", 1))))
    assert sorted(tuple(sorted(g)) for r in groups for g in r) == [(0, 1), (2, 3)]


def test_on_the_dgx1_groups_of_four_are_its_fully_connected_quads():
    topo = load_topology("dgx1-v100")
    _, groups = place_groups(topo, DeviceMesh((("tensor", 4), ("data", 1), ("pipeline", 2))))
    assert sorted(tuple(sorted(g)) for g in groups[0]) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    _, pairs = place_groups(topo, DeviceMesh((("tensor", 2), ("data", 2), ("pipeline", 2))))
    bandwidth = min(ring_bottleneck(topo, g) for r in pairs for g in r)
    assert bandwidth == max(ring_bottleneck(topo, (a, b)) for a in range(8) for b in range(8) if a != b)


@pytest.mark.parametrize("model, t, what", [("mistral-7b", 16, "8 KV heads"), ("gpt-5.3b", 4, "30 attention heads")])
def test_a_model_that_does_not_split_is_refused_in_one_line(model, t, what):
    with pytest.raises(MpsimError) as exc:
        job_of("dgx2-v100", model, parallelism=Parallelism(tensor=t))
    assert what in str(exc.value) and "\n" not in str(exc.value)


def test_tensor_parallelism_shrinks_each_gpus_states_and_activations():
    """Llama-3-8B on 8 A100s, one stage: TP x8 holds 1/8 of the layers' states per GPU
    (plus the replicated norms); SP cuts the activations further."""
    runs = {sp: simulate_job(Job(job_of("dgx-a100-80gb", "llama-3-8b", microbatches=8,
                                        parallelism=Parallelism(tensor=8, sequence_parallel=sp))))
            for sp in (False, True)}
    whole = job_of("dgx-a100-80gb", "llama-3-8b").trace
    states = sum(r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in whole.layers)
    for r in runs.values():
        held = sum(r.gpus[0].breakdown[k] for k in ("params", "grads", "optimizer"))
        assert states / 8 < held < states / 8 * 1.01
        assert {g.peak_bytes for g in r.gpus} == {r.gpus[0].peak_bytes}
    assert runs[True].gpus[0].breakdown["activations"] < runs[False].gpus[0].breakdown["activations"]


def test_a_3d_plan_file_round_trips_through_the_cli(capsys, tmp_path):
    """ZeRO-1 x2 x TP x2+SP x a pipeline of 2 with 2 virtual stages: the plan records every
    group (schema 3), reads back and simulates to the same result; a group split across
    the NVSwitch is placed on pairs the search found."""
    from test_cli import run

    path = tmp_path / "p.json"
    common = ["--model", "llama-3-8b", "--server", "dgx-a100-80gb", "--json", "-"]
    code, out, err = run(capsys, "plan", *common, "--tp", "2", "--sp", "--stages", "2", "--virtual-stages", "2",
                         "--dp", "2", "--zero", "1", "--microbatches", "8", "-o", str(path))
    assert code == 0, err
    made = json.loads(out)["result"]
    plan = json.loads(path.read_text())
    assert plan["schema"] == 3 and plan["virtual_stages"] == 2
    groups = plan["tensor_parallel"]["groups"]
    assert [len(g) for r in groups for g in r] == [2] * 8 and groups[0][0] == groups[0][2]
    again = json.loads(run(capsys, "simulate", "--plan", str(path), *common)[1])
    assert again["iteration_s"] == made["iteration_s"] and again["layout"] == made["layout"]
    assert made["layout"] == "ZeRO-1 x2 x TP x2+SP x pipeline x2 (interleaved x2)"


@settings(max_examples=40, deadline=None)
@given(fwd=st.lists(st.integers(1, 5), min_size=1, max_size=4), n_collectives=st.integers(0, 3),
       kb=st.integers(1, 2000), m=st.integers(1, 3), sp=st.booleans())
def test_one_stage_takes_its_compute_plus_its_collectives_exactly(fwd, n_collectives, kb, m, sp):
    """A tensor-parallel stage alone on an idle ring of 2 at 1 GB/s: each microbatch's
    forward and backward take their layers' compute plus, per collective, what a ring of
    2 sends per hop (all-reduce: the buffer; all-gather and reduce-scatter: half)."""
    ops = ["all-gather", "reduce-scatter"] if sp else ["all-reduce"]
    coll = [{"op": ops[i % len(ops)], "n_bytes": kb * 1000} for i in range(n_collectives)]
    rows = [dict(layer(f"l{i}", float(f), 2.0 * f, out=4, inp=4 if i else 0), fwd_collectives=coll,
                 bwd_collectives=coll) for i, f in enumerate(fwd)]
    shard = tiny_trace(rows)
    per_hop_ms = sum(c["n_bytes"] * (1.0 if c["op"] == "all-reduce" else 0.5) for c in coll) / 1e6
    expected_ms = m * sum(3.0 * f + 2 * per_hop_ms for f in fwd)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
        mp.setattr("mpsim.plans.job.check_shardable", lambda *a: None)
        r = simulate_job(Job(JobSpec(tiny_topology(n_gpus=2, nvlink_gbps=1.0), shard, "gpipe", m,
                                     Parallelism(tensor=2))))
    end_ms = max(s.end_s for s in r.spans if s.lane == "compute" and s.name[0] != "U") / MS
    assert end_ms == pytest.approx(expected_ms, rel=1e-9)
    assert r.gpus[0].costs_s["tp_comm_s"] == pytest.approx(m * len(fwd) * 2 * per_hop_ms * MS, rel=1e-9, abs=1e-15)


def test_bert_shards_under_sequence_parallelism():
    """BERT's token-type embedding is added on the shard's part of the sequence."""
    rows = _layer(ModelConfig("bert", 2, 1024, 16, 512, 1000), 2, sp=True)
    assert rows[0].output_bytes == 512 // 2 * B * 1024 * 2  # the embedding's output: half the sequence
    assert [c.op for c in rows[0].fwd_collectives] == ["reduce-scatter"]


def test_views_draw_the_collectives_lane(tmp_path):
    """Chrome trace and HTML page take the collectives' spans (data and tensor parallel)."""
    from mpsim.views.chrome import write_chrome_trace
    from mpsim.views.html import simulate_page

    job = job_of("dgx-a100-80gb", "llama-3-8b", microbatches=4, n_stages=2,
                 parallelism=Parallelism(tensor=2, data=2, sequence_parallel=True), record_link_rates=True)
    r = simulate_job(Job(job))
    path = tmp_path / "t.json"
    write_chrome_trace(r, path)
    lanes = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert "collectives (NCCL)" in lanes
    assert "GPU 0 nccl</text>" in simulate_page(r, None)


def test_best_plans_an_interleaved_layout_under_the_compute_partition_only():
    from mpsim.api import plan_job

    job = job_of("dgx-a100-80gb", "llama-3-8b", microbatches=8, n_stages=4, strategy="best",
                 parallelism=Parallelism(virtual_stages=2))
    planned = plan_job(job)
    assert planned.result.fits and planned.plan.virtual_stages == 2


def test_a_plan_file_fixes_the_layout_so_layout_options_beside_it_are_refused(capsys, tmp_path):
    from test_cli import run

    path = tmp_path / "p.json"
    common = ["--model", "llama-3-8b", "--server", "dgx-a100-80gb"]
    assert run(capsys, "plan", *common, "--tp", "2", "--stages", "4", "-o", str(path))[0] == 0
    code, _, err = run(capsys, "simulate", "--plan", str(path), *common, "--tp", "4")
    assert code == 2 and "the plan file fixes the layout" in err and len(err.strip().splitlines()) == 1


def test_a_sweep_over_3d_layouts_leaves_out_what_the_model_cannot_split():
    from mpsim.studies.sweep import grid

    points = grid(["dgx-a100-80gb"], ["gpt-5.3b", "llama-3-8b"], "1f1b", [1], [8], ["none"], layouts="3d")
    tensor = {md: {parse_layout(p.layout).tensor for p in points if p.model == md} for md in ("gpt-5.3b", "llama-3-8b")}
    assert tensor == {"gpt-5.3b": {2}, "llama-3-8b": {2, 4, 8}}


def test_every_tensor_rank_gets_its_share_of_the_host():
    """Host memory, NVMe and the CPU's Adam are shared by every GPU that runs a copy of the
    simulated GPU's work: data x tensor of them."""
    from mpsim.sim.context import RunContext

    job = job_of("dgx-a100-80gb", "llama-3-8b", microbatches=4, n_stages=1,
                 parallelism=Parallelism(tensor=4, data=2, sequence_parallel=True))
    run = RunContext(layout_mod.resolve(Job(job)))
    assert run.replicas == 8 and run.host_share_bytes == job.topology.host_memory_bytes // 8
