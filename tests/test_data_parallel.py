"""Data parallelism in the engine: ZeRO's model-state accounting, DDP's bucketed
all-reduce overlapped with the backward, ZeRO-3's gathers, on hand-built servers whose
timelines are written by hand (1 GB/s links, no latency: 500 kB take 0.5 ms)."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.errors import MpsimError
from mpsim.plans.job import JobSpec, Parallelism, job_of
from mpsim.plans.mesh import DeviceMesh
from mpsim.sim import simulate_job
from mpsim.sim.layout import Job
from mpsim.sim.placement import place_replicas
from mpsim.sim.program import Sharding, static_bytes
from mpsim.timing.costs import cost_model
from mpsim.units import MiB

MS = 1e-3
P = 250_000
"""Parameters per layer: 500 kB of fp16 weights and of gradients, 3 MB of Adam states."""


def _trace(n_layers: int = 3):
    return tiny_trace([layer(f"l{i}", 1.0, 2.0, params=P, out=4, inp=4 if i else 0) for i in range(n_layers)])


def _run(par: Parallelism, microbatches: int = 1, n_layers: int = 3):
    topo, trace = tiny_topology(n_gpus=2, nvlink_gbps=1.0), _trace(n_layers)
    return simulate_job(Job(JobSpec(topo, trace, "gpipe", microbatches, par))), topo, trace


def _spans(r, lane: str, gpu: int = 0) -> list[tuple[str, float, float]]:
    return sorted((s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans
                  if s.gpu == gpu and s.lane == lane)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("zero, per_param", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n),
                                             (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_model_state_bytes_per_gpu_follow_the_zero_paper(n, zero, per_param):
    """Mixed-precision Adam: 2 + 2 + 12 bytes per parameter; ZeRO section 5.1."""
    rows = _trace(4).layers
    states = static_bytes(rows, 1, 0, Sharding(n, zero))
    total = states["params"] + states["grads"] + states["optimizer"]
    assert total == pytest.approx(per_param(n) * 4 * P, rel=1e-12)


def test_ddp_all_reduces_each_bucket_as_its_gradients_are_ready():
    """Three layers, a bucket each (500 kB >= 0.4 MiB). Backward of l2, l1, l0 at [3, 5],
    [5, 7], [7, 9] ms; each bucket's all-reduce on a ring of 2 sends 500 kB per hop (2 steps
    of 250 kB): 0.5 ms, overlapping the next layer's backward. The update waits for the
    last one: the update task, waiting from 9 ms, runs from 9.5 ms."""
    r, topo, trace = _run(Parallelism(data=2, bucket_mib=0.4))
    update_ms = cost_model(trace, topo.spec.gpu).update_s(trace.layers) / MS
    assert _spans(r, "nccl") == [
        ("all-reduce of layers 0-0 gradients, microbatch 0", 9.0, 9.5),
        ("all-reduce of layers 1-1 gradients, microbatch 0", 7.0, 7.5),
        ("all-reduce of layers 2-2 gradients, microbatch 0", 5.0, 5.5),
    ]
    assert _spans(r, "compute") == [("B0", 3.0, 9.0), ("F0", 0.0, 3.0),
                                    ("U0", 9.0, pytest.approx(9.5 + update_ms, rel=1e-9))]
    assert r.gpus[0].costs_s["dp_wait_s"] == pytest.approx(0.5 * MS)
    assert r.samples_per_s == pytest.approx(2 / r.iteration_s)


def test_ddp_does_not_synchronise_on_gradient_accumulation_steps():
    """Two microbatches: only the last backward all-reduces; a 1 MiB bucket takes all
    three layers (1.5 MB), reduced once l0's backward of microbatch 1 ends."""
    r, _, _ = _run(Parallelism(data=2, bucket_mib=1.0), microbatches=2)
    assert _spans(r, "nccl") == [("all-reduce of layers 0-2 gradients, microbatch 1", 18.0, 19.5)]


