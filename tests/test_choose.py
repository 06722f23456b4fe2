"""`mpsim choose`: ranking servers by cost per sample, shortfalls, prices, and the HTML views."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from helpers import layer, topology_dict, trace_dict

from mpsim.cli import main
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.topology import parse_topology
from mpsim.models.trace import parse_trace
from mpsim.studies.choose import choose, parse_price, parse_servers
from mpsim.units import MiB

MB = 10**6


def _price(usd: float) -> dict:
    return {"on_demand": {"usd_per_hour": usd, "source": "hand-written test price", "date": "2025-01"}}


def _server(name: str, link_gbps: float, memory_mib: float, usd: float | None) -> dict:
    d = topology_dict(n_gpus=2, nvlink_gbps=link_gbps, memory_mib=memory_mib, pcie_gbps=link_gbps)
    d["name"] = name
    if usd is not None:
        d["price"] = _price(usd)
    return d


def _trace_dict() -> dict:
    """Four layers, 16 MB of parameter state and 300 MB of activations each (recomputation
    keeps the 100 MB input), 100 MB sent between stages: the link rate sets the speed."""
    rows = [layer(f"l{i}", params=MB, act=300 * MB, out=100 * MB, inp=100 * MB) for i in range(4)]
    d = trace_dict(rows)
    d["model"] = {"family": "toy", "seq_len": 128}
    return d


#: fast: NVLink 100 GB/s at USD 3/h; slow: 0.1 GB/s at USD 1/h (cheaper per hour, dearer
#: per sample); small: 64 MiB per GPU, where nothing fits.
SERVERS = {"fast": (100.0, 4096.0, 3.0), "slow": (0.1, 4096.0, 1.0), "small": (100.0, 64.0, 0.5)}


@pytest.fixture(scope="module")
def report():
    topos = [parse_topology(_server(n, *spec), f"{n}.yaml") for n, spec in SERVERS.items()]
    return choose(parse_trace(_trace_dict(), "toy.json"), topos, strategies=("none", "recompute"),
                  global_microbatches=4, layouts="pipeline")  # a pipeline: the link between its stages sets the speed


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name, spec in SERVERS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_server(name, *spec)))
        paths[name] = str(path)
    trace = tmp_path / "toy.json"
    trace.write_text(json.dumps(_trace_dict()))
    paths["trace"] = str(trace)
    return paths


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- ranking ------------------------------------------------------------------------------------

def test_the_cheaper_per_sample_wins_though_dearer_per_hour(report):
    fast, slow = report.rows[0], report.rows[1]
    assert [r.server for r in report.rows] == ["fast", "slow", "small"]
    assert fast.fits and slow.fits
    assert fast.price.usd_per_hour > slow.price.usd_per_hour
    assert fast.usd_per_million_samples < slow.usd_per_million_samples
    expected = 3.0 / (fast.samples_per_s * 3600) * 1e6
    assert fast.usd_per_million_samples == pytest.approx(expected)
    assert fast.tokens_per_s == pytest.approx(fast.samples_per_s * 128)
    assert fast.usd_per_million_tokens == pytest.approx(expected / 128)
    assert report.recommendation.startswith("fast: fastest and cheapest per million tokens")


def test_a_server_where_nothing_fits_reports_its_shortfall(report):
    small = report.rows[-1]
    assert not small.fits and small.usd_per_million_samples is None
    shortfalls = [t.shortfall_bytes for t in small.tried]
    assert small.shortfall_bytes == min(shortfalls) > 0
    assert small.shortfall_bytes == small.max_peak_bytes - 64 * MiB
    assert small.technique == "recompute"  # recomputation keeps less than keeping everything
    assert "does not fit on small" in report.recommendation


def test_ranking_by_throughput_and_the_pareto_front(report):
    fast, slow, small = report.rows
    assert fast.pareto and slow.pareto and not small.pareto  # slow is the cheapest per hour
    topos = [parse_topology(_server(n, *spec), f"{n}.yaml") for n, spec in SERVERS.items() if n != "small"]
    cheap_fast = choose(parse_trace(_trace_dict(), "toy.json"), topos, strategies=("none",), global_microbatches=4,
                        prices={"fast": 0.5}, rank_by="throughput")
    assert [r.server for r in cheap_fast.rows] == ["fast", "slow"]
    assert cheap_fast.rows[0].price.override and not cheap_fast.rows[1].pareto


def test_every_microbatch_size_is_tried(report):
    topos = [parse_topology(_server("fast", *SERVERS["fast"]), "fast.yaml")]
    r = choose(parse_trace(_trace_dict(), "toy.json"), topos, strategies=("none",), microbatch_sizes=(1, 2),
               global_microbatches=4)
    assert sorted({t.microbatch for t in r.rows[0].tried}) == [1, 2]
    assert r.rows[0].microbatch == max(r.rows[0].tried, key=lambda t: t.samples_per_s).microbatch


# -- prices ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("price", "field"), [
    ({"on_demand": {"usd_per_hour": 3.0, "date": "2025-01"}}, "price.on_demand.source"),
    ({"on_demand": {"usd_per_hour": 3.0, "source": "x"}}, "price.on_demand.date"),
    ({"on_demand": {"usd_per_hour": -3.0, "source": "x", "date": "2025"}}, "price.on_demand.usd_per_hour"),
    ({"on_demand": {"usd_per_hour": 3.0, "source": " ", "date": "2025"}}, "price.on_demand"),
    ({"on_demand": {"usd_per_hour": 3.0, "source": "x", "date": "May 2025"}}, "price.on_demand.date"),
    ({"purchase": {"usd": 0, "source": "x", "date": "2025"}}, "price.purchase.usd"),
    ({}, "price"),
])
def test_a_bad_price_block_is_one_line_naming_the_field(price, field):
    d = _server("s", 1.0, 1024.0, None)
    d["price"] = price
    with pytest.raises(SchemaError) as err:
        parse_topology(d, "s.yaml")
    assert err.value.field == field and "\n" not in str(err.value)


def test_a_bad_price_in_a_file_exits_2_with_one_line(capsys, tmp_path):
    d = _server("s", 1.0, 1024.0, None)
    d["price"] = {"on_demand": {"usd_per_hour": -1, "source": "x", "date": "2025"}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(d))
    code, _, err = run(capsys, "topo", "check", str(path))
    assert code == 2 and err.count("\n") == 1 and "price.on_demand.usd_per_hour" in err


def test_an_unquoted_yaml_date_is_kept_as_text(tmp_path):
    text = yaml.safe_dump(_server("s", 1.0, 1024.0, None)) + (
        "price:\n  on_demand: {usd_per_hour: 2.5, source: test, date: 2024-05-01}\n")
    spec = parse_topology(yaml.safe_load(text), "s.yaml").spec.price
    assert spec is not None and spec.on_demand is not None and spec.on_demand.date == "2024-05-01"


def test_shipped_8_gpu_servers_carry_dated_sourced_prices():
    from mpsim.data.catalog import load_topology

    for name in ("dgx1-v100", "a100-40gb-nvswitch", "dgx-a100-80gb", "dgx-h100"):
        price = load_topology(name).spec.price
        assert price is not None and price.on_demand is not None
        assert price.on_demand.usd_per_hour > 0 and "AWS" in price.on_demand.source and price.on_demand.date


def test_price_override_parsing():
    assert parse_price("dgx-h100=55.04") == ("dgx-h100", 55.04)
    assert parse_price(" a = 2/h") == ("a", 2.0)
    for bad in ("dgx-h100", "=3", "a=cheap", "a=nan", "a=inf", "a=0", "a=-1", "a=1e12"):
        with pytest.raises(MpsimError):
            parse_price(bad)


def test_price_override_errors_on_the_command_line(capsys, files):
    base = ["choose", "--model", files["trace"], "--servers", files["fast"], "--strategy", "none",
            "--global-microbatches", "4"]
    code, _, err = run(capsys, *base, "--price", "fast=abc")
    assert code == 2 and err.startswith("mpsim: error: --price") and err.count("\n") == 1
    code, _, err = run(capsys, *base, "--price", "nosuch=3")
    assert code == 2 and "no server 'nosuch'" in err and err.count("\n") == 1


def test_all_servers_have_a_pipeline_the_schedule_can_fill():
    names = parse_servers("all", "1f1b", 8)
    assert "dgx-h100" in names and "dgx2-v100" not in names and "h100-x1" not in names
    assert "dgx2-v100" in parse_servers("all", "gpipe", 8)
    assert parse_servers("a, b,a") == ["a", "b"]
    with pytest.raises(MpsimError):
        parse_servers("a,,b")


# -- the command ----------------------------------------------------------------------------------

def test_choose_json_structure(capsys, files):
    code, out, _ = run(capsys, "choose", "--model", files["trace"], "--servers",
                       ",".join(files[n] for n in SERVERS), "--strategy", "none,recompute",
                       "--global-microbatches", "4", "--price", "slow=2", "--json", "-")
    assert code == 0
    d = json.loads(out)
    assert {"model", "schedule", "global_microbatches", "microbatch_sizes", "strategies", "rank_by", "seq_len",
            "recommendation", "rows"} <= set(d)
    assert d["global_microbatches"] == 4  # each row's "microbatches": its layout's replicas' share
    assert [r["server"] for r in d["rows"]] == ["fast", "slow", "small"]
    first = d["rows"][0]
    assert {"rank", "fits", "microbatch", "strategy", "technique", "samples_per_s", "tokens_per_s", "peak_bytes",
            "max_peak_bytes", "shortfall_bytes", "price", "usd_per_million_samples", "usd_per_million_tokens",
            "pareto", "tried"} <= set(first)
    assert len(first["peak_bytes"]) == 2 and first["rank"] == 1
    assert d["rows"][1]["price"] == {"usd_per_hour": 2.0, "source": "--price", "date": "", "purchase_usd": None,
                                     "override": True}
    assert d["rows"][2]["fits"] is False and d["rows"][2]["shortfall_bytes"] > 0


def test_choose_exits_1_when_nothing_fits(capsys, files):
    code, out, _ = run(capsys, "choose", "--model", files["trace"], "--servers", files["small"], "--strategy", "none",
                       "--global-microbatches", "4")
    assert code == 1 and "OOM +" in out and "nothing fits" in out and "small comes closest" in out


class _Parsed(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.links += [v or "" for k, v in attrs if k in ("src", "href", "xlink:href")]

    def handle_data(self, data):
        self.text.append(data)


def _check_self_contained(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    parsed = _Parsed()
    parsed.feed(text)
    parsed.close()
    assert text.startswith("<!DOCTYPE html>") and "svg" in parsed.tags and "<script" not in text
    assert not [link for link in parsed.links if link.startswith(("http:", "https:", "//"))]
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        'xmlns:xlink="http://www.w3.org/1999/xlink"', "")
    return " ".join(parsed.text)


def test_choose_html_is_self_contained_with_the_verdict(capsys, files, tmp_path):
    page = tmp_path / "c.html"
    code, out, _ = run(capsys, "choose", "--model", files["trace"], "--servers", f"{files['fast']},{files['slow']}",
                       "--strategy", "none", "--global-microbatches", "4", "--layouts", "pp2", "--html", str(page))
    assert code == 0
    text = _check_self_contained(page)
    recommendation = out.splitlines()[-1].removeprefix("recommendation: ")
    assert recommendation in text and "1. fast" in text


def test_simulate_html_is_self_contained_with_the_verdict(capsys, files, tmp_path):
    page = tmp_path / "s.html"
    code, _, _ = run(capsys, "simulate", "--server", files["small"], "--model", files["trace"], "--microbatches", "4",
                     "--html", str(page))
    assert code == 1
    text = _check_self_contained(page)
    assert "DOES NOT FIT: toy on small" in text and "out of memory" in text
    assert "Plan: the technique on each layer" in text and "layer 0: keep" in page.read_text()


def test_html_escapes_text(files, tmp_path):
    from mpsim.views.html import table_html
    from mpsim.views.markdown import markdown_html

    assert "<b>" not in table_html(["<b>"], [["<i>x</i>"]])
    html_text = markdown_html("# a <script>\n![plot](http://example.com/x.png)\n| a |\n|---|\n| <b> |", tmp_path)
    assert "<script>" not in html_text and "example.com/x.png not found" in html_text and "&lt;b&gt;" in html_text


def test_the_count_of_microbatches_is_not_taken_for_their_sizes():
    with pytest.raises(MpsimError, match="global_microbatches is the count per iteration"):
        choose(parse_trace(_trace_dict(), "toy.json"), [], global_microbatches=[2])  # type: ignore[arg-type]


def test_the_choose_plot_keeps_server_names_apart_and_draws_the_band(tmp_path):
    """Two servers at nearly the same price and rate (the A100 40 GB and 80 GB boxes for
    Llama-3-8B): their labels do not overlap; each point has its band as an error bar."""
    from mpsim.views.plots import choose_figure

    report = choose("llama-3-8b", ["a100-40gb-nvswitch", "dgx-a100-80gb", "dgx-h100"])
    fig = choose_figure(report)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert sorted(t.get_text() for t in ax.texts) == ["a100-40gb-nvswitch", "dgx-a100-80gb", "dgx-h100"]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    bars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 3
