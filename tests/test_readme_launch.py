"""The README's launch section quotes the files its commands write (benchmarks/make_reports.sh
writes them), and the configuration read back runs the iteration its comment predicts."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TOML = ROOT / "reports" / "launch" / "llama-3-8b-pick.torchtitan.toml"
SIMULATED = ROOT / "reports" / "launch" / "simulate_from_torchtitan.txt"
CHOOSE = ("mpsim choose --model llama-3-8b --emit torchtitan=reports/launch/llama-3-8b-pick.torchtitan.toml "
          "--emit megatron=reports/launch/llama-3-8b-pick.megatron.sh --servers dgx-a100-80gb,dgx-h100")
SIMULATE = "mpsim simulate --from reports/launch/llama-3-8b-pick.torchtitan.toml --model llama-3-8b --server dgx-h100"


def _block_after(line: str) -> str:
    start = README.index(line + "\n") + len(line) + 1
    return README[start:README.index("```", start)]


def test_the_readme_quotes_the_files_make_reports_writes() -> None:
    made = (ROOT / "benchmarks" / "make_reports.sh").read_text()
    assert f"{CHOOSE} > /dev/null" in made and f"{SIMULATE} > reports/launch/simulate_from_torchtitan.txt" in made
    assert _block_after("$ cat reports/launch/llama-3-8b-pick.torchtitan.toml") == TOML.read_text()
    quoted = _block_after(f"$ {SIMULATE}").split("...\n", 1)[1]
    assert quoted in SIMULATED.read_text()


def test_read_back_it_runs_the_iteration_its_comment_predicts() -> None:
    from mpsim.api import Where, simulate_from

    predicted = re.search(r"iteration ([\d.]+) s", TOML.read_text())
    printed = re.search(r"^iteration +([\d.]+) ms", SIMULATED.read_text(), re.M)
    assert predicted and printed
    result = simulate_from(TOML, None, Where("llama-3-8b", "dgx-h100"))[3]
    assert f"{result.iteration_s:.3f}" == predicted[1] and f"{result.iteration_s * 1e3:.1f}" == printed[1]
