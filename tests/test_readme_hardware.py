"""The README's 2026-hardware section quotes what the commands print, and its prose figures
are those of the simulator."""

from __future__ import annotations

import re
from pathlib import Path

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
