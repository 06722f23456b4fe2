"""Per-stage memory of the shipped models against MPress Table II (GB, no memory saving).

    python benchmarks/mpress_table2.py > reports/mpress_table2.md

BERT with PipeDream (microbatch 12), GPT with DAPPLE (1f1b, microbatch 2), 8 stages on
dgx1-v100, compute-balanced partition, 16 microbatches.
"""

from __future__ import annotations

from mpsim import simulate
from mpsim.models.trace import Trace

# MPress Table II: total, per-stage max, per-stage min (GB)
TABLE_II = {
    "bert-0.35b": (108.8, 24.7, 3.7), "bert-0.64b": (227.0, 50.6, 6.4), "bert-1.67b": (345.9, 78.0, 8.8),
    "bert-4b": (578.70, 128.3, 16.3), "bert-6.2b": (1279.1, 280.6, 35.5),
    "gpt-5.3b": (164.8, 28.5, 12.7), "gpt-10.3b": (325.0, 56.4, 24.9), "gpt-15.4b": (486.7, 84.5, 37.2),
    "gpt-20.4b": (646.9, 112.4, 49.4), "gpt-25.5b": (806.2, 140.1, 61.5),
}


def setting(name: str) -> tuple[str, int]:
    """Schedule and microbatch of a Table II row (MPress IV-A: BERT on PipeDream at 12, GPT on DAPPLE at 2)."""
    return ("pipedream", 12) if name.startswith("bert") else ("1f1b", 2)


def stage_peaks(name: str, model: str | Trace | None = None) -> list[float]:
    """Per-stage peak GB of Table II's row ``name`` (``model``: another trace for it, as fit_table2.py tries)."""
    schedule, mb = setting(name)
    r = simulate("dgx1-v100", name if model is None else model, schedule, mb, 16)
    return [g.peak_bytes / 1e9 for g in r.gpus]


NOTES = """
The shapes are fitted to this table (`python benchmarks/fit_table2.py`; the paper publishes
parameter counts and memory, not layer counts or widths; traces/README.md has the method):
with the parameter count fixed, narrower and deeper keeps more activation memory per
parameter, and the fit picks the (layers, hidden, heads) whose worse error, largest stage
or total, is smallest. Every row lands within 7% on both (the traces keep CUDA's 1-byte
dropout masks and count no allocator fragmentation).

- GPT with DAPPLE (1F1B, fp16 mixed precision): one width for the family, 3840 with 30
  heads of 128, and 29 to 143 layers; within 4% on both measures.
- BERT with PipeDream (fp32, weight stashing): BERT-0.35B is BERT-Large as published;
  the others are fitted one by one with BERT's head dimension 64. BERT-6.2B needs
  159 x 1792: Table II's 6.2B keeps about 1.8 times the activation memory per parameter
  of its 4B, so it is narrower than BERT-4B (2816), not wider.
- The smallest stage is not fitted and runs up to 41% high for BERT (the last stage's
  masked-LM head over a 30522-word vocabulary at microbatch 12).
- Both orderings the paper reports hold: GPT-5.3B fits on 32 GB V100s and 10.3B does not;
  BERT-0.35B fits under PipeDream and 0.64B does not (its first stage needs 47 GB, the
  paper says 51 GB).
"""


def main() -> None:
    print("# Shipped models against MPress Table II\n")
    print("Per-stage peak memory without memory saving on `dgx1-v100` (8 stages, 16 microbatches,")
    print("compute-balanced partition). Paper numbers from MPress Table II. Regenerate with")
    print("`python benchmarks/mpress_table2.py > reports/mpress_table2.md`.\n")
    print("| model | schedule | total GB (paper / ours) | max GB (paper / ours) | min GB (paper / ours) "
          "| total error | max error |")
    print("|---|---|---|---|---|---|---|")
    for name, (total, hi, lo) in TABLE_II.items():
        schedule, _ = setting(name)
        peaks = stage_peaks(name)
        print(f"| {name} | {schedule} | {total:.1f} / {sum(peaks):.1f} | {hi:.1f} / {max(peaks):.1f} | "
              f"{lo:.1f} / {min(peaks):.1f} | {100 * (sum(peaks) / total - 1):+.0f}% | "
              f"{100 * (max(peaks) / hi - 1):+.0f}% |")
    print(NOTES, end="")


if __name__ == "__main__":
    main()
