"""`choose --tokens`: the search over server counts and layouts, the extended iteration,
the days and cost to train, the Pareto front, and bad input refused in one line."""

from __future__ import annotations

import pytest
from helpers import layer, tiny_trace
from test_cluster import toy_cluster

from mpsim.errors import MpsimError
from mpsim.planners.registry import plan_job
from mpsim.plans.job import JobSpec, Parallelism
from mpsim.studies.scale import (
    ClusterPoint,
    ClusterTried,
    ScaleReport,
    ScaleRow,
    Shape,
    _check,
    _mark_pareto,
    recommendation,
    simulated_microbatches,
)


@pytest.mark.parametrize("par", [Parallelism(data=2, pipeline=4, zero_stage=1),
                                 Parallelism(data=8, pipeline=2, zero_stage=3, hsdp=True)])
def test_a_long_iteration_extends_along_the_line_of_two_shorter_ones(par):
    """1F1B's steady state: T(m) = T(m2) + (m - m2) (T(m2) - T(m1)) / (m2 - m1), exactly
    what simulating all m microbatches gives, and the same peak."""
    cluster = toy_cluster(4)
    trace = tiny_trace([layer(f"l{i}", fwd_ms=1.0 + i % 3, bwd_ms=2.0, params=10**6, out=10**6, inp=10**6)
                        for i in range(8)])
    m1, m2 = simulated_microbatches(4)
    m = 3 * m2

    def run(microbatches: int):
        servers = par.data * (par.pipeline or 1) // 4
        return plan_job(JobSpec(cluster.server, trace, "1f1b", microbatches, par, cluster=cluster,
                                servers=servers)).result

    full, short, long = run(m), run(m1), run(m2)
    line = long.iteration_s + (m - m2) * (long.iteration_s - short.iteration_s) / (m2 - m1)
    assert line == pytest.approx(full.iteration_s, rel=1e-9)
    assert max(g.peak_bytes for g in long.gpus) == max(g.peak_bytes for g in full.gpus)


def _row(servers: int, days: float, usd: float | None) -> ScaleRow:
    point = ClusterPoint("c", "m", servers, Shape(8, 1, 1, False, 1), 512)
    tried = ClusterTried(point, "ZeRO-1 x8", True, 1.0, 1.0, 1, 2)
    return ScaleRow("c", servers, 8 * servers, tried, 1.0, days, usd)


def test_pareto_front_keeps_rows_nobody_beats_on_both_days_and_cost():
    rows = [_row(1, 40.0, 100.0), _row(2, 20.0, 110.0), _row(4, 12.0, 130.0), _row(8, 12.0, 200.0),
            _row(16, 5.0, None)]
    _mark_pareto(rows)
    assert [r.pareto for r in rows] == [True, True, True, False, False]


def test_recommendation_picks_the_cheapest_within_the_goal():
    from mpsim.studies.scale import ClusterAnswer

    rows = [_row(4, 40.0, 100.0), _row(8, 25.0, 120.0), _row(16, 14.0, 150.0)]
    for r in rows:
        r.within = r.days <= 30
    report = ScaleReport("m", 1e12, 4 * 2**20, 8192, 30.0, None, 0.0,
                         [ClusterAnswer("c", "c", 10.0, "", rows, 3, rows[1])])
    assert recommendation(report).startswith("8 servers of c (64 GPUs), ZeRO-1 x8 with none, microbatch 1")
    assert "in 25.0 days for $120 (within 30 days)" in recommendation(report)


@pytest.mark.parametrize("args, message", [
    ((0.0, None, None, 4096, 0.0), "--tokens"),
    ((1e12, -1.0, None, 4096, 0.0), "--days"),
    ((1e12, None, 0.0, 4096, 0.0), "--budget"),
    ((1e12, None, None, 0, 0.0), "--batch-tokens"),
    ((1e12, None, None, 4096, 1.0), "--discount"),
])
def test_bad_inputs_are_refused_in_one_line(args, message):
    with pytest.raises(MpsimError) as err:
        _check(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_choose_tokens_prints_json_and_html_as_the_study_returns(capsys, tmp_path):
    from mpsim.cli import main
    from mpsim.studies.scale import scale

    html = tmp_path / "s.html"
    code = main(["choose", "-m", "bert-0.35b", "--tokens", "1e9", "--clusters", "aws-p4d", "--max-servers", "2",
                 "--json", "-", "--html", str(html)])
    out = capsys.readouterr().out
    assert code == 0
    import json

    answer = json.loads(out)
    direct = scale("bert-0.35b", ["aws-p4d"], 1e9, max_servers=2).to_dict()
    assert answer == direct
    assert [r["servers"] for r in answer["clusters"][0]["rows"]] == [1, 2]
    assert answer["recommendation"].startswith("1 server of aws-p4d (8 GPUs)")
    assert "<svg" in html.read_text() and answer["clusters"][0]["description"] in html.read_text()


def test_no_pick_names_the_goal_and_the_fastest():
    from mpsim.studies.scale import ClusterAnswer

    rows = [_row(4, 40.0, 100.0), _row(8, 35.0, 120.0)]
    report = ScaleReport("m", 1e12, 4 * 2**20, 8192, 30.0, None, 0.0, [ClusterAnswer("c", "c", 10.0, "", rows, 2)])
    assert recommendation(report) == ("no cluster trains m on 1e+12 tokens within 30 days; the fastest is 8 x c "
                                      "(ZeRO-1 x8) in 35.0 days")
