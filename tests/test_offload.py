"""ZeRO-Offload and ZeRO-Infinity as strategies (MPress Fig. 8's baselines), on hand-built
servers: where each puts the model states, and when a parameter shard is fetched."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_trace, topology_dict

from mpsim.hardware.topology import parse_topology
from mpsim.planners import plan_job
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.plans.strategies import STRATEGIES

MS = 1e-3
P = 250_000
"""Parameters per layer: 500 kB of fp16 weights and of gradients, 3 MB of Adam states."""


def _topology(host_gib: float = 64.0, nvme: bool = False):
    d = topology_dict(n_gpus=2, nvlink_gbps=1.0)
    d["host"]["memory_gib"] = host_gib
    if nvme:
        d["nvme"] = {"capacity_gib": 1.0, "read_gbps": 1.0, "write_gbps": 1.0}
    return parse_topology(d, "tiny.yaml")


def _plan(strategy: str, topo=None, data: int = 2):
    trace = tiny_trace([layer(f"l{i}", 1.0, 2.0, params=P, out=4, inp=4 if i else 0, kind="head")
                        for i in range(2)])
    job = JobSpec(topo or _topology(), trace, "gpipe", 1, Parallelism(data=data, pipeline=1), strategy=strategy)
    return plan_job(job)


def test_both_are_strategies():
    assert {"zero-offload", "zero-infinity"} <= set(STRATEGIES)


def test_zero_offload_is_zero2_with_the_optimizer_on_the_host():
    """Per GPU: whole fp16 weights (2 x 500 kB), no optimizer states, and no gradient
    shard: each reduced shard goes to the host as it lands, so only the full gradient of a
    layer in its backward is there; the host holds both GPUs' halves of the Adam states
    (2 x 3 MB) and of the gradients (2 x 500 kB)."""
    planned = _plan("zero-offload")
    r = planned.result
    assert planned.plan.data_parallel is not None and planned.plan.data_parallel.zero_stage == 2
    assert r.layout == "ZeRO-2 x2"
    b = r.gpus[0].breakdown
    assert (b["params"], b["optimizer"]) == (2 * 2 * P, 0)
    assert 0 < b["grads"] <= 2 * 2 * P
    assert r.host_peak_bytes == 2 * (12 + 2) * P
    copies = [s for s in r.spans if s.gpu == 0 and s.lane == "d2h"]
    assert [s.name for s in copies] == ["reduce-scatter of layers 0-1 gradients, microbatch 0: shard to host"]


def test_zero_infinity_fetches_each_shard_before_its_gather():
    """A 250 kB weight shard over the 1 GB/s PCIe link takes 0.25 ms, then the all-gather
    (250 kB per ring hop) 0.25 ms: layer 0 starts at 0.5 ms; layer 1's fetch and gather
    follow on the same lane and land at 1.0 ms, before layer 0 ends at 1.5."""
    planned = _plan("zero-infinity")
    r = planned.result
    assert planned.plan.data_parallel.offload_params and planned.plan.data_parallel.offload_device == "host"
    forward = sorted((s.lane, s.name, round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans
                     if s.gpu == 0 and s.start_s < 1.5 * MS and s.lane in ("h2d", "nccl"))
    assert forward == [
        ("h2d", "parameter shard from host", 0.0, 0.25), ("h2d", "parameter shard from host", 0.5, 0.75),
        ("nccl", "all-gather of layer 0 parameters (forward, microbatch 0)", 0.25, 0.5),
        ("nccl", "all-gather of layer 1 parameters (forward, microbatch 0)", 0.75, 1.0),
    ]
    assert [s for s in r.spans if s.gpu == 0 and s.name == "F0"][0].end_s == pytest.approx(2.5 * MS)
    assert r.gpus[0].breakdown["optimizer"] == 0


def test_zero_infinity_moves_to_nvme_when_host_memory_is_short():
    """1 MiB of host memory, shared by two replicas, cannot take 2 x 1.75 MB of shards."""
    short = _topology(host_gib=2**-10, nvme=True)
    planned = _plan("zero-infinity", short)
    assert planned.plan.data_parallel.offload_device == "nvme"
    assert planned.result.fits and planned.simulations == 2
    on_host = _plan("zero-infinity", _topology(host_gib=2**-10))
    assert on_host.result.oom["gpu"] == "host"


def test_the_host_adam_step_runs_at_the_hosts_stated_rate():
    """ZeRO-Offload on one GPU: the CPU's Adam over 500k parameters at 1e6 parameters/s
    takes 0.5 s, at twice the rate 0.25 s (what `mpsim topo probe` measures and states as
    host.cpu_adam_gparams_per_s)."""
    def iteration_s(rate_gparams: float) -> float:
        d = topology_dict(n_gpus=2, nvlink_gbps=1.0)
        d["host"]["cpu_adam_gparams_per_s"] = rate_gparams
        return _plan("zero-offload", parse_topology(d, "tiny.yaml"), data=1).result.iteration_s

    assert iteration_s(1e-3) - iteration_s(2e-3) == pytest.approx(0.25, rel=1e-9)
