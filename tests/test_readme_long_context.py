"""The README's long-context section quotes what the commands print (the reports
benchmarks/make_reports.sh writes), and its prose figures are those of the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme_numbers import _paragraph

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EIGHT_B = "mpsim choose --model llama-3-8b --seq-len 131072 --servers dgx-h100 --global-microbatches 8"
SEVENTY_B = ("mpsim choose --model llama-3-70b --seq-len 1048576 --tokens 1e10 --days 30 --clusters "
             "dgx-h100-superpod --max-servers 64")
WITHOUT = "--layouts pipeline,ddp8,zero1x8,zero2x8,fsdp8,tp8sp,fsdp2xtp4sp,zero1x2xtp4sp,fsdp4xtp2sp"


def _quoted(command: str) -> str:
    start = README.index(f"$ {command}\n")
    return README[start:README.index("```", start)].split("\n", 1)[1]


def _made() -> str:
    return (ROOT / "benchmarks" / "make_reports.sh").read_text()


@pytest.mark.parametrize(("command", "report"), [
    (EIGHT_B, "choose_llama-3-8b_128k_dgx-h100.txt"),
    (SEVENTY_B, "scale_llama-3-70b_1M.txt"),
])
def test_the_readme_blocks_are_the_reports_and_make_reports_writes_them(command: str, report: str) -> None:
    assert _quoted(command) == (ROOT / "reports" / report).read_text()
    assert f"{command} > reports/{report}" in _made() or f"{command} -j 2 > reports/{report}" in _made()


def test_the_layout_without_context_parallelism_is_what_its_report_recommends() -> None:
    report = "choose_llama-3-8b_128k_dgx-h100_without-cp.txt"
    assert f"{EIGHT_B} {WITHOUT} > reports/{report}" in _made()
    line = next(x for x in (ROOT / "reports" / report).read_text().splitlines() if x.startswith("recommendation"))
    found = re.search(r"\(([\d.]+) samples/s, ([^,]+), plan (\w+)", line)
    assert found
    quote = " ".join(_paragraph(README, "gains little over tensor parallelism").split())
    assert f"(`{WITHOUT}`) is {found[2]} with {found[3]} at {found[1]} samples/s" in quote


def test_the_long_context_threshold_is_the_searches() -> None:
    from mpsim.plans.layouts import LONG_CONTEXT_TOKENS

    quote = " ".join(_paragraph(README, "context-parallel layouts from").split())
    assert f"from {LONG_CONTEXT_TOKENS:,} tokens on" in quote


def test_a_layer_at_128k_keeps_what_the_readme_says() -> None:
    from dataclasses import replace

    from mpsim.data.catalog import load_trace
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import shape_of

    shipped = load_trace("llama-3-8b")
    shape = shape_of(dict(shipped.spec.model))
    assert not isinstance(shape, str)
    one = trace_model(replace(shape, seq_len=131072, layers=1), 1, shipped.spec.precision.recipe, "one")
    layer = next(r for r in one.layers if r.kind == "transformer")
    quote = " ".join(_paragraph(README, "one layer of Llama-3-8B keeps").split())
    assert f"keeps {layer.act_bytes / 1e9:.1f} GB for its backward" in quote


def test_the_executor_figure_is_the_worst_rank_of_the_validation_report() -> None:
    rows = [x.split("|") for x in (ROOT / "reports" / "validation_cp_cpu.md").read_text().splitlines()
            if x.startswith("| CP=")]
    errors = [float(r[7].strip().rstrip("%")) for r in rows]
    worst = max(errors, key=abs)
    assert {r[1].strip() for r in rows} == {"CP=2", "CP=4", "CP=2 x DP=2"}
    quote = " ".join(_paragraph(README, "runs it for real on CPU").split())
    assert f"Every rank's peak is within {worst:.2f}% of the prediction" in quote
