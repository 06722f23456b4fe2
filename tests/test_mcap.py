"""mCAP memory-balanced partition: exact against brute force, prediction against simulation."""

import random

import numpy as np
import pytest

from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.planners.mcap import mcap_partition, peak_tables
from mpsim.plans.job import JobSpec
from mpsim.plans.partition import brute_force, compute_balanced, highest_peak, min_max_partition
from mpsim.sim import Job, simulate_job
from mpsim.timing.costs import cost_model


def random_tables(rng: random.Random, n: int, p: int) -> list[np.ndarray]:
    from mpsim.plans.partition import stage_peak_table

    transient = np.array([rng.randint(0, 50) for _ in range(n)], dtype=float)
    b_in = np.array([rng.randint(0, 9) for _ in range(n + 1)], dtype=float)
    b_out = np.array([rng.randint(0, 9) for _ in range(n + 1)], dtype=float)
    base = np.array([rng.randint(1, 100) for _ in range(n)], dtype=float)
    per_mb = np.array([rng.randint(0, 30) for _ in range(n)], dtype=float)
    return [stage_peak_table(base + (p - k) * per_mb, transient, b_in, b_out) for k in range(p)]


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_programme_matches_brute_force_on_random_cases(seed):
    rng = random.Random(seed)
    n, p = rng.randint(4, 12), rng.randint(2, 4)
    tables = random_tables(rng, n, p)
    stages = min_max_partition(tables)
    _, best = brute_force(tables)
    assert highest_peak(tables, stages) == best
    assert stages[0][0] == 0 and stages[-1][1] == n and all(a < b for a, b in stages)


def test_dynamic_programme_matches_brute_force_on_a_traced_model():
    """BERT-0.35B cut to 10 layers over 4 stages under PipeDream: 84 partitions, the
    mCAP-BF answer, as in the paper's 4-GPU VGG11 check."""
    trace = load_trace("bert-0.35b").with_layers(8)
    tables = peak_tables(trace, "pipedream", 4, 8)
    stages, best = brute_force(tables)
    assert trace.n_layers == 10
    assert highest_peak(tables, min_max_partition(tables)) == best


def test_prediction_matches_the_simulated_peaks_and_never_falls_short():
    topo = load_topology("dgx1-v100")
    for name, schedule, mb, recompute in [("gpt-10.3b", "1f1b", 2, False), ("bert-1.67b", "pipedream", 12, False),
                                          ("bert-4b", "pipedream", 12, True)]:
        trace = load_trace(name).rescale(mb)
        stages = mcap_partition(trace, schedule, 8, 16, recompute)
        tables = peak_tables(trace, schedule, 8, 16, recompute)
        if recompute:
            from mpsim.planners import plan_job

            result = plan_job(JobSpec(topo, trace, schedule, 16, partition="memory", strategy="recompute-all")).result
            assert [tuple(s) for s in result.stages] == stages
        else:
            result = simulate_job(Job(JobSpec(topo, trace, schedule), stages=stages))
        for k, ((a, b), g) in enumerate(zip(stages, result.gpus)):
            predicted = tables[k][b, a]
            assert g.peak_bytes * 0.995 <= predicted <= g.peak_bytes * 1.06, (name, k, predicted, g.peak_bytes)


def test_memory_balanced_lowers_the_highest_peak_of_bert_under_pipedream():
    """Compute-balanced BERT-1.67B puts 64 GiB on stage 0 (it holds 8 microbatches and 8
    weight versions); the memory-balanced partition gives it fewer layers."""
    topo = load_topology("dgx1-v100")
    trace = load_trace("bert-1.67b").rescale(12)
    times = cost_model(trace, topo.spec.gpu).layer_times
    compute = compute_balanced(times.fwd_s + times.bwd_s, 8)
    by_compute = simulate_job(Job(JobSpec(topo, trace, "pipedream"), stages=compute))
    stages = mcap_partition(trace, "pipedream", 8, 16)
    by_memory = simulate_job(Job(JobSpec(topo, trace, "pipedream"), stages=stages))
    assert by_compute.max_peak_bytes > 60 * 2**30
    assert by_memory.max_peak_bytes < 0.5 * by_compute.max_peak_bytes
    assert stages[0][1] - stages[0][0] < stages[-1][1] - stages[-1][0]


def test_too_many_stages_for_the_layers_is_refused():
    tables = random_tables(random.Random(0), 3, 4)
    with pytest.raises(MpsimError, match="cannot split 3 layers into 4"):
        min_max_partition(tables)
