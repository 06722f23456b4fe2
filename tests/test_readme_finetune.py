"""The README's fine-tuning section quotes what its commands print (the reports
benchmarks/make_reports.sh writes), and its prose figures are those of the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme_numbers import _paragraph

from mpsim.models.finetune import quant_bytes_per_param

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QLORA = ("mpsim simulate --server rtx4090-x1 --model llama-3-8b --qlora --seq-len 4096 --microbatches 1 "
         "--strategy recompute-all")
LORA = ("mpsim simulate --server dgx-a100-80gb --model llama-3-70b --lora --seq-len 4096 --dp 8 --zero 3 "
        "--microbatch 1 --microbatches 2 --strategy recompute-all")
REPORTS = {QLORA: "simulate_llama-3-8b_qlora_rtx4090.txt", LORA: "simulate_llama-3-70b_lora_dgx-a100.txt"}


def _quoted(command: str) -> str:
    start = README.index(f"$ {command}\n")
    return README[start:README.index("```", start)].split("\n", 1)[1]


def _report(command: str) -> str:
    return (ROOT / "reports" / REPORTS[command]).read_text()


@pytest.mark.parametrize("command", list(REPORTS))
def test_the_readme_blocks_are_the_reports_and_make_reports_writes_them(command: str) -> None:
    assert _quoted(command) == _report(command)
    assert f"{command} > reports/{REPORTS[command]}" in (ROOT / "benchmarks" / "make_reports.sh").read_text()


def _peak_and_tokens(command: str) -> tuple[str, str]:
    text = _report(command)
    peak = re.search(r"^0 +0 +\[0, \d+\) +([\d.]+)", text, re.M)
    tokens = re.search(r"samples/s, ([\d,]+) tokens/s", text)
    assert peak and tokens and text.startswith("FITS on every GPU:")
    return peak[1], tokens[1]


def test_the_prose_figures_are_the_reports() -> None:
    peak, tokens = _peak_and_tokens(QLORA)
    quote = " ".join(_paragraph(README, "Yes, with every layer recomputed").split())
    assert f"{peak} GiB at the peak, {tokens} tokens/s" in quote
    trained = re.search(r"trainable params: ([\d,]+)", _report(QLORA))
    assert trained and f"The {trained[1]} trainable parameters" in quote
    assert f"{quant_bytes_per_param('nf4'):.3f} bytes a weight" in quote
    peak, tokens = _peak_and_tokens(LORA)
    quote = " ".join(_paragraph(README, "as FSDP over the eight GPUs").split())
    assert f"{peak} GiB a GPU, {tokens} tokens/s" in quote


def test_without_recomputation_the_70b_lora_does_not_fit() -> None:
    from mpsim import api

    topo, trace, _ = api.load_job("dgx-a100-80gb", "llama-3-70b", seq_len=4096, fine_tune=api.fine_tune_of(
        True, False, None, None))
    result = api.simulate(topo, trace, microbatch=1, microbatches=2, parallelism=api.data_parallel(8, 3, None))
    assert not result.fits
