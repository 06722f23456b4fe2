"""A GPU's simulated memory through the caching allocator model (mpsim.sim.reserved)."""

from __future__ import annotations

import json

import numpy as np
from helpers import run_cli

from mpsim.sim.allocator import CUBLAS_WORKSPACE_DEFAULT_BYTES, CUBLAS_WORKSPACE_LARGE_BYTES
from mpsim.sim.reserved import allocator_events, estimate
from mpsim.units import GiB, MiB


def test_rises_allocate_and_falls_free_the_same_size_first():
    used = np.array([100, 300, 200, 0])  # +100, +200, -100 (frees the first), -200
    assert allocator_events(used) == [("alloc", 0, 100), ("alloc", 1, 200), ("free", 0, 100), ("free", 1, 200)]


def test_a_fall_of_no_live_size_frees_the_latest_blocks_and_asks_again_for_the_rest():
    used = np.array([100, 300, 150])  # +100, +200, -150: frees the 200 block, asks again for 50
    assert allocator_events(used) == [("alloc", 0, 100), ("alloc", 1, 200), ("free", 1, 200), ("alloc", 2, 50)]


def test_fragmentation_keeps_reserved_above_allocated():
    """V100: two 8,519,680-byte cuBLAS workspaces split one 20 MiB segment. Six 6 MiB
    requests take two more 20 MiB segments, three each; the last one freed leaves 8 MiB free
    in the second, too little for a 10 MiB request, which gets a 10 MiB segment of its own
    (requests of 10 MiB and more are rounded to 2 MiB): 70 MiB reserved for 40 MiB."""
    used = np.array([6, 12, 18, 24, 30, 36, 30, 40]) * MiB
    e = estimate(used, 32 * GiB, 7.0)
    assert e.allocated_peak_bytes == 40 * MiB + 2 * CUBLAS_WORKSPACE_DEFAULT_BYTES
    assert e.reserved_peak_bytes == 70 * MiB
    # expandable_segments:True maps one growing segment per pool in 2 MiB pages: the 10 MiB
    # request extends the freed 6 MiB at the segment's end instead of taking a segment of its own
    assert e.expandable_peak_bytes == 60 * MiB


def test_a_gpu_at_risk_that_expandable_segments_would_save_says_so():
    from mpsim.sim.reserved import ReservedEstimate

    outside = {"cuda_context": 400 * MiB, "nccl_buffers": 0}
    e = ReservedEstimate(56 * MiB, 70 * MiB, outside, 475 * MiB, expandable_peak_bytes=60 * MiB)
    headroom_gib = 8 / 1024  # 8 MiB: 5 MiB free as reserved, 15 MiB with expandable segments
    assert e.at_risk(headroom_gib) and e.expandable_helps(headroom_gib)
    assert not e.expandable_helps(16 / 1024)  # 15 MiB is still short of 16


def test_hopper_workspaces_are_32_mib_and_the_context_counts():
    e = estimate(np.array([GiB]), 80 * GiB, 9.0)
    assert e.allocated_peak_bytes == GiB + 2 * CUBLAS_WORKSPACE_LARGE_BYTES
    assert e.total_bytes == e.reserved_peak_bytes + e.outside_bytes["cuda_context"]
    assert not e.at_risk(1.0)
    assert e.at_risk(80.0)


def test_simulate_reports_reserved_and_at_risk_with_the_headroom(tmp_path):
    out = tmp_path / "r.json"
    args = ["simulate", "--server", "dgx-a100-80gb", "--model", "llama-3-8b", "--microbatch", "1", "--microbatches",
            "8", "--json", str(out)]
    code, text, _ = run_cli(120, *args)
    assert code == 0 and "reserved GiB" in text and "at risk" not in text.split("(")[0]
    code, text, _ = run_cli(120, *args, "--headroom", "60")
    assert code == 0 and " at risk " in text
    data = json.loads(out.read_text())
    g0 = data["gpus"][0]
    assert g0["reserved"]["reserved_peak_bytes"] >= g0["peak_bytes"]
    assert g0["reserved"]["at_risk"] is True and g0["reserved"]["headroom_gib"] == 60
    code, _, err = run_cli(120, *args, "--headroom", "-1")
    assert code == 2 and "--headroom" in err
