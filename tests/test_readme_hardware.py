"""The README's 2026-hardware section quotes what the commands print, and its prose figures
are those of the simulator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme_numbers import _paragraph

from mpsim.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TINY = "mpsim simulate --server rtx4090-x1 --model tinyllama-1.1b --microbatches 8"


def _quoted(command: str) -> str:
    start = README.index(f"$ {command}\n")
    return README[start:README.index("```", start)].split("\n", 1)[1]


def test_the_rtx4090_block_is_the_report_and_what_the_command_prints(capsys) -> None:
    report = (ROOT / "reports" / "simulate_tinyllama-1.1b_rtx4090.txt").read_text()
    assert _quoted(TINY) == report
    made = (ROOT / "benchmarks" / "make_reports.sh").read_text()
    assert f"{TINY} > reports/simulate_tinyllama-1.1b_rtx4090.txt" in made
    assert main(TINY.split()[1:]) == 0
    assert capsys.readouterr().out == report


def test_the_rtx4090_prose_is_what_the_simulator_gives(tmp_path) -> None:
    import json

    quote = " ".join(_paragraph(README, "Yes, one sample a microbatch").split())
    found = re.search(r"take ([\d.]+) GiB of the card's ([\d.]+), the activations of one 2,048-token sample ([\d.]+) "
                      r"GiB; two samples a microbatch do not fit \(`--microbatch 2`: ([\d.]+) GiB\)", quote)
    assert found
    out = tmp_path / "r.json"
    assert main([*TINY.split()[1:], "--json", str(out)]) == 0
    gpu = json.loads(out.read_text())["gpus"][0]
    gib = 2**30
    states = sum(gpu["breakdown"][k] for k in ("params", "grads", "optimizer"))
    assert found[1] == f"{states / gib:.1f}" and found[2] == f"{gpu['capacity_bytes'] / gib:.1f}"
    assert found[3] == f"{gpu['breakdown']['activations'] / gib:.1f}"
    two = tmp_path / "two.json"
    assert main([*TINY.split()[1:], "--microbatch", "2", "--json", str(two)]) == 1
    assert found[4] == f"{json.loads(two.read_text())['gpus'][0]['peak_bytes'] / gib:.2f}"


CHOOSE_2026 = ("mpsim choose --model llama-3-70b --servers hgx-h200-x8,dgx-b200,gb200-nvl72,mi300x-x8 "
               "--strategy none,selective,recompute --layouts data,3d")


def _rows(report: str) -> dict[str, list[str]]:
    """A choose report's table rows by server (the cells split on runs of spaces)."""
    out = {}
    for line in report.splitlines():
        found = re.match(r"\d+\. (\S+)\s+(.*)", line)
        if found:
            out[found[1]] = re.split(r"\s{2,}", found[2].strip())
    return out


@pytest.mark.parametrize(("suffix", "report"), [("", "choose_llama-3-70b_2026_bf16.txt"),
                                                (" --recipe fp8-delayed", "choose_llama-3-70b_2026_fp8.txt")])
def test_the_2026_choose_blocks_are_the_reports(suffix: str, report: str) -> None:
    text = (ROOT / "reports" / report).read_text()
    assert _quoted(CHOOSE_2026 + suffix) == text
    assert f"{CHOOSE_2026}{suffix} > reports/{report}" in (ROOT / "benchmarks" / "make_reports.sh").read_text()


def test_the_2026_prose_is_what_the_reports_say() -> None:
    quote = " ".join(_paragraph(README, "The rack is fastest").split())
    bf16 = _rows((ROOT / "reports" / "choose_llama-3-70b_2026_bf16.txt").read_text())
    fp8 = _rows((ROOT / "reports" / "choose_llama-3-70b_2026_fp8.txt").read_text())
    found = re.search(r"\(72 GPUs: ([\d,]+) tokens/s in BF16, ([\d,]+) in FP8\); 8 x B200 is the cheapest per token "
                      r"at these prices in both \(USD ([\d.]+) and ([\d.]+) per million tokens", quote)
    assert found
    for rows in (bf16, fp8):
        fastest = max(rows, key=lambda s: float(rows[s][6].replace(",", "")))
        cheapest = min(rows, key=lambda s: float(rows[s][11]))
        assert (fastest, cheapest) == ("gb200-nvl72", "dgx-b200")
    assert (found[1], found[2]) == (bf16["gb200-nvl72"][6], fp8["gb200-nvl72"][6])
    assert (found[3], found[4]) == (bf16["dgx-b200"][11], fp8["dgx-b200"][11])
    assert bf16["hgx-h200-x8"][1] == "at risk" and bf16["hgx-h200-x8"][3] == "recompute"
