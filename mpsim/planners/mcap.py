"""mCAP (papers/mcap.txt 3): the partition whose highest per-GPU peak is lowest.

mCAP profiles two statistics per layer, mem_isolated (the peak with the layer alone on a
GPU) and mem_added (what adding it to a GPU's layers adds to the peak), and predicts a
partition's per-GPU peaks from them (listing 1.1). Here both come from the trace and the
schedule instead of profiling runs:

- mem_added(l) on stage k = weights, gradients and optimizer states of l, plus its saved
  activations times the microbatches stage k holds at once (all m under GPipe,
  min(p - k, m) under 1F1B and PipeDream), plus p - k - 1 stashed weight versions under
  PipeDream; with recomputation only the layer's checkpointed input is held per
  microbatch (mCAP 3.2); with selective recompute (Korthikanti et al. 2022, section 4.2)
  its saved activations less its attention core's kept bytes;
- mem_isolated(l) adds what l holds only while it runs: input, output, workspace and,
  recomputed, its own activations re-materialised before its backward (selective: the
  core's bytes); and the receive and send buffers at the stage's boundaries.

Because a stage's predicted peak depends only on its layer range and its position, the
best partition is found exactly by a min-max dynamic programme (``min_max_partition``),
in milliseconds, where mCAP enumerates (mCAP-BF) or samples (mCAP-BO) partitions; each
stage's peaks are worked out a block of layer ranges at a time, so memory stays linear
in the layers.
"""

from __future__ import annotations

import numpy as np

from mpsim.models.trace import RECOMPUTABLE, Trace
from mpsim.plans.partition import PeakCost, Stages, min_max_partition
from mpsim.plans.schedule import weight_versions


def held_microbatches(schedule: str, stage: int, n_stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at once (the schedule's bound)."""
    return microbatches if schedule == "gpipe" else min(n_stages - stage, microbatches)


def peak_costs(trace: Trace, schedule: str, n_stages: int, microbatches: int,
               recompute: bool = False, selective: bool = False) -> list[PeakCost]:
    """Per stage, the predicted peak of every layer range (``PeakCost``), in memory linear
    in the layers."""
    rows = trace.layers
    fixed = np.array([r.param_bytes + r.grad_bytes + r.optimizer_bytes for r in rows], dtype=float)
    params = np.array([r.param_bytes for r in rows], dtype=float)
    inp = np.array([r.input_bytes for r in rows], dtype=float)
    out = np.array([r.output_bytes for r in rows], dtype=float)
    ws = np.array([r.workspace_bytes for r in rows], dtype=float)
    act = np.array([r.act_bytes for r in rows], dtype=float)
    checkpointed = np.array([recompute and r.kind in RECOMPUTABLE for r in rows])
    own = np.array([r.own_bytes for r in rows], dtype=float)
    core = np.array([min(r.attention_core_bytes, o) if selective and r.kind == "transformer" else 0.0
                     for r, o in zip(rows, own)])
    saved = np.where(checkpointed, inp, act - core)
    transient = inp + out + ws + np.where(checkpointed, own, core)
    boundary_in = np.concatenate((inp, [0.0]))
    boundary_out = np.concatenate(([0.0], out))
    boundary_out[-1] = 0.0  # the last stage sends nothing forward
    costs = []
    for k in range(n_stages):
        held = held_microbatches(schedule, k, n_stages, microbatches)
        added = fixed + held * saved + (weight_versions(schedule, k, n_stages) - 1) * params
        costs.append(PeakCost(added, transient, boundary_in, boundary_out))
    return costs


def peak_tables(trace: Trace, schedule: str, n_stages: int, microbatches: int,
                recompute: bool = False, selective: bool = False) -> list[np.ndarray]:
    """``peak_costs`` as whole tables, peak[j, i] (quadratic memory: for small cases and checks)."""
    n = trace.n_layers
    return [c.block(0, n + 1, n + 1) for c in peak_costs(trace, schedule, n_stages, microbatches, recompute,
                                                          selective)]


def mcap_partition(trace: Trace, schedule: str, n_stages: int, microbatches: int, recompute: bool = False,
                   selective: bool = False) -> Stages:
    """The memory-balanced partition (exact for the prediction)."""
    return min_max_partition(peak_costs(trace, schedule, n_stages, microbatches, recompute, selective))