def test_zero3_gathers_each_layer_before_it_runs_and_prefetches_the_next():
    """Two layers, 500 kB of weights each: an all-gather on 2 GPUs sends 250 kB per hop,
    0.25 ms; gathers run one after another on their lane, reduce-scatters on their own.
    F: gather l0 [0, .25] and l1 [.25, .5]; l0 runs [.25, 1.25], l1 [1.25, 2.25].
    B: gather l1 [2.25, 2.5] and l0 [2.5, 2.75]; l1 runs [2.5, 4.5], its gradient's
    reduce-scatter [4.5, 4.75]; l0 runs [4.5, 6.5], its reduce-scatter [6.5, 6.75]."""
    r, topo, trace = _run(Parallelism(data=2, zero_stage=3), n_layers=2)
    assert _spans(r, "nccl") == [
        ("all-gather of layer 0 parameters (backward, microbatch 0)", 2.5, 2.75),
        ("all-gather of layer 0 parameters (forward, microbatch 0)", 0.0, 0.25),
        ("all-gather of layer 1 parameters (backward, microbatch 0)", 2.25, 2.5),
        ("all-gather of layer 1 parameters (forward, microbatch 0)", 0.25, 0.5),
        ("reduce-scatter of layers 0-0 gradients, microbatch 0", 6.5, 6.75),
        ("reduce-scatter of layers 1-1 gradients, microbatch 0", 4.5, 4.75),
    ]
    update_ms = cost_model(trace, topo.spec.gpu).update_s(trace.layers) / 2 / MS
    assert _spans(r, "compute") == [("B0", 2.25, 6.5), ("F0", 0.0, 2.25),
                                    ("U0", 6.5, pytest.approx(6.75 + update_ms, rel=1e-9))]
    assert r.gpus[0].costs_s["dp_wait_s"] == pytest.approx(0.75 * MS)


def test_zero3_peaks_with_both_layers_gathered_beside_their_shards():
    """Shards: 250 kB of weights, 250 kB of gradients and 1.5 MB of Adam states per layer.
    A gathered layer's 500 kB of weights sit in a buffer of their own beside its shard
    (FSDP2's all-gather output). When l1's backward starts (2.5 ms) both layers are
    gathered (l0 prefetched) and l1's full gradient (500 kB) comes: 1.5 MB of weights,
    1 MB of gradients, 3 MB of states, 5.5 MB, the peak (reached again at 4.5 ms, when l1
    reshards and l0's gradient comes before l1's is reduce-scattered)."""
    r, _, _ = _run(Parallelism(data=2, zero_stage=3), n_layers=2)
    b = r.gpus[0].breakdown
    shard = P  # bytes of one layer's 2-byte weights (or gradients) over 2 GPUs
    assert (b["params"], b["grads"], b["optimizer"]) == (2 * shard + 2 * 2 * P, 2 * shard + 2 * P, 2 * 6 * P)
    assert r.gpus[0].peak_bytes == 5_500_000 + 4  # and the 4-byte gradient l1's backward receives


def test_zero2_frees_each_full_gradient_when_its_bucket_lands():
    r, _, trace = _run(Parallelism(data=2, zero_stage=2, bucket_mib=0.4))
    sharded = sum(row.grad_bytes for row in trace.layers) // 2
    assert r.gpus[0].breakdown["grads"] <= sharded + 2 * 2 * P  # at most two layers' full gradients in flight


def test_a_replicated_pipeline_places_its_groups_on_the_fastest_rings():
    """DGX-1: GPUs 0-3 and 4-7 are fully connected quads, 0 and 5 share no NVLink; every
    stage's pair of replicas must share an NVLink (45 GB/s or more)."""
    from mpsim.data.catalog import load_topology
    from mpsim.sim.collectives import ring_bottleneck

    topo = load_topology("dgx1-v100")
    replicas = place_replicas(topo, DeviceMesh((("data", 2), ("pipeline", 4))))
    assert sorted(g for r in replicas for g in r) == list(range(8))
    for s in range(4):
        assert topo.nvlinks_between(replicas[0][s], replicas[1][s])
        assert ring_bottleneck(topo, (replicas[0][s], replicas[1][s])) >= 45e9


