"""Today's public models on 8-GPU servers: does each fit, how fast, with which strategy.

Prints, per server, one row per shipped preset trace (mixed bf16, FlashAttention-2, the
model's training sequence length): parameters (ours and the public count), then for each
strategy the highest per-GPU peak and samples/s and tokens/s where it fits.

    python benchmarks/presets_table.py --server dgx-a100-80gb,dgx-h100 --microbatch 1
"""

from __future__ import annotations

import argparse

from mpsim import simulate
from mpsim.data.catalog import load_trace
from mpsim.errors import MpsimError

PUBLIC = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-3-8b": 8_030_261_248,
          "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512, "gpt2-xl": 1_557_611_200,
          "llama-3-70b": 70_553_706_496}
GIB = 2**30


def cell(server: str, model: str, strategy: str, microbatch: int, microbatches: int) -> str:
    try:
        r = simulate(server, model, "1f1b", microbatch, microbatches, strategy=strategy)
    except MpsimError as e:
        return f"n/a ({e})"[:24]
    peak = r.max_peak_bytes / GIB
    if not r.fits:
        return f"OOM {peak:.1f}G"
    seq = load_trace(model).spec.model.get("seq_len", 0)
    return f"{peak:.1f}G {r.samples_per_s:.2f}/s {r.samples_per_s * seq / 1e3:.1f}k tok/s"


def table(server: str, strategies: list[str], microbatch: int, microbatches: int) -> str:
    head = ["model", "params (ours)", "public"] + strategies
    rows = [head, ["---"] * len(head)]
    for model, public in PUBLIC.items():
        ours = load_trace(model).spec.params
        rows.append([model, f"{ours:,}", f"{public:,}"]
                    + [cell(server, model, s, microbatch, microbatches) for s in strategies])
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    title = (f"### {server}: 1f1b, microbatch {microbatch} x {microbatches}, mixed bf16, flash attention\n\n"
             "(each strategy: highest per-GPU peak, then samples/s and tokens/s where it fits)\n")
    return title + "\n" + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="dgx-a100-80gb,dgx-h100")
    parser.add_argument("--strategy", default="none,recompute,best")
    parser.add_argument("--microbatch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args()
    for server in args.server.split(","):
        print(table(server, args.strategy.split(","), args.microbatch, args.microbatches))


if __name__ == "__main__":
    main()
