"""Per-stage memory of the shipped models against MPress Table II (GB, no memory saving).

    python benchmarks/mpress_table2.py > reports/mpress_table2.md

BERT with PipeDream (microbatch 12), GPT with DAPPLE (1f1b, microbatch 2), 8 stages on
dgx1-v100, compute-balanced partition, 16 microbatches.
"""

from __future__ import annotations

from mpsim import simulate

# MPress Table II: total, per-stage max, per-stage min (GB)
TABLE_II = {
    "bert-0.35b": (108.8, 24.7, 3.7), "bert-0.64b": (227.0, 50.6, 6.4), "bert-1.67b": (345.9, 78.0, 8.8),
    "bert-4b": (578.70, 128.3, 16.3), "bert-6.2b": (1279.1, 280.6, 35.5),
    "gpt-5.3b": (164.8, 28.5, 12.7), "gpt-10.3b": (325.0, 56.4, 24.9), "gpt-15.4b": (486.7, 84.5, 37.2),
    "gpt-20.4b": (646.9, 112.4, 49.4), "gpt-25.5b": (806.2, 140.1, 61.5),
}


def main() -> None:
    print("| model | schedule | total GB (paper / ours) | max GB (paper / ours) | min GB (paper / ours) | max error |")
    print("|---|---|---|---|---|---|")
    for name, (total, hi, lo) in TABLE_II.items():
        schedule, mb = ("pipedream", 12) if name.startswith("bert") else ("1f1b", 2)
        r = simulate("dgx1-v100", name, schedule, mb, 16)
        peaks = [g.peak_bytes / 1e9 for g in r.gpus]
        print(f"| {name} | {schedule} | {total:.1f} / {sum(peaks):.1f} | {hi:.1f} / {max(peaks):.1f} | "
              f"{lo:.1f} / {min(peaks):.1f} | {100 * (max(peaks) / hi - 1):+.0f}% |")


if __name__ == "__main__":
    main()