@pytest.mark.parametrize("zero", [0, 3])
def test_replicas_are_accounted_not_simulated(zero):
    """Eight replicas schedule exactly as many simulation events as two: one replica's
    streams run, and each collective lands as one event whatever the ring's length."""
    job = job_of("dgx-a100-80gb", "gpt-5.3b", n_stages=1, microbatches=4)
    two, eight = (simulate_job(Job(job.but(parallelism=Parallelism(data=d, pipeline=1, zero_stage=zero))))
                  for d in (2, 8))
    one = simulate_job(Job(job))
    assert eight.sim_events == two.sim_events
    assert eight.samples_per_s == pytest.approx(8 * one.samples_per_s, rel=0.05)
    assert len({g.peak_bytes for g in eight.gpus}) == 1


def test_pipedream_with_replicas_is_refused_in_one_line():
    with pytest.raises(MpsimError, match="DDP x2 x pipeline x4 with pipedream: not simulated yet"):
        job_of("dgx1-v100", "gpt-5.3b", schedule="pipedream").but(parallelism=Parallelism(data=2))


def test_bucket_size_is_mib():
    assert Parallelism().bucket_mib * MiB == 25 * 2**20


def test_a_replicated_plan_file_round_trips_and_a_schema_1_file_still_reads(tmp_path):
    """Schema 2 carries the layout: written, read back and simulated again, it gives the
    same result; a schema 1 file (no data_parallel) reads as one replica."""
    from mpsim.planners import plan_job
    from mpsim.plans.plan import read_plan_file, write_plan_file
    from mpsim.sim.layout import job_of_plan

    job = job_of("dgx1-v100", "gpt-5.3b", microbatches=4, n_stages=4, strategy="recompute",
                 parallelism=Parallelism(data=2, zero_stage=2))
    planned = plan_job(job)
    write_plan_file(planned.plan, tmp_path / "p.json")
    again = read_plan_file(tmp_path / "p.json")
    assert again == planned.plan and again.data_parallel is not None and again.replicas == 2
    result = simulate_job(job_of_plan(job.topology, job.trace, again))
    assert (result.iteration_s, result.layout) == (planned.result.iteration_s, "ZeRO-2 x2 x pipeline x4")
    assert [g.peak_bytes for g in result.gpus] == [g.peak_bytes for g in planned.result.gpus]
    v1 = planned.plan.model_copy(update={"schema_": 1, "data_parallel": None})
    assert simulate_job(job_of_plan(job.topology, job.trace, v1)).layout == "pipeline x4"


def test_without_gradient_reduce_overlap_the_buckets_wait_for_the_backward():
    """The profile of Megatron-Core's default DDP config (megatron-lm-sync-grads): the same
    three buckets all-reduced one after another once the backward ends at 9 ms, in the order
    they were ready, and the update runs from 10.5 ms instead of 9.5."""
    topo, trace = tiny_topology(n_gpus=2, nvlink_gbps=1.0), _trace(3)
    r = simulate_job(Job(JobSpec(topo, trace, "gpipe", 1, Parallelism(data=2, bucket_mib=0.4),
                                 runtime_profile="megatron-lm-sync-grads")))
    update_ms = cost_model(trace, topo.spec.gpu).update_s(trace.layers) / MS
    assert _spans(r, "nccl") == [
        ("all-reduce of layers 0-0 gradients, microbatch 0", 10.0, 10.5),
        ("all-reduce of layers 1-1 gradients, microbatch 0", 9.5, 10.0),
        ("all-reduce of layers 2-2 gradients, microbatch 0", 9.0, 9.5),
    ]
    assert _spans(r, "compute") == [("B0", 3.0, 9.0), ("F0", 0.0, 3.0),
                                    ("U0", 9.0, pytest.approx(10.5 + update_ms, rel=1e-9))]
    assert r.gpus[0].costs_s["dp_wait_s"] == pytest.approx(1.5 * MS)
