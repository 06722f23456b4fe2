"""Plans that fit with less than the headroom to spare ("at risk"), the time band every
prediction carries, near-ties in ``choose`` and the framework line of outputs that show
activations."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_cli

from mpsim.api import load_topology, load_trace, plan
from mpsim.errors import MpsimError
from mpsim.studies.choose import Tried, _standing, choose
from mpsim.timing.costs import ESTIMATE_TIME_BAND_PCT, UNCHECKED_TIME_BAND_PCT, cost_model
from mpsim.units import GiB
from mpsim.web.inputs import JobInputs, from_query

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama_a100():
    """Llama-3-8B on the A100 80GB server, 1F1B over 8 stages: fits with room on every GPU."""
    return plan("dgx-a100-80gb", "llama-3-8b", "1f1b", 1, 8).result


def test_a_plan_closer_to_the_memory_than_the_headroom_is_at_risk_and_says_where(llama_a100):
    r = llama_a100
    assert r.fits
    assert r.at_risk(0.0) == ""
    g = next(g for g in r.gpus if g.gpu == r.gpu_of_stage[0])
    e = g.reserved()
    free_gib = e.free_bytes() / GiB
    assert 1 < free_gib < 79
    assert r.at_risk(free_gib - 0.01) == ""
    reason = r.at_risk(free_gib + 0.01) or r.at_risk(80)
    assert reason.startswith("GPU ") and "GiB reserved for" in reason and "CUDA context" in reason
    first = int(re.match(r"GPU (\d+)", r.at_risk(80))[1])  # type: ignore[index]
    assert first == r.gpu_of_stage[0]  # the first stage's GPU is the first looked at


def test_a_plan_that_does_not_fit_is_not_called_at_risk():
    r = plan("dgx1-v100", "gpt-15.4b", "1f1b", 2, 16).result
    assert not r.fits and r.at_risk(1000.0) == ""


def _tried(sps: float, fits: bool = True) -> Tried:
    return Tried(1, "s", "compute", fits, sps, 10 * GiB, 0 if fits else GiB)


class _Result:
    """What ``_standing`` asks of a result: whether it is at risk."""

    def __init__(self, name: str, risk: str) -> None:
        self.name, self.risk = name, risk

    def at_risk(self, headroom_gib: float) -> str:
        return self.risk if headroom_gib > 0 else ""


def test_choose_stands_a_safe_plan_for_the_server_over_a_faster_one_at_risk():
    fast, slow, oom = _Result("fast", "GPU 0: too close"), _Result("slow", ""), _Result("oom", "")
    tried = [(_tried(1.0), slow), (_tried(2.0), fast), (_tried(3.0, fits=False), oom)]
    assert _standing(tried, 1.0).name == "slow"  # type: ignore[arg-type,attr-defined]
    assert _standing(tried, 0.0).name == "fast"  # type: ignore[arg-type,attr-defined]
    only_risky = [(_tried(2.0), fast), (_tried(3.0, fits=False), oom)]
    assert _standing(only_risky, 1.0).name == "fast"  # type: ignore[arg-type,attr-defined]


def test_every_prediction_carries_the_time_band_of_its_model(llama_a100):
    r = llama_a100
    assert r.time_band_pct == UNCHECKED_TIME_BAND_PCT
    assert r.samples_per_s_band == pytest.approx(r.samples_per_s * UNCHECKED_TIME_BAND_PCT / 100)
    assert "kernel data of this GPU: its kernel table is within 7.5% rms" in r.time_band_source
    d = r.to_dict()
    assert d["time_band_pct"] == UNCHECKED_TIME_BAND_PCT and d["samples_per_s_band"] == r.samples_per_s_band


def test_a_checked_kernel_table_gives_its_own_residual_as_the_band():
    gpu = load_topology("h100-x1").spec.gpu
    table = gpu.kernel_table() or gpu.model_copy(update={"time_model": "kernels"}).kernel_table()
    assert table is not None
    checked = gpu.model_copy(update={"kernels": table.model_copy(update={"checked": "test records",
                                                                         "residual_pct": 4.25})})
    band, source = cost_model(load_trace("llama-3-8b"), checked).time_band()
    assert band == 4.25 and "test records" in source


def test_the_band_follows_what_the_gpus_figures_rest_on():
    """H100: its table was checked against our measured H100 layers (its residual); V100 and
    TITAN RTX: no kernel data of their own in use, so twice the measured band, and the
    source says so; MI300X: kernel data, unchecked."""
    trace = load_trace("gpt-5.3b")
    h100 = cost_model(trace, load_topology("dgx-h100").spec.gpu).time_band()
    assert h100[0] == UNCHECKED_TIME_BAND_PCT and "measured H100 layer passes" in h100[1]
    assert cost_model(trace, load_topology("mi300x-x8").spec.gpu).time_band()[0] == UNCHECKED_TIME_BAND_PCT
    for server in ("dgx1-v100", "titanrtx-x1"):
        band, source = cost_model(trace, load_topology(server).spec.gpu).time_band()
        assert band == ESTIMATE_TIME_BAND_PCT == 2 * UNCHECKED_TIME_BAND_PCT
        assert "no kernel-level data of this GPU" in source


def test_the_unchecked_band_is_the_reports_unfitted_h100_error():
    """The band's figure is the bf16 rms error that reports/kernel_time.md gives for the
    unfitted H100 kernel table (benchmarks/kernel_time_report.py writes it)."""
    text = (ROOT / "reports" / "kernel_time.md").read_text()
    first = re.search(r"Unfitted table: rms error ([\d.]+)%", text)
    assert first is not None and float(first[1]) == UNCHECKED_TIME_BAND_PCT


def test_choose_calls_servers_within_the_band_a_tie():
    """Llama-3-8B: the A100 80GB and H100 servers cost within 1% of each other per token
    (the H100 twice as fast at twice the price): a tie. The A100 40GB server against the
    DGX-1 for GPT-5.3B is 3.3x apart: no tie."""
    report = choose("llama-3-8b", ["dgx-a100-80gb", "dgx-h100"])
    assert [r.server for r in report.ties] == [report.rows[1].server]
    assert f"a tie within the time model's ±{UNCHECKED_TIME_BAND_PCT:g}% band" in report.recommendation
    assert report.to_dict()["ties"] == [report.rows[1].server]
    readme = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(r"costs USD ([\d.]+) per million tokens on 8 x A100 80GB and ([\d.]+) on 8 x H100", readme)
    by_server = {r.server: f"{r.usd_per_million_tokens:.3f}" for r in report.rows}
    assert quoted is not None and quoted.groups() == (by_server["dgx-a100-80gb"], by_server["dgx-h100"])
    apart = choose("gpt-5.3b", ["a100-40gb-nvswitch", "dgx1-v100"])
    assert apart.ties == [] and "tie" not in apart.recommendation


def test_choose_text_shows_the_band_and_the_headroom():
    code, text, _ = run_cli(300, "choose", "--model", "gpt-5.3b", "--servers", "a100-40gb-nvswitch,dgx1-v100",
                            "--headroom", "30")
    assert code == 0
    table = text.split("\n\n")[1]
    assert re.search(r"\d[\d.]* ± \d[\d.]*", table)  # three significant figures (format_rate)
    assert "at risk" in table and "--headroom 30 GiB" in text
    assert "its plan is at risk (GPU" in text


def test_fits_marks_sizes_at_risk_and_says_so_in_json(tmp_path):
    out = tmp_path / "fits.json"
    args = ["fits", "--server", "dgx-a100-80gb", "--model", "llama-3-8b", "--layouts", "pipeline", "--strategy",
            "none", "-j", "1", "--json", str(out)]
    code, text, _ = run_cli(300, *args)
    assert code == 0 and "*" not in text.split("largest")[0]
    code, text, _ = run_cli(300, *args, "--headroom", "70")
    assert code == 0
    assert re.search(r"\d\.\d\d/s\*", text) and "--headroom 70 GiB" in text and ", at risk" in text
    row = json.loads(out.read_text())["reports"][0]["rows"][0]
    assert row["at_risk"].startswith("GPU ")
    assert json.loads(out.read_text())["headroom_gib"] == 70


def test_outputs_that_show_activations_name_the_framework(tmp_path):
    out = tmp_path / "r.json"
    code, text, _ = run_cli(120, "simulate", "--server", "dgx-a100-80gb", "--model", "llama-3-8b", "--microbatches",
                            "8", "--json", str(out))
    assert code == 0 and text.splitlines()[1].startswith("layers: megatron, fused q|k|v projection")
    assert json.loads(out.read_text())["framework"] == "megatron"
    code, text, _ = run_cli(120, "simulate", "--model", "gpt-5.3b", "--microbatches", "8")
    assert code == 0 and text.splitlines()[1] == "layers: megatron"


def test_the_page_bounds_a_runs_work_and_names_each_server_once():
    with pytest.raises(MpsimError, match=r"^microbatches: at most 256 on the page, got 4096 \(the command line"):
        from_query({"microbatches": ["4096"]})
    with pytest.raises(MpsimError, match=r"^microbatch: at most 256 samples on the page, got 1000$"):
        from_query({"microbatch": ["1000"]})
    many = from_query({"view": ["choose"], "servers": [",".join(["dgx1-v100"] * 3000 + ["dgx-h100"])]})
    assert many.servers == ("dgx1-v100", "dgx-h100")
    report = choose("gpt-5.3b", ["dgx1-v100"] * 50, strategies=("none",), layouts="pipeline")
    assert [r.server for r in report.rows] == ["dgx1-v100"]


def test_the_page_takes_a_headroom_and_refuses_a_bad_one():
    inputs = from_query({"view": ["choose"], "headroom": ["2.5"], "model": ["gpt-5.3b"]})
    assert inputs.headroom == 2.5 and "headroom=2.5" in inputs.query()
    assert from_query({"headroom": ["0"]}).headroom == 0
    assert "headroom" not in JobInputs().query()
    for bad in ("-1", "2000", "1e400", "x"):
        with pytest.raises(MpsimError, match="^headroom: expected GiB from 0 to 1024"):
            from_query({"headroom": [bad]})


@pytest.mark.parametrize("workers", ["1", "2"])
def test_fits_no_largest_gives_the_same_rows_without_the_search(tmp_path, workers):
    args = ["fits", "--server", "dgx1-v100", "--model", "gpt-5.3b,gpt-10.3b", "--layouts", "pipeline", "--strategy",
            "none,recompute", "-j", workers]
    searched, quick = tmp_path / "searched.json", tmp_path / "quick.json"
    assert run_cli(600, *args, "--json", str(searched))[0] == 0
    code, text, _ = run_cli(600, *args, "--no-largest", "--json", str(quick))
    assert code == 0 and text.rstrip().endswith("largest that fits: not searched (--no-largest)")
    full, short = (json.loads(p.read_text())["reports"] for p in (searched, quick))
    assert [r["rows"] for r in short] == [r["rows"] for r in full]
    assert all(r["largest"] is None and r["layouts"][0]["searched"] is False for r in short)
    assert all(r["largest"] is not None and r["layouts"][0]["searched"] is True for r in full)
