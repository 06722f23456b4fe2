"""Runtime profiles (issue 46, item 3): which communication hides behind which compute, and
the host's dispatch of kernels, on hand-built timelines."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import layer, tiny_topology, tiny_trace

from mpsim.data.catalog import load_topology, load_trace
from mpsim.errors import MpsimError
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.sim import layout as layout_mod
from mpsim.sim import simulate_job
from mpsim.sim.layout import Job
from mpsim.timing.costs import cost_model
from mpsim.timing.runtime import DEFAULT_PROFILE, PROFILES, dispatch_bound, profile_named

MS = 1e-3


def _shard(flops: float):
    """Two layers of 1 ms forward and 2 ms backward, each pass with two all-reduces of
    500 kB (a ring of 2 at 1 GB/s: 1 ms a pass). The toy GPU runs GEMMs at 0.5 TFLOP/s (1
    TFLOP/s peak, matmul efficiency 0.5), so ``flops`` of forward GEMMs take flops / 5e11 s,
    the backward's twice that, each at most its pass."""
    ar = [{"op": "all-reduce", "n_bytes": 500_000}] * 2
    rows = [dict(layer(f"l{i}", 1.0, 2.0, out=4, inp=4 if i else 0, flops=flops), fwd_collectives=ar,
                 bwd_collectives=ar) for i in range(2)]
    return tiny_trace(rows)


def _run(monkeypatch, flops: float, profile: str):
    topo, shard = tiny_topology(n_gpus=2, nvlink_gbps=1.0), _shard(flops)
    monkeypatch.setattr(layout_mod, "stage_trace", lambda job, runtime: shard)
    monkeypatch.setattr("mpsim.plans.job.check_shardable", lambda *a: None)
    r = simulate_job(Job(JobSpec(topo, shard, "gpipe", 1, Parallelism(tensor=2), runtime_profile=profile)))
    nccl = sorted((round(s.start_s / MS, 9), round(s.end_s / MS, 9)) for s in r.spans if s.lane == "nccl")
    end_ms = max(s.end_s for s in r.spans if s.lane == "compute" and s.name[0] != "U") / MS
    return r, nccl, round(end_ms, 9)


def test_without_overlap_each_layer_waits_for_its_collectives(monkeypatch):
    r, nccl, end_ms = _run(monkeypatch, 1e9, DEFAULT_PROFILE)
    assert nccl == [(1.0, 2.0), (3.0, 4.0), (6.0, 7.0), (9.0, 10.0)] and end_ms == 10.0
    assert r.runtime_profile == "megatron-lm" and r.to_dict()["runtime_profile"] == "megatron-lm"


def test_an_overlapped_all_reduce_hides_entirely_behind_gemms_as_long_as_it(monkeypatch):
    """GEMMs fill each pass (1 ms forward, 2 ms backward, at least the 1 ms of collectives):
    each pass's collectives start with its GEMMs (forward [0, 1], [1, 2]; backward l1 [2, 4]
    with its collectives [2, 3], l0 [4, 6] with [4, 5]) and the stage never waits."""
    _, nccl, end_ms = _run(monkeypatch, 1e9, "megatron-core-tp-overlap")
    assert nccl == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (4.0, 5.0)]
    assert end_ms == 6.0


def test_an_overlapped_all_reduce_hides_behind_its_gemms_and_no_more(monkeypatch):
    """GEMMs of 0.4 ms forward and 0.8 ms backward: each collective starts that long before
    its pass ends, and 0.6 ms (forward) or 0.2 ms (backward) of it stays exposed:
    F l0 [0, 1] comm [0.6, 1.6]; l1 [1.6, 2.6] comm [2.2, 3.2]; B l1 [3.2, 5.2] comm
    [4.4, 5.4]; l0 [5.4, 7.4] comm [6.6, 7.6]."""
    _, nccl, end_ms = _run(monkeypatch, 2e8, "torchtitan-async-tp")
    assert nccl == [(0.6, 1.6), (2.2, 3.2), (4.4, 5.4), (6.6, 7.6)]
    assert end_ms == pytest.approx(6.0 + 2 * (1.0 - 0.4) + 2 * (1.0 - 0.8))


def test_host_dispatch_bounds_a_pass_by_its_launches():
    """max(kernel seconds, launches x host dispatch): 100 launches at 8 us = 0.8 ms."""
    eager = profile_named("eager")
    passes = np.array([0.5e-3, 2.0e-3])
    bound = dispatch_bound(passes, np.array([100, 100]), eager)
    assert bound.tolist() == pytest.approx([0.8e-3, 2.0e-3])
    assert dispatch_bound(passes, np.array([100, 100]), profile_named("megatron-lm")) is passes


