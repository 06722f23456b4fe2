"""Live intervals of saved activations, read off a simulated iteration (MPress III-D).

The live interval of layer j's saved activations on its stage is the time from the end
of j's forward to the start of j's backward for the same microbatch, averaged over the
microbatches of the run: long intervals can hide a slow swap, short ones cannot.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mpsim.sim import SimResult
from mpsim.timing.costs import LayerTimes


def live_intervals(result: SimResult, times: LayerTimes) -> dict[int, float]:
    """Seconds per layer index, from a result simulated with every tensor kept and the
    per-layer times it was simulated with."""
    starts: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    for span in result.spans:
        if span.lane == "compute" and span.name[0] in "FB":
            starts[(span.gpu, span.name[0])][int(span.name[1:])] = span.start_s
    out: dict[int, float] = {}
    for s, (a, b) in enumerate(result.stages):
        g = result.gpu_of_stage[s]
        f, bw = starts[(g, "F")], starts[(g, "B")]
        mbs = sorted(set(f) & set(bw))
        gaps = np.mean([bw[k] - f[k] for k in mbs]) if mbs else 0.0
        fwd = times.fwd_s[a:b]
        bwd = times.bwd_s[a:b]
        fwd_end = np.cumsum(fwd)
        bwd_start = np.cumsum(bwd[::-1])[::-1] - bwd  # backward of later layers runs first
        for k in range(b - a):
            out[a + k] = float(gaps + bwd_start[k] - fwd_end[k])
    return out


def end_slack(result: SimResult, schedule: str) -> list[float]:
    """Seconds per stage from its last backward to the last backward of any stage: under
    a flush (GPipe, 1F1B) later stages finish first and wait for stage 0, so work placed
    after their last backward (their optimizer states streamed in and out) hides there.
    PipeDream has no flush: no slack."""
    ends: dict[int, float] = {}
    for span in result.spans:
        if span.lane == "compute" and span.name[0] == "B":
            ends[span.gpu] = max(ends.get(span.gpu, 0.0), span.end_s)
    if schedule == "pipedream" or not ends:
        return [0.0] * len(result.stages)
    last = max(ends.values())
    return [last - ends.get(g, last) for g in result.gpu_of_stage]
