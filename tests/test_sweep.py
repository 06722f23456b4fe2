"""Sweeps: one row per point, OOM rows, resume without redoing points, workers agree."""

import csv

import pytest
from test_cli import run

from mpsim.errors import MpsimError
from mpsim.studies.sweep import FIELDS, grid, sweep


def points(sizes):
    return grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", sizes, [16], ["none", "recompute-all"])


def test_rows_per_point_with_oom_rows(tmp_path):
    frame = sweep(points([2, 4]), tmp_path / "s.csv")
    assert len(frame) == 4
    none4 = frame[(frame.strategy == "none") & (frame.microbatch == 4)].iloc[0]
    assert str(none4.fits) == "False" and none4.oom_task and none4.samples_per_s == ""
    rec2 = frame[(frame.strategy == "recompute-all") & (frame.microbatch == 2)].iloc[0]
    assert str(rec2.fits) == "True" and float(rec2.samples_per_s) == pytest.approx(5.74, abs=0.01)


def test_an_interrupted_sweep_resumes_without_redoing_points(tmp_path):
    path = tmp_path / "s.csv"
    sweep(points([2]), path)
    seen = []
    frame = sweep(points([2, 4]), path, on_row=lambda row, resumed: seen.append((row["microbatch"], resumed)))
    assert sorted(seen) == [("2", True), ("2", True), ("4", False), ("4", False)]
    assert len(frame) == 4
    with path.open() as f:
        assert len(list(csv.DictReader(f))) == 4  # no point written twice


def test_workers_give_the_same_rows(tmp_path):
    one = sweep(points([1, 2]), tmp_path / "a.csv", workers=1).drop(columns="plan_s")
    two = sweep(points([1, 2]), tmp_path / "b.csv", workers=2).drop(columns="plan_s")
    key = ["strategy", "microbatch"]
    assert one.sort_values(key).reset_index(drop=True).equals(two.sort_values(key).reset_index(drop=True))


def test_a_foreign_csv_is_refused(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(MpsimError, match="not a sweep CSV"):
        sweep(points([1]), path)
    assert FIELDS[0] == "server"


def test_sweep_cli_table_and_bad_list(capsys, tmp_path):
    code, out, _ = run(capsys, "sweep", "--model", "gpt-5.3b", "--microbatch", "1,2", "--strategy", "none",
                       "--csv", str(tmp_path / "s.csv"), "--plot", str(tmp_path / "s.png"))
    assert code == 0 and "gpt-5.3b on dgx1-v100" in out and (tmp_path / "s.png").stat().st_size > 1000
    code, _, err = run(capsys, "sweep", "--microbatch", "1,two", "--csv", str(tmp_path / "t.csv"))
    assert code == 2 and "expected a comma-separated list of integers, got '1,two'" in err
    code, _, err = run(capsys, "sweep", "--strategy", "magic", "--csv", str(tmp_path / "t.csv"))
    assert code == 2 and "unknown strategy 'magic'" in err


def test_a_sweep_of_70_series_plots_as_small_multiples(tmp_path):
    """10 models x 7 strategies: a pair of panels per model with a line per strategy, not 70 lines in one."""
    import itertools
    import warnings

    import pandas as pd

    from mpsim.views.plots import plot_sweep

    models = [f"model-{i}" for i in range(10)]
    strategies = ["none", "recompute", "cpu-swap", "d2d", "mpress", "tsplit", "best"]
    rows = []
    for i, (md, st, mb) in enumerate(itertools.product(models, strategies, [1, 2, 4, 8])):
        fits = i % 5 != 0
        rows.append(dict(server="dgx1-v100", model=md, microbatches=16, strategy=st, microbatch=mb, fits=fits,
                         samples_per_s=float(mb) if fits else "", max_peak_gib=10.0 + mb, capacity_gib=32.0))
    frame = pd.DataFrame(rows)
    assert frame.groupby(["model", "strategy"]).ngroups == 70
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_sweep(frame, tmp_path / "s.png")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 20 and max(len(ax.get_lines()) for ax in shown) <= len(strategies) + 1
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_the_sweep_plot_names_its_server_starts_at_zero_and_keeps_the_capacity_line_in_view(tmp_path):
    """One model, two strategies with equal throughput (the second must not hide the first)
    and one 372 GiB peak on a 32 GiB GPU: it is drawn at the top with its value."""
    import pandas as pd

    from mpsim.views.plots import plot_sweep

    rows = [dict(server="dgx1-v100", model="gpt-5.3b", microbatches=16, strategy=st, microbatch=mb,
                 fits=mb < 8, samples_per_s=100.0 + mb if mb < 8 else "", max_peak_gib=372.0 if mb == 8 else 20.0,
                 capacity_gib=32.0) for st in ("none", "recompute") for mb in (1, 2, 4, 8)]
    fig = plot_sweep(pd.DataFrame(rows), tmp_path / "s.png")
    throughput, memory = (ax for ax in fig.axes if ax.get_visible())
    assert "dgx1-v100" in throughput.get_title() and "dgx1-v100" in memory.get_title()
    assert throughput.get_ylim()[0] == 0
    assert memory.get_ylim()[1] == pytest.approx(2 * 32.0 * 1.08)  # clipped at twice the capacity
    assert [t.get_text() for t in memory.texts] == ["372", "372"]
    first, second = (line for line in throughput.get_lines() if line.get_label() in ("none", "recompute"))
    assert first.get_markersize() > second.get_markersize() and first.get_marker() != second.get_marker()


def test_the_layout_axis_is_a_column_and_holds_the_global_batch(tmp_path, capsys):
    pts = grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", [1], [16], ["none"], layouts="pipeline,fsdp8")
    assert [p.layout for p in pts] == ["pp8", "fsdp8"]
    frame = sweep(pts, tmp_path / "s.csv")
    assert list(frame.layout) == ["pp8", "fsdp8"] and "layout" in FIELDS
    pp8, fsdp8 = (frame.iloc[i] for i in range(2))
    assert str(pp8.fits) == str(fsdp8.fits) == "True"
    # 16 microbatches over 8 replicas of 1 sample: 2 each, the same 16 samples per iteration
    assert float(fsdp8.samples_per_s) * float(fsdp8.iteration_s) == pytest.approx(16)
    assert float(pp8.samples_per_s) * float(pp8.iteration_s) == pytest.approx(16)
    code, out, _ = run(capsys, "sweep", "--model", "gpt-5.3b", "--microbatch", "1", "--strategy", "none",
                       "--layouts", "pp8,fsdp8", "--csv", str(tmp_path / "s.csv"))
    assert code == 0 and "none pp8" in out and "none fsdp8" in out