def test_eager_dispatch_slows_small_work_more_than_large():
    """GPT-2 XL on one H100: the eager profile adds host time where kernels are short (a
    microbatch of 1) and none at a microbatch of 8, and the profile is named in the result."""
    topo = load_topology("h100-x1")
    small = load_trace("gpt2-xl").rescale(1)
    costs = cost_model(small, topo.spec.gpu).layer_times
    eager = dispatch_bound(costs.fwd_s, costs.launches_fwd, profile_named("eager"))
    assert (eager >= costs.fwd_s).all() and (costs.launches_fwd > 0).all()
    assert (eager > costs.fwd_s).any()  # at a microbatch of 1 some pass is bound by its launches
    large = cost_model(load_trace("gpt2-xl").rescale(8), topo.spec.gpu).layer_times
    for passes, launched in ((large.fwd_s, large.launches_fwd), (large.bwd_s, large.launches_bwd)):
        assert (dispatch_bound(passes, launched, profile_named("eager")) == passes).all()  # none at 8
    base = simulate_job(Job(JobSpec(topo, small, "gpipe", 2)))
    slow = simulate_job(Job(JobSpec(topo, small, "gpipe", 2, runtime_profile="eager")))
    assert slow.iteration_s > base.iteration_s and slow.runtime_profile == "eager"


def test_an_unknown_profile_is_refused_in_one_line():
    with pytest.raises(MpsimError, match=r"unknown runtime profile 'tachyon': use one of megatron-lm"):
        JobSpec(tiny_topology(n_gpus=1), tiny_trace([layer()]), runtime_profile="tachyon")
    assert all(p.source and p.summary for p in PROFILES.values())


def test_the_command_line_names_and_applies_the_profile(tmp_path):
    """Llama-3-8B over TP x8 on a DGX H100: with Megatron-Core's overlap the iteration is
    shorter, the text names the profile and the JSON records it; an unknown one is refused."""
    import json

    from helpers import run_cli

    args = ["simulate", "-s", "dgx-h100", "-m", "llama-3-8b", "--tp", "8", "--sp", "--microbatches", "2"]
    runs = {}
    for profile in ("megatron-lm", "megatron-core-tp-overlap"):
        out = tmp_path / f"{profile}.json"
        code, text, _ = run_cli(120, *args, "--runtime", profile, "--json", str(out))
        assert code == 0 and f"runtime       {profile}: " in text
        runs[profile] = json.loads(out.read_text())
        assert runs[profile]["runtime_profile"] == profile
    assert runs["megatron-core-tp-overlap"]["iteration_s"] < runs["megatron-lm"]["iteration_s"]
    code, _, err = run_cli(60, *args, "--runtime", "fast")
    assert code == 2 and "'fast' is not one of" in err


def test_choose_runs_every_plan_under_the_profile_and_says_so():
    """choose --runtime eager: the report names the profile in its text and JSON, and is
    slower than the default on the same server; with --tokens it is refused in one line."""
    import json

    from helpers import run_cli

    args = ["choose", "-m", "gpt2-xl", "-s", "dgx-h100", "--layouts", "pipeline", "--strategy", "none",
            "--microbatch", "1"]
    speeds = {}
    for profile in ("megatron-lm", "eager"):
        code, text, _ = run_cli(300, *args, "--runtime", profile, "--json", "-")
        report = json.loads(text)
        assert code == 0 and report["runtime_profile"] == profile
        speeds[profile] = report["rows"][0]["samples_per_s"]
    assert speeds["eager"] < speeds["megatron-lm"]
    code, _, err = run_cli(60, "choose", "-m", "llama-3-70b", "--tokens", "1e12", "--runtime", "eager")
    assert code == 2 and "--runtime and --tokens:" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_fits_runs_under_the_profile_in_this_process_and_on_workers(workers):
    """fits --runtime eager (GPT-2 XL, microbatch 1, one H100): every result, made here or
    on workers, ran under the profile, and the header names it."""
    import json

    from helpers import run_cli

    args = ["fits", "-s", "h100-x1", "-m", "gpt2-xl", "--strategy", "none", "--no-largest", "--layouts", "pipeline",
            "--microbatch", "1", "-j", workers]
    for profile in ("megatron-lm", "eager"):
        code, text, _ = run_cli(300, *args, "--runtime", profile)
        assert code == 0 and f"runtime: {profile}: " in text
        code, out, _ = run_cli(300, *args, "--runtime", profile, "--json", "-")
        rows = [row for rep in json.loads(out)["reports"] for row in rep["rows"]]
        assert code == 0 and rows and {row["runtime_profile"] for row in rows} == {profile}


def test_the_page_runs_the_job_and_choose_views_under_the_profile_asked():
    """The page's `runtime` field: it round-trips through the URL, reaches the job view's
    result and the choose view's report, and is refused in one line when unknown or in the
    how-many-servers view (which runs the default)."""
    from urllib.parse import parse_qs

    from mpsim.web.inputs import from_query
    from mpsim.web.work import RunRequest, run_choose, run_job

    query = "view=job&server=h100-x1&model=gpt2-xl&microbatch=1&microbatches=2&runtime=eager"
    inputs = from_query(parse_qs(query))
    assert inputs.runtime == "eager" and from_query(parse_qs(inputs.query())) == inputs
    assert run_job(RunRequest(inputs)).planned.result.runtime_profile == "eager"
    choose = from_query(parse_qs("view=choose&servers=h100-x1&model=gpt2-xl&strategy=none&runtime=deepspeed"))
    assert run_choose(RunRequest(choose))["report"]["runtime_profile"] == "deepspeed"
    with pytest.raises(MpsimError, match=r"^runtime: expected one of megatron-lm, .*got 'fast'$"):
        from_query(parse_qs("view=job&runtime=fast"))
    with pytest.raises(MpsimError, match="how-many-servers view runs the default runtime profile"):
        from_query(parse_qs("view=scale&runtime=eager"))
