"""The README's mixture-of-experts section quotes what the commands print (the reports
benchmarks/make_reports.sh writes), and its prose figures are those of the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme_numbers import _paragraph

from mpsim.cli import main
from mpsim.data.catalog import load_trace

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK = ("mpsim choose --model deepseek-v3 --tokens 14.8e12 --days 60 --clusters dgx-h100-superpod "
            "--min-servers 64 --max-servers 512 --batch-tokens 62914560")
README = (ROOT / "README.md").read_text()


def _quoted(command: str) -> str:
    start = README.index(f"$ {command}\n")
    return README[start:README.index("```", start)].split("\n", 1)[1]


@pytest.mark.parametrize(("command", "report"), [
    ("mpsim fits --model mixtral-8x7b --server dgx-h100", "fits_mixtral-8x7b_dgx-h100.txt"),
    ("mpsim choose --model mixtral-8x7b --tokens 1e12 --days 30 --clusters dgx-h100-superpod --max-servers 16",
     "scale_mixtral-8x7b_1T.txt"),
    ("mpsim topo collective --server dgx-h100 --op all-to-all --size 64MiB,1GiB", "alltoall_dgx-h100.txt"),
    (DEEPSEEK, "scale_deepseek-v3_14.8T.txt"),
])
def test_the_readme_blocks_are_the_reports_and_make_reports_writes_them(command: str, report: str) -> None:
    assert _quoted(command) == (ROOT / "reports" / report).read_text()
    made = (ROOT / "benchmarks" / "make_reports.sh").read_text()
    assert f"{command} > reports/{report}" in made or f"{command} -j 2 > reports/{report}" in made


def test_the_deepseek_prose_is_what_the_report_says() -> None:
    quote = " ".join(_paragraph(README, "H100s take").split())
    found = re.search(r"([\d,]+) H100s take ([\d.]+) days", quote)
    assert found
    gpus, days = found[1], found[2]
    row = next(x for x in (ROOT / "reports" / "scale_deepseek-v3_14.8T.txt").read_text().splitlines()
               if x.split()[1:2] == [gpus.replace(",", "")])
    assert f" {days} " in row
    head = _paragraph(README, "And a DeepSeek-V3-sized model")
    trace = load_trace("deepseek-v3")
    assert f"({trace.spec.params / 1e9:.0f}B parameters, {trace.active_params / 1e9:.1f}B active)" in head


def test_the_all_to_all_report_is_what_the_command_prints_now(capsys) -> None:
    assert main(["topo", "collective", "--server", "dgx-h100", "--op", "all-to-all", "--size", "64MiB,1GiB"]) == 0
    assert capsys.readouterr().out == (ROOT / "reports" / "alltoall_dgx-h100.txt").read_text()


def test_the_mixtral_prose_is_what_the_files_say() -> None:
    quote = _paragraph(README, "747 GB against the server's 640 GB")
    trace = load_trace("mixtral-8x7b")
    assert f"{round(trace.spec.params * 16 / 1e9)} GB" in quote
    fits = (ROOT / "reports" / "fits_mixtral-8x7b_dgx-h100.txt").read_text()
    rate = re.search(r"`EP x8`\) trains it at ([\d.]+) samples/s", " ".join(quote.split()))
    assert rate and f"{rate[1]}/s EP x8" in fits
    layers = re.search(r"without the host has (\d+) layers", quote)
    assert layers and f"({layers[1]} layers at the shape of mixtral-8x7b)" in fits
    head = _paragraph(README, "Can Mixtral-8x7B")
    assert f"{trace.spec.params / 1e9:.1f}B parameters, {trace.active_params / 1e9:.1f}B active" in head


def test_the_moe_validation_figure_in_the_readme_is_the_reports() -> None:
    quote = " ".join(_paragraph(README, "reports/validation_moe_cpu.md").split())
    errors = {row.split("|")[7].strip() for row in (ROOT / "reports" / "validation_moe_cpu.md").read_text().splitlines()
              if row.startswith("| EP=2")}
    worst = min(errors, key=lambda e: float(e.rstrip("%")))
    assert f"within {worst} of the prediction" in quote
