"""Every study says what it tried (issue 45).

- ``choose --tokens`` with ``--min-servers`` above ``--max-servers``, a microbatch of 0 (a
  ZeroDivisionError) or below, answered "fits on none of the clusters searched" after 0
  configurations, or crashed: now refused in one line; a search that tries nothing says
  why (the bounds, the batch), and one that leaves candidates out says how many and why.
- Layouts beyond 1,024 data-parallel replicas: the job took 65,536, the plan file's
  ``data_parallel`` block 1,024, so the search dropped them without a word and one simulated
  alone ended in a pydantic traceback; one limit now (``mpsim.limits.MAX_REPLICAS``).
- ``best`` never tried the offload systems: on a 24 GB card it said nothing fits where
  ``zero-infinity`` fits; now they are its last resort.
- ``choose`` had no ``-j``, and no search gave a sign of life off a terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpsim.cli import main


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *says: str) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (captured.out, captured.err)
    assert captured.err.startswith("mpsim: error: ") and captured.err.count("\n") == 1, captured.err
    for text in says:
        assert text in captured.err, captured.err


TOKENS = ["choose", "--model", "bert-0.35b", "--tokens", "1e9", "--clusters", "aws-p4d"]


@pytest.mark.parametrize(("more", "says"), [
    (["--min-servers", "4", "--max-servers", "2"], ("--min-servers 4 is above --max-servers 2",)),
    (["--microbatch", "0"], ("--microbatch", "positive integer, got 0")),  # was a ZeroDivisionError
    (["--microbatch", "-2"], ("--microbatch", "positive integer, got -2")),
    (["--microbatch", "1,0"], ("--microbatch", "got 0")),
])
def test_bounds_that_leave_nothing_to_search_are_refused_in_one_line(capsys, more, says):
    _one_line_error(capsys, [*TOKENS, *more], *says)


def test_a_search_that_tries_nothing_says_why(capsys):
    # a batch of one sample (512 tokens of 512) splits over no layout of 16 GPUs
    code = main([*TOKENS, "--min-servers", "2", "--max-servers", "2", "--batch-tokens", "512", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 1
    answer = json.loads(captured.out)
    line = answer["recommendation"]
    assert "fits on none" not in line and "nothing was tried" in line
    assert "0 configuration(s) simulated on 1 server count(s) (2)" in line
    assert "do not divide the batch of 1 samples" in line
    skipped = answer["clusters"][0]["skipped"]
    assert sum(skipped.values()) > 0 and any("batch of 1 samples" in why for why in skipped)
    assert captured.err.startswith("mpsim: warning: aws-p4d: 0 configuration(s) simulated")


def test_a_search_that_left_candidates_out_counts_them_by_reason(capsys):
    from mpsim.studies.scale import scale

    report = scale("bert-0.35b", ["aws-p4d"], 1e9, max_servers=2)
    answer = report.answers[0]
    assert answer.simulated > 0 and answer.counts == (1, 2)
    assert answer.skipped and all(n > 0 for n in answer.skipped.values())
    assert f"{sum(answer.skipped.values())} left out" in answer.searched()
    assert answer.to_dict()["skipped"] == answer.skipped


def test_one_replica_limit_for_the_job_and_the_plan_file(capsys):
    from mpsim.limits import MAX_REPLICAS
    from mpsim.plans.plan import DataParallelPlan
    from mpsim.studies.scale import ClusterPoint, Shape, job_of_point, simulate_point, skip_reason

    assert DataParallelPlan.model_fields["degree"].metadata[-1].le == MAX_REPLICAS
    # 2,048 replicas of one GPU each on 256 DGX H100s: the search kept it, then lost it
    point = ClusterPoint("dgx-h100-superpod", "llama-3-8b", 256, Shape(1, 1, 1, False, 1), 2048)
    assert skip_reason(point) is None and job_of_point(point) is not None
    tried = simulate_point(point)
    assert tried.layout.startswith("ZeRO-1 x2048") and tried.iteration_s > 0
    # simulated alone it ended in a 61-line pydantic traceback
    code = main(["simulate", "--cluster", "dgx-h100-superpod", "--servers", "256", "--model", "llama-3-8b",
                 "--dp", "2048", "--zero", "1", "--microbatch", "1", "--microbatches", "1"])
    captured = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in captured.err and "validation error" not in captured.err
    assert "ZeRO-1 x2048" in captured.out.splitlines()[0]


def test_best_tries_the_offload_systems_when_nothing_else_fits():
    from mpsim.data.catalog import load_topology, load_trace
    from mpsim.planners import plan_job
    from mpsim.planners.best import FALLBACK, parts
    from mpsim.plans.job import JobSpec
    from mpsim.studies import bounds

    assert set(FALLBACK) == {"zero-offload", "zero-infinity"}
    assert parts()[-len(FALLBACK) * 2:] == [(n, p) for p in ("compute", "memory") for n in FALLBACK]  # asked last
    topo, trace = load_topology("titanrtx-x1"), load_trace("gpt-10.3b")  # a 24 GB card
    job = JobSpec(topo, trace, "1f1b", 16, strategy="best")
    assert plan_job(job.but(strategy="zero-infinity")).result.fits
    best = plan_job(job).result
    assert best.fits and best.strategy.split("(")[1].split(",")[0] in FALLBACK
    assert not bounds.floors(job).cannot_fit()  # the floors no longer rule out what best may now do
    # where something else fits, the offload systems are not asked, and best is what it was
    small = plan_job(JobSpec(topo, load_trace("gpt-5.3b"), "1f1b", 16, strategy="best")).result
    assert small.fits and not any(name in small.strategy for name in FALLBACK)


def _choose(*more: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "mpsim.cli", "choose", "--model", "gpt-5.3b", "--servers",
            "dgx1-v100,a100-40gb-nvswitch", "--strategy", "none", "--layouts", "pipeline", *more]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600,
                          env={**os.environ, **(env or {})})


def test_choose_runs_its_servers_on_workers_with_the_same_answer():
    one, two = _choose("-j", "1"), _choose("-j", "2")
    assert one.returncode == two.returncode == 0, two.stderr
    assert one.stdout == two.stdout and "dgx1-v100" in one.stdout


def test_searches_write_a_progress_line_now_and_then_in_a_log():
    # standard error is a pipe, not a terminal: no bar, but a line every MPSIM_PROGRESS_EVERY_S seconds
    quiet = _choose()
    logged = _choose(env={"MPSIM_PROGRESS_EVERY_S": "0"})
    assert quiet.returncode == logged.returncode == 0
    assert logged.stdout == quiet.stdout  # the answer unchanged
    lines = logged.stderr.splitlines()
    assert lines and all(line.startswith("mpsim: choose: ") for line in lines), logged.stderr
    assert "\x1b" not in logged.stderr  # no terminal codes in a log
    assert quiet.stderr == ""  # a short search: nothing before the first interval passes
    scaled = subprocess.run([sys.executable, "-m", "mpsim.cli", *TOKENS, "--max-servers", "1", "--json", "-"],
                            capture_output=True, text=True, check=False, timeout=600,
                            env={**os.environ, "MPSIM_PROGRESS_EVERY_S": "0"})
    assert scaled.returncode == 0 and json.loads(scaled.stdout)["clusters"][0]["simulated"] > 0
    assert any(line.startswith("mpsim: choose: ") and "x aws-p4d" in line for line in scaled.stderr.splitlines())
