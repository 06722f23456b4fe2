"""Writes the section "Attention at long sequence" at the end of reports/kernel_time.md: what
the shipped kernel tables (mpsim/hardware/gpu_tables.py, timed by
mpsim/timing/kernel_time.py) give fused attention from 1k to 1M tokens, against the published
kernel-level figures, and what a context-parallel GPU's blocks cost.

    python benchmarks/attention_long_report.py --into reports/kernel_time.md

replaces the section (from its heading to the end of the file) or appends it;
benchmarks/kernel_time_report.py writes the rest of the file, so run it first. Without
--into the section goes to stdout. tests/test_attention_long.py holds the section's numbers
and the published figures below.

Published figures are lone-kernel benchmarks only (no end-to-end training throughput), in
TFLOP/s as the benchmarks count them (forward 4 b h s^2 d, backward 2.5 x that, half of
each under a causal mask), batch x sequence = 16k tokens and heads x head dim = 2048
(batch 1 and 16 or 32 heads at 16k):

- FlashAttention-2 (Dao 2023, arXiv 2307.08691), A100 80GB SXM4: Fig. 4 (forward plus
  backward) and Fig. 5 (forward), bar labels as published;
- FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), H100 80GB SXM5: Fig. 5
  (forward) and Fig. 6 (backward), the FlashAttention-2 bars (PyTorch's flash SDPA, the
  kernel the H100 table describes); the FlashAttention repository's H100 benchmark for
  the causal forward plus backward;
- FlashAttention-4 (Zadouri et al. 2026, arXiv 2603.05451), B200: its headline 1613
  TFLOP/s bf16 forward (the per-length bars were not found in a form we could read).

No figure goes past 16k tokens: there the tables hold the long-sequence rate.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from dataclasses import dataclass

from mpsim.data.catalog import load_topology
from mpsim.hardware.kernel_records import AttentionKernel
from mpsim.timing.costs import peak_rates
from mpsim.timing.kernel_time import KernelRates, attention_seconds

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADING = "## Attention at long sequence"
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
LONG = tuple(1024 * 2 ** i for i in range(11))
"""1k to 1M tokens."""
GPUS = {"A100": "dgx-a100-80gb", "H100": "dgx-h100", "H200": "hgx-h200-x8", "B200": "dgx-b200", "MI300X": "mi300x-x8"}
"""A shipped server of each GPU (its kernel table and bf16 peak)."""
FA2_PAPER = "FlashAttention-2 paper (arXiv 2307.08691)"
FA3_PAPER = "FlashAttention-3 paper (arXiv 2407.08608)"
FA_REPO_H100 = "FlashAttention repository, H100 benchmark (FlashAttention-2)"


@dataclass(frozen=True)
class Figure:
    """A published curve: one kernel, pass, mask and head dim at SEQS (None: not readable)."""

    gpu: str
    pass_: str
    """fwd, bwd or fwd+bwd."""
    causal: bool
    head_dim: int
    tflops: tuple[float | None, ...]
    source: str

    @property
    def plateau(self) -> float:
        """The figure at the longest measured sequence (16k)."""
        last = self.tflops[-1]
        assert last is not None
        return last


FIGURES = (
    Figure("A100", "fwd", False, 128, (221, 226, 227, 222, 224, 223), f"{FA2_PAPER} Fig. 5b"),
    Figure("A100", "fwd", False, 64, (191, 193, 193, 192, 192, 192), f"{FA2_PAPER} Fig. 5a"),
    Figure("A100", "fwd", True, 128, (132, 164, 187, 198, 200, 197), f"{FA2_PAPER} Fig. 5d"),
    Figure("A100", "fwd", True, 64, (115, 146, 167, 177, 181, 183), f"{FA2_PAPER} Fig. 5c"),
    Figure("A100", "fwd+bwd", False, 128, (None, None, 187, 196, 201, 203), f"{FA2_PAPER} Fig. 4b"),
    Figure("A100", "fwd+bwd", False, 64, (132, 162, 162, 171, 175, 176), f"{FA2_PAPER} Fig. 4a"),
    Figure("A100", "fwd+bwd", True, 128, (99, 133, 155, 173, 182, 189), f"{FA2_PAPER} Fig. 4d"),
    Figure("A100", "fwd+bwd", True, 64, (88, 119, 140, 156, 165, 171), f"{FA2_PAPER} Fig. 4c"),
    Figure("H100", "fwd", False, 128, (309, 350, 362, 368, 370, 370), f"{FA3_PAPER} Fig. 5, FlashAttention-2"),
    Figure("H100", "fwd", False, 64, (282, 306, 318, 321, 322, 324), f"{FA3_PAPER} Fig. 5, FlashAttention-2"),
    Figure("H100", "fwd", True, 128, (191, 260, 298, 319, 333, 335), f"{FA3_PAPER} Fig. 5, FlashAttention-2"),
    Figure("H100", "fwd", True, 64, (180, 229, 262, 284, 295, 299), f"{FA3_PAPER} Fig. 5, FlashAttention-2"),
    Figure("H100", "bwd", False, 128, (214, 260, 291, 310, 318, 322), f"{FA3_PAPER} Fig. 6, FlashAttention-2"),
    Figure("H100", "bwd", False, 64, (198, 238, 264, 279, 287, 291), f"{FA3_PAPER} Fig. 6, FlashAttention-2"),
    Figure("H100", "fwd+bwd", True, 128, (163, 221, 265, 294, 308, 328), FA_REPO_H100),
)
"""Published FlashAttention-2 curves (module doc)."""
BEST = {"A100": (0.73 * 312, f"{FA2_PAPER}: forward up to 73% of the A100's 312 TFLOP/s (best bar 227)"),
        "H100": (370.0, f"{FA3_PAPER}: FlashAttention-2's best forward bar (head dim 128, 8k-16k)"),
        "H200": (370.0, "as H100 (same SMs and clocks; no H200 attention figure found)"),
        "B200": (1613.0, "FlashAttention-4 paper (arXiv 2603.05451): up to 1613 TFLOP/s bf16 forward")}
"""The best published lone figure of the kernel each GPU's table describes, TFLOP/s: no
predicted rate may exceed it."""
LLAMA_HEADS = {128: (32, 8), 64: (32, 8)}
"""Heads and key/value heads of the long-sequence rows (Llama-3-8B's GQA; 32 heads of 64 too)."""


def rates(gpu: str) -> KernelRates:
    spec = load_topology(GPUS[gpu]).spec.gpu
    table = spec.kernel_table()
    assert table is not None
    peak, bandwidth = peak_rates(spec, "bf16")
    return KernelRates(table, "bf16", peak, bandwidth, 2)


def kernel(pass_: str, s_q: int, s_k: int, head_dim: int, causal: bool, batch: int = 1,
           heads: int | None = None) -> AttentionKernel:
    h, kv = LLAMA_HEADS[head_dim] if heads is None else (heads, heads)
    return AttentionKernel(backward=pass_ == "bwd", batch=batch, heads=h, kv_heads=kv, s_q=s_q, s_k=s_k,
                           head_dim=head_dim, causal=causal)


def tflops(kernels: list[AttentionKernel], r: KernelRates) -> float:
    """The kernels' FLOPs over their seconds together, TFLOP/s."""
    return sum(k.flops for k in kernels) / sum(attention_seconds(k, r) for k in kernels) / 1e12


def passes(pass_: str) -> tuple[str, ...]:
    return ("fwd", "bwd") if pass_ == "fwd+bwd" else (pass_,)


def at_benchmark(f: Figure, s: int, r: KernelRates) -> float:
    """Predicted TFLOP/s at a figure's own shape (batch x seq = 16k, heads x head dim = 2048)."""
    return tflops([kernel(p, s, s, f.head_dim, f.causal, batch=16384 // s, heads=2048 // f.head_dim)
                   for p in passes(f.pass_)], r)


def at_length(pass_: str, s: int, head_dim: int, causal: bool, r: KernelRates) -> float:
    """Predicted TFLOP/s of one sequence of ``s`` tokens (batch 1, LLAMA_HEADS)."""
    return tflops([kernel(p, s, s, head_dim, causal) for p in passes(pass_)], r)


def ring_ratio(s: int, c: int, r: KernelRates, head_dim: int = 128) -> float:
    """One GPU of a ring of ``c`` (causal load balance: one s/c causal block and c-1
    s/c x s/2c blocks without a mask), forward plus backward, over 1/c of the whole causal
    attention's time."""
    local = s // c
    ring = sum(attention_seconds(kernel(p, local, local, head_dim, True), r)
               + (c - 1) * attention_seconds(kernel(p, local, local // 2, head_dim, False), r) for p in ("fwd", "bwd"))
    whole = sum(attention_seconds(kernel(p, s, s, head_dim, True), r) for p in ("fwd", "bwd"))
    return ring / (whole / c)


def ulysses_ratio(s: int, c: int, r: KernelRates) -> float:
    """DeepSpeed-Ulysses: the whole sequence's causal attention on heads/c and kv heads/c,
    forward plus backward, over 1/c of the whole attention's time."""
    h, kv = LLAMA_HEADS[128]
    def time(heads: int, kv_heads: int) -> float:
        return sum(attention_seconds(AttentionKernel(backward=p == "bwd", batch=1, heads=heads, kv_heads=kv_heads,
                                                     s_q=s, s_k=s, head_dim=128, causal=True), r)
                   for p in ("fwd", "bwd"))
    return time(h // c, kv // c) / (time(h, kv) / c)


def _err(predicted: float, published: float) -> str:
    return f"{100 * (predicted - published) / published:+.1f}%"


def figure_rows() -> tuple[list[str], dict[str, list[float]]]:
    lines = ["| GPU | pass | mask | head dim | seq | published | predicted | error | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    errors: dict[str, list[float]] = {}
    for f in FIGURES:
        r = rates(f.gpu)
        for s, published in zip(SEQS, f.tflops, strict=True):
            if published is None or s < 1024:
                continue
            predicted = at_benchmark(f, s, r)
            errors.setdefault(f.gpu, []).append(100 * (predicted - published) / published)
            lines.append(f"| {f.gpu} | {f.pass_} | {'causal' if f.causal else 'none'} | {f.head_dim} | {s} | "
                         f"{published:g} | {predicted:.0f} | {_err(predicted, published)} | {f.source} |")
    return lines, errors


def long_rows() -> list[str]:
    """Per GPU, pass, mask and head dim: TFLOP/s from 1k to 1M tokens (batch 1, GQA), and
    the published long-sequence figure the rate holds (the unmasked one: a causal kernel's
    tail and diagonal vanish with length)."""
    cols = (1024, 4096, 16384, 65536, 262144, 1048576)
    lines = ["| GPU | pass | mask | head dim | " + " | ".join(f"{s // 1024}k" for s in cols)
             + " | published (unmasked) | 1M vs published |",
             "|---|---|---|---|" + "---|" * len(cols) + "---|---|"]
    for gpu in GPUS:
        r = rates(gpu)
        for pass_ in ("fwd", "bwd"):
            for causal in (False, True):
                for head_dim in (128, 64):
                    row = [at_length(pass_, s, head_dim, causal, r) for s in cols]
                    pub = published_plateau(gpu, pass_, head_dim)
                    cells = f"{pub:.0f} | {_err(row[-1], pub)}" if pub else "none found | -"
                    lines.append(f"| {gpu} | {pass_} | {'causal' if causal else 'none'} | {head_dim} | "
                                 + " | ".join(f"{x:.0f}" for x in row) + f" | {cells} |")
    return lines


def published_plateau(gpu: str, pass_: str, head_dim: int) -> float | None:
    """The published unmasked figure at the longest measured sequence (16k) of ``gpu``'s
    kernel, TFLOP/s: a forward or backward figure, else the backward the A100's forward and
    forward-plus-backward figures imply (5 / (7 / fwd+bwd - 2 / fwd)); None where none was
    found (H200: the H100's kernel on the same SMs and clocks, so the H100's figure)."""
    gpu = "H100" if gpu == "H200" else gpu
    if gpu == "B200":
        return BEST["B200"][0] if pass_ == "fwd" and head_dim == 128 else None
    found = {f.pass_: f.plateau for f in FIGURES if f.gpu == gpu and not f.causal and f.head_dim == head_dim}
    if pass_ in found:
        return found[pass_]
    if pass_ == "bwd" and {"fwd", "fwd+bwd"} <= found.keys():
        return 5 / (7 / found["fwd+bwd"] - 2 / found["fwd"])
    return None


def ring_rows() -> list[str]:
    lines = ["| GPU | sequence | " + " | ".join(f"ring x{c}" for c in (2, 4, 8, 16)) + " | "
             + " | ".join(f"Ulysses x{c}" for c in (2, 4, 8)) + " |", "|---|---|" + "---|" * 7]
    for gpu in GPUS:
        r = rates(gpu)
        for s in (131072, 1048576):
            lines.append(f"| {gpu} | {s // 1024}k | " + " | ".join(f"{ring_ratio(s, c, r):.3f}" for c in (2, 4, 8, 16))
                         + " | " + " | ".join(f"{ulysses_ratio(s, c, r):.3f}" for c in (2, 4, 8)) + " |")
    return lines


def block_rows() -> list[str]:
    """A ring's blocks at 32k over 8 GPUs (4k causal, 4k x 2k unmasked) against the rate at 1M."""
    lines = ["| GPU | pass | 4k causal block | 4k x 2k block | 1M causal | causal block / 1M |",
             "|---|---|---|---|---|---|"]
    for gpu in GPUS:
        r = rates(gpu)
        for pass_ in ("fwd", "bwd"):
            diag = tflops([kernel(pass_, 4096, 4096, 128, True)], r)
            half = tflops([kernel(pass_, 4096, 2048, 128, False)], r)
            full = tflops([kernel(pass_, 1048576, 1048576, 128, True)], r)
            lines.append(f"| {gpu} | {pass_} | {diag:.0f} | {half:.0f} | {full:.0f} | {diag / full:.2f} |")
    return lines


def section() -> str:
    figures, errors = figure_rows()
    rms = ", ".join(f"{g} {math.sqrt(sum(e * e for e in v) / len(v)):.1f}% ({len(v)} points)"
                    for g, v in errors.items())
    lines = [HEADING, "",
             "Made by `python benchmarks/attention_long_report.py --into reports/kernel_time.md`. Fused attention "
             "(PyTorch's flash SDPA: FlashAttention-2 on A100, H100 and H200; the B200 table carries "
             "FlashAttention-4's figure; MI300X's table has no attention figure, so its attention runs as the "
             "memory-efficient kernel at its GEMM rate, one share of peak at every length, only its waves "
             "changing) in bf16, TFLOP/s as the benchmarks count them (a causal mask does half the work). The "
             "model (`attention_seconds`): the kernel's long-sequence share of peak at head dim 128, scaled for "
             "the head dim, amortised over what one thread block visits, and under a causal mask the diagonal's "
             "tiles computed whole and the blocks' unequal work scheduled over the SMs. None of the per-length "
             "figures goes past 16k tokens: beyond, the rate holds the long-sequence share (nothing in the kernel "
             "changes with length once its blocks fill the GPU), so 1M tokens run at the published 16k unmasked "
             "rate. No table has a FlashAttention-3 backend (PyTorch's flash SDPA runs FlashAttention-2 on "
             "Hopper), so FlashAttention-3's H100 figures (648 forward, 561 backward at head dim 128) are not "
             "modelled.", "",
             "### The published curves at their own shapes", "",
             "Batch x sequence = 16k tokens, heads x head dim = 2048, 1k to 16k (the 512 points are left out: "
             "no context-parallel block is that short). Taken from these: the long-sequence shares (H100: the 16k "
             "bars; A100: the paper's \"up to 73%\" forward, its backward at the H100's backward-to-forward "
             "ratio), the head-dim ratios (the 16k bars), the half-lengths (the 512 points; the A100 backward's "
             "is the H100's). The causal rows are out of sample: their gap to the unmasked rows is the diagonal's "
             "tiles and the scheduling tail of the kernel's tiles (2 resident per SM), nothing fitted to them.", ""]
    lines += figures
    lines += ["", f"rms error per GPU: {rms}.", "",
              "### From 1k to 1M tokens", "",
              "One sequence (batch 1), 32 heads and 8 key/value heads. A causal kernel approaches the unmasked "
              "rate at long sequence: its masked diagonal tiles are 1/s of its work and its scheduling tail shrinks "
              "as its blocks outnumber the SMs; the benchmarks' causal rows sit lower because their 2048 blocks "
              "leave a tail of about a tenth (FlashAttention-2 starts the heaviest query blocks last). Published: "
              "the unmasked figure at 16k (A100 backward: the one its forward and forward-plus-backward figures "
              "imply; B200: FlashAttention-4's headline forward).", ""]
    lines += long_rows()
    lines += ["", "### Context parallelism: one GPU's blocks against 1/c of the whole", "",
              "Forward plus backward, head dim 128. Ring: one s/c causal block and c-1 blocks of s/c queries by "
              "s/2c keys without a mask (each rank holds two mirrored chunks), the FLOPs of 1/c of the whole "
              "causal attention. Ulysses: the whole sequence on heads/c. A ratio above 1 is the blocks' shorter "
              "length (and fewer heads) costing rate.", ""]
    lines += ring_rows()
    lines += ["", "### Short blocks: a ring of 8 at 32k", "", "Head dim 128, TFLOP/s.", ""]
    lines += block_rows()
    return "\n".join(lines) + "\n"


def write_into(path: pathlib.Path, text: str) -> None:
    """Replace the section in ``path`` (from its heading to the end) or append it."""
    old = path.read_text()
    at = old.find("\n" + HEADING + "\n")
    head = old if at < 0 else old[:at + 1]
    path.write_text(head.rstrip("\n") + "\n\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--into", type=pathlib.Path, help="the report to write the section into (else stdout)")
    args = parser.parse_args()
    text = section()
    if args.into is None:
        print(text, end="")
    else:
        write_into(args.into, text)


if __name__ == "__main__":
    main()
