"""Per-GPU kernel tables: what ``mpsim.timing.kernel_time`` needs to time a kernel from its shape.

A table gives, for one GPU model: its streaming multiprocessors (wave quantization), the
smallest time a kernel takes (launch floor), the share of memory bandwidth a streaming
kernel reaches, and per precision the share of the dense peak that GEMMs (with their
tiles) and fused attention reach. Every figure names its source in ``sources``: a public
kernel microbenchmark, a vendor document, a measurement of ours under
``validate/results/``, or "estimate" where none was found (``mpsim calibrate --profile``
fits those from a profiler trace of the real GPU).

A topology file may carry its own table (``gpu.kernels``); otherwise the shipped one for
the GPU's family is used (``kernel_table``), found from the model name.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from mpsim.datafile import FileModel

TableDtype = Literal["fp16", "bf16", "fp32", "tf32", "fp8", "fp4"]



class GemmTile(FileModel):
    """An output tile one thread block computes, and its throughput per SM relative to the
    largest tile's (smaller tiles reuse less data; cuBLAS takes them when they quantize
    better)."""

    rows: int = Field(ge=1, le=1024)
    cols: int = Field(ge=1, le=1024)
    relative: float = Field(gt=0, le=1)


class GemmRate(FileModel):
    fraction: float = Field(gt=0, le=1, description="share of the dtype's dense peak that full waves of the "
                                                     "first tile reach")
    tiles: list[GemmTile] = Field(min_length=1)


CausalBlocks = Literal["ideal", "in-order", "longest-first"]
"""How a kernel runs a causal mask's blocks (``AttentionRate.causal_blocks``)."""


class AttentionRate(FileModel):
    """A fused attention kernel's share of the dtype's peak on long sequences (head dim 128),
    and the length at which it reaches half of that (per thread block, a fixed cost is
    amortised over the blocks it visits: e(s) = fraction x s / (s + half_seq)); how the rate
    changes with the head dim, and how the kernel runs a causal mask
    (``mpsim.timing.kernel_time.attention_seconds`` puts them together). Beyond the longest
    sequence a figure was measured at, the rate holds its long-sequence fraction: nothing
    in the kernel changes with the length once its blocks fill the GPU."""

    fwd_fraction: float = Field(gt=0, le=1)
    bwd_fraction: float = Field(gt=0, le=1)
    fwd_half_seq: float = Field(ge=0, le=1e6)
    bwd_half_seq: float = Field(ge=0, le=1e6)
    block_rows: int = Field(default=128, ge=1, le=1024, description="query rows per thread block")
    fwd_by_head_dim: dict[int, float] = Field(
        default_factory=dict, description="head dim -> the forward's rate relative to its rate at head dim 128 "
                                          "(linear in log2 of the head dim between the points, held beyond them)")
    bwd_by_head_dim: dict[int, float] = Field(default_factory=dict, description="the backward's likewise")
    causal_blocks: CausalBlocks = Field(
        default="ideal", description="ideal: a causal mask costs its share of the work at the rate of the keys "
                                     "each block visits; in-order: besides, the masked tiles on the diagonal are "
                                     "computed whole and the forward's query blocks start in launch order, the "
                                     "heaviest last (FlashAttention-2), so the GPU idles half a heaviest block per "
                                     "resident block at the end; longest-first: the diagonal tiles whole, the "
                                     "heaviest blocks first (FlashAttention-4), no tail")
    ctas_per_sm: int = Field(default=1, ge=1, le=32, description="thread blocks resident on one SM (the causal "
                                                                 "forward's tail)")

    @model_validator(mode="after")
    def _head_dims(self) -> AttentionRate:
        for d, v in (*self.fwd_by_head_dim.items(), *self.bwd_by_head_dim.items()):
            if not (8 <= d <= 1024 and 0 < v <= 1.5):
                raise ValueError(f"head dim {d}: relative rate {v} (head dims 8..1024, rates in (0, 1.5])")
        return self

    def head_dim_relative(self, head_dim: int, backward: bool) -> float:
        """The rate at ``head_dim`` relative to the fractions' (head dim 128)."""
        points = sorted({**(self.bwd_by_head_dim if backward else self.fwd_by_head_dim), 128: 1.0}.items())
        if head_dim <= points[0][0]:
            return points[0][1]
        for (d0, v0), (d1, v1) in zip(points, points[1:], strict=False):
            if head_dim <= d1:
                return v0 + (v1 - v0) * math.log2(head_dim / d0) / math.log2(d1 / d0)
        return points[-1][1]


class KernelTable(FileModel):
    sms: int = Field(ge=1, le=1024, description="streaming multiprocessors")
    launch_floor_us: float = Field(ge=0, le=1e4, description="least time one kernel occupies its stream")
    memory_fraction: float = Field(gt=0, le=1, description="share of memory bandwidth a streaming kernel reaches")
    gemm: dict[TableDtype, GemmRate] = Field(min_length=1)
    attention: dict[TableDtype, AttentionRate] = Field(default_factory=dict)
    mem_efficient_relative: float = Field(
        default=0.7, gt=0, le=1, description="the memory-efficient attention kernel's rate relative to flash's")
    winograd: dict[TableDtype, float] = Field(
        default_factory=dict, description="dtypes for which cuDNN runs 3x3 stride-1 convolutions as Winograd, "
                                          "and the FLOP reduction it brings")
    sources: dict[str, str] = Field(default_factory=dict, description="figure -> where it comes from")
    checked: str | None = Field(
        default=None, description="the measurements of this GPU the table has been checked against (layer or "
                                  "kernel times under validate/results/); only then does it time layers by "
                                  "default (GpuSpec.time_model: auto)")
    residual_pct: float | None = Field(
        default=None, ge=0, le=1e4, description="rms relative error of the layer or kernel times it was checked "
                                                "against, %: the band of its predictions")
    kernel_residual_pct: float | None = Field(
        default=None, ge=0, le=1e4, description="rms relative error of the table against published kernel figures "
                                                "of its GPU (reports/kernel_time.md), %")
    basis: Literal["kernel data", "transferred"] = Field(
        default="transferred", description="kernel data: its GEMM, attention and memory figures come from "
                                           "kernel-level measurements of this GPU family (ours or published), so "
                                           "it times layers by default; transferred: taken from another GPU's, "
                                           "an estimate (opt-in with time_model: kernels)")

    @property
    def by_default(self) -> bool:
        """Whether it times layers under ``time_model: auto``: it rests on kernel data of
        its GPU, or has been checked against measurements of it."""
        return self.basis == "kernel data" or self.checked is not None

    @model_validator(mode="after")
    def _sources_named(self) -> KernelTable:
        for key in ("sms", "launch_floor_us", "memory_fraction", *(f"gemm.{d}" for d in self.gemm),
                    *(f"attention.{d}" for d in self.attention)):
            if not self.sources.get(key, "").strip():
                raise ValueError(f"sources.{key}: every figure must name its source")
        return self


# --- shipped tables ------------------------------------------------------------------------

MAMF_TABLE = "stas00/ml-engineering, Maximum Achievable Matmul FLOPS table (mamf-finder: best shape of a sweep)"
"""Published best-GEMM sweeps per GPU (the source of several tables' and ceilings' figures)."""
OUR_H100_PROBE = "validate/results/h100/probe.yaml (mpsim topo probe, H100 80GB HBM3, torch 2.11.0+cu130)"
_FA3_PAPER = ("FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) Fig. 5/6: FlashAttention-2 on H100 SXM5, "
              "head dim 128, non-causal, fwd 309/350/362/368/370/370 and bwd 214/260/291/310/318/322 TFLOP/s at "
              "seq 512..16k")
_FA2_PAPER = "FlashAttention-2 (Dao 2023, arXiv 2307.08691): on A100 forward up to 73% of peak"
_FA2_A100_FIGS = ("FlashAttention-2 paper Fig. 4 (fwd+bwd) and Fig. 5 (fwd), A100 80GB, batch x seq = 16k tokens, "
                  "hidden 2048: forward without a mask at head dim 128 221/226/227/222/224/223 TFLOP/s at seq "
                  "512..16k, at head dim 64 191..192; forward plus backward at head dim 128 203 and at 64 176 at 16k "
                  "(the backward they imply: 196 and 170)")
_FA3_CAUSAL = ("FlashAttention-3 paper Fig. 5/6, FlashAttention-2 on H100 SXM5: head dim 64 forward 324 and backward "
               "291 TFLOP/s at 16k (head dim 128: 370, 322); causal forward 191/260/298/319/333/335 at head dim 128, "
               "180..299 at 64")
_CAUSAL_FA2 = ("causal: FlashAttention-2 computes the masked diagonal tiles whole and launches its forward's query "
               "blocks in order, heaviest last; 2 resident blocks per SM (128 x 64 tiles at head dim 128) give the "
               "published causal forward's 0.88-0.95 of the unmasked rate at 2k-16k with no fitted parameter")
_FA3_HEAD_DIMS = ("FlashAttention-3 paper Fig. 5/6, FlashAttention-3 on H100 SXM5 at 16k: forward 497 at head dim 64 "
                  "of 648 at 128, backward 474 of 561")
_TILE_ESTIMATE = ("tile set: the CTA tiles cuBLAS kernel names carry (e.g. sm90 ..._tilesize128x256x64, ampere "
                  "..._256x128); relative throughput of smaller tiles is an estimate")
_FLOOR = "estimate: a few microseconds per eager kernel launch (launch plus dependency gap); fit with calibrate"
_HOPPER_TILES = [GemmTile(rows=128, cols=256, relative=1.0), GemmTile(rows=128, cols=128, relative=0.9),
                 GemmTile(rows=64, cols=128, relative=0.75), GemmTile(rows=64, cols=64, relative=0.5)]
_TC_TILES = [GemmTile(rows=256, cols=128, relative=1.0), GemmTile(rows=128, cols=128, relative=0.92),
             GemmTile(rows=128, cols=64, relative=0.8), GemmTile(rows=64, cols=64, relative=0.55)]
_SIMT_TILES = [GemmTile(rows=128, cols=128, relative=1.0), GemmTile(rows=128, cols=64, relative=0.9),
               GemmTile(rows=64, cols=64, relative=0.7), GemmTile(rows=32, cols=32, relative=0.35)]
# H100 probe: 8192^3 GEMMs, 128x256 tiles: 64 x 32 = 2048 tiles over 132 SMs = 16 waves for 15.52 of work,
# so the full-wave fraction is the measured one x 16/15.52.
_H100_WAVES = 16 / (2048 / 132)


def _share(x: float) -> float:
    """A share of peak to three places, rounded down (a table never above its measurement)."""
    return math.floor(x * 1000) / 1000

_FP32_SIMT = 51.35 / 67.0 * (32 / (4096 / 132))  # H100 fp32 probe, 128x128 tiles: 4096 tiles, 32 waves
A100_KERNEL_RMS_PCT = 7.5
"""The A100 table's rms error against the published A100 kernel figures (GEMM sweeps,
FlashAttention-2 forward plus backward, streaming; reports/kernel_time.md)."""
H100_LAYER_RMS_PCT = 12.6
"""The unfitted H100 table's rms error on our measured H100 transformer-layer and head passes
(bf16; reports/kernel_time.md, which benchmarks/kernel_time_report.py writes)."""
_H100_LAYERS = ("our measured H100 layer passes (validate/results/h100/trace_bf16*.json; bf16 rms error of the "
                "unfitted table over the transformer-layer and head passes, reports/kernel_time.md)")
_FLASH_H100 = AttentionRate(fwd_fraction=0.374, bwd_fraction=0.326, fwd_half_seq=100.0, bwd_half_seq=260.0,
                            fwd_by_head_dim={64: round(324 / 370, 3)}, bwd_by_head_dim={64: round(291 / 322, 3)},
                            causal_blocks="in-order", ctas_per_sm=2)


def _hopper(sms: int) -> KernelTable:
    return KernelTable(
        sms=sms, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(769.0 / 989 * _H100_WAVES), tiles=_HOPPER_TILES),
              "fp16": GemmRate(fraction=_share(746.6 / 989 * _H100_WAVES), tiles=_HOPPER_TILES),
              "tf32": GemmRate(fraction=_share(769.0 / 989 * _H100_WAVES), tiles=_HOPPER_TILES),
              "fp8": GemmRate(fraction=_share(1402.6 / 1979), tiles=_HOPPER_TILES),
              "fp32": GemmRate(fraction=round(_FP32_SIMT, 3), tiles=_SIMT_TILES)},
        attention={"bf16": _FLASH_H100, "fp16": _FLASH_H100}, basis="kernel data",
        checked=_H100_LAYERS, residual_pct=H100_LAYER_RMS_PCT,
        sources={"sms": "NVIDIA H100 Tensor Core GPU Architecture whitepaper (132 SMs SXM5; 114 PCIe)",
                 "launch_floor_us": _FLOOR,
                 "memory_fraction": f"device-to-device copy 2711.3 GB/s of 3350 GB/s: {OUR_H100_PROBE}",
                 "gemm.bf16": f"8192^3 bf16 matmul 769.0 TFLOP/s: {OUR_H100_PROBE}; {_TILE_ESTIMATE}",
                 "gemm.fp16": f"8192^3 fp16 matmul 746.6 TFLOP/s: {OUR_H100_PROBE}",
                 "gemm.tf32": "estimate: taken as bf16's share of its own peak",
                 "gemm.fp8": f"{MAMF_TABLE}: H100 SXM fp8 1402.6 of 1979 TFLOP/s (so a full-wave fraction at most "
                             "that)",
                 "gemm.fp32": f"8192^3 fp32 (no TF32) matmul 51.35 TFLOP/s: {OUR_H100_PROBE}",
                 "attention.bf16": f"{_FA3_PAPER}; half_seq fitted to the 512 points; head dims and causal: "
                                   f"{_FA3_CAUSAL}; {_CAUSAL_FA2}",
                 "attention.fp16": "as bf16"})


_FLASH_A100 = AttentionRate(fwd_fraction=0.73, bwd_fraction=round(0.73 * 322 / 370, 3), fwd_half_seq=16.0,
                            bwd_half_seq=260.0, fwd_by_head_dim={64: round(192 / 223, 3)},
                            bwd_by_head_dim={64: round(170 / 196, 3)}, causal_blocks="in-order", ctas_per_sm=2)
_A100_SOURCES = {
    "sms": "NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs)",
    "launch_floor_us": _FLOOR,
    "memory_fraction": "transferred from our H100 copy probe (0.81 of peak); " + OUR_H100_PROBE,
    "gemm.fp16": "mli/transformers-benchmarks micro_bench (2022): torch.matmul fp16 230 of 312 TFLOP/s on A100 "
                 "80GB; " + _TILE_ESTIMATE,
    "gemm.bf16": "as fp16 (same tensor-core rate)",
    "gemm.tf32": "mli/transformers-benchmarks micro_bench: TF32 116 of 156 TFLOP/s",
    "gemm.fp32": "transferred from our H100 fp32 probe (CUDA-core SGEMM share of peak)",
    "attention.fp16": f"{_FA2_PAPER}; backward x 322/370 as FlashAttention-2 on H100 (FA3 paper: 198 TFLOP/s, "
                      f"within 1% of the 196 the A100's own figures imply) and its half_seq; forward half_seq "
                      f"fitted to the 512 point and head dim 64 from {_FA2_A100_FIGS}; {_CAUSAL_FA2}",
    "attention.bf16": "as fp16",
}


def _ampere() -> KernelTable:
    tc = GemmRate(fraction=round(230 / 312, 3), tiles=_TC_TILES)
    return KernelTable(
        sms=108, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"fp16": tc, "bf16": tc, "tf32": GemmRate(fraction=round(116 / 156, 3), tiles=_TC_TILES),
              "fp32": GemmRate(fraction=round(_FP32_SIMT, 3), tiles=_SIMT_TILES)},
        attention={"fp16": _FLASH_A100, "bf16": _FLASH_A100}, sources=_A100_SOURCES, basis="kernel data",
        kernel_residual_pct=A100_KERNEL_RMS_PCT)


def _older(sms: int, name: str, tensor_cores: bool) -> KernelTable:
    """Volta (V100), Turing (TITAN RTX), Pascal (GTX 1080 Ti): no kernel-level figure of
    ours; the shares of peak are transferred and say so."""
    gemm: dict[TableDtype, GemmRate] = {"fp32": GemmRate(fraction=round(_FP32_SIMT, 3), tiles=_SIMT_TILES)}
    sources = {"sms": f"NVIDIA {name} datasheet/whitepaper ({sms} SMs)", "launch_floor_us": _FLOOR,
               "memory_fraction": "transferred from our H100 copy probe (0.81 of peak); " + OUR_H100_PROBE,
               "gemm.fp32": "transferred from our H100 fp32 probe (CUDA-core SGEMM share of peak)"}
    attention: dict[TableDtype, AttentionRate] = {}
    if tensor_cores:
        gemm["fp16"] = GemmRate(fraction=round(230 / 312, 3), tiles=_TC_TILES)
        sources["gemm.fp16"] = "transferred from the A100 fp16 micro_bench share (230 of 312 TFLOP/s)"
    return KernelTable(sms=sms, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3), gemm=gemm,
                       attention=attention, winograd={"fp32": 2.25}, sources={
                           **sources, "winograd": "cuDNN's Winograd F(2x2,3x3) (Lavin and Gray 2016): 16 "
                                                  "multiplies for 4 outputs instead of 36, 2.25x fewer FLOPs"})


_MEMORY_TRANSFER = ("transferred from our H100 copy probe (0.809 of peak; " + OUR_H100_PROBE + "): no streaming "
                    "benchmark of this GPU used")


_FLASH_B200 = AttentionRate(fwd_fraction=round(1613 / 2250, 3), bwd_fraction=round(1613 / 2250 * 322 / 370, 3),
                            fwd_half_seq=100.0, bwd_half_seq=260.0, fwd_by_head_dim={64: round(497 / 648, 3)},
                            bwd_by_head_dim={64: round(474 / 561, 3)}, causal_blocks="longest-first")
_FA4_REST = ("; head dim 64 as FlashAttention-3's ratios on H100 (estimate: no FlashAttention-4 head-dim sweep "
             f"found; {_FA3_HEAD_DIMS}); causal: FlashAttention-4 schedules causal tiles longest-processing-time "
             "first (its paper's scheduling for causal and varlen work), the diagonal tiles computed whole")


def _blackwell() -> KernelTable:
    """GB200's B200 GPUs: GEMM shares from the MAMF table (per GB200 GPU, against its 2,500
    TFLOP/s bf16 peak), attention from FlashAttention-4's B200 figure."""
    flash = _FLASH_B200
    return KernelTable(
        sms=148, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(1822 / 2500), tiles=_HOPPER_TILES),
              "fp16": GemmRate(fraction=_share(1822 / 2500), tiles=_HOPPER_TILES),
              "fp8": GemmRate(fraction=_share(3615.6 / 5000), tiles=_HOPPER_TILES)},
        attention={"bf16": flash, "fp16": flash}, basis="kernel data",
        sources={"sms": "NVIDIA Blackwell architecture: 148 SMs per B200 (74 per die)",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{MAMF_TABLE}: GB200 bf16 1822 of 2500 TFLOP/s; {_TILE_ESTIMATE}",
                 "gemm.fp16": "as bf16 (same tensor-core rate)",
                 "gemm.fp8": f"{MAMF_TABLE}: GB200 fp8 3615.6 of 5000 TFLOP/s",
                 "attention.bf16": "FlashAttention-4 (arXiv 2603.05451): 1613 TFLOP/s bf16 forward on B200, 71.7% "
                                   "of 2250; backward x 322/370 and half_seq as FlashAttention-2 on H100 (estimate)"
                                   + _FA4_REST,
                 "attention.fp16": "as bf16"})


def _cdna3() -> KernelTable:
    """MI300X: GEMM shares from the MAMF table (PyTorch, hipBLASLt); no fused attention
    figure, so attention runs as the memory-efficient kernel at the GEMM rate."""
    return KernelTable(
        sms=304, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(668.4 / 1307.4), tiles=_HOPPER_TILES),
              "fp16": GemmRate(fraction=_share(654 / 1307.4), tiles=_HOPPER_TILES),
              "fp8": GemmRate(fraction=_share(1273 / 2614.9), tiles=_HOPPER_TILES)},
        basis="kernel data",
        sources={"sms": "AMD CDNA 3 white paper: 304 compute units on MI300X",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{MAMF_TABLE}: MI300X bf16 668.4 TFLOP/s with PyTorch (of 1307.4); {_TILE_ESTIMATE}",
                 "gemm.fp16": "AMD ROCm blog (2025-02-28): MI300X fp16 GEMM 654 TFLOP/s",
                 "gemm.fp8": "AMD ROCm blog (2025-02-28): MI300X fp8 GEMM 1273 TFLOP/s"})


def _blackwell_ultra() -> KernelTable:
    """B300 and GB300 (Blackwell Ultra): GEMM shares from the MAMF table's B300 rows (against
    B300's 2,250 bf16 / 4,500 fp8 TFLOP/s dense peaks); GB300 has no published sweep and
    takes these shares of its own peak. Attention: FlashAttention-4's B200 figure (no B300
    attention benchmark found; Blackwell Ultra doubles the exponential units, so this is low)."""
    flash = _FLASH_B200
    return KernelTable(
        sms=148, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(1769.0 / 2250), tiles=_HOPPER_TILES),
              "fp16": GemmRate(fraction=_share(1769.0 / 2250), tiles=_HOPPER_TILES),
              "fp8": GemmRate(fraction=_share(3353.3 / 4500), tiles=_HOPPER_TILES)},
        attention={"bf16": flash, "fp16": flash}, basis="kernel data",
        sources={"sms": f"{MAMF_TABLE}, notes: B300 ships as 148- and 152-SM SKUs (148 taken); GB300 assumed the "
                        "same",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{MAMF_TABLE}: B300 bf16 1769.0 of 2250 TFLOP/s (torch 2.9.1+cu130); {_TILE_ESTIMATE}",
                 "gemm.fp16": "as bf16 (same tensor-core rate)",
                 "gemm.fp8": f"{MAMF_TABLE}: B300 fp8 3353.3 of 4500 TFLOP/s (torch 2.9.1+cu130)",
                 "attention.bf16": "transferred from B200: FlashAttention-4 (arXiv 2603.05451), 1613 TFLOP/s bf16 "
                                   "forward on B200, 71.7% of 2250; backward x 322/370 and half_seq as "
                                   "FlashAttention-2 on H100 (estimate)" + _FA4_REST,
                 "attention.fp16": "as bf16"})


_TORCH_PERF_DB = "zzc0721/torch-performance-test-data (community torch.matmul sweep, square n 1024..10240)"
_ADA_TILES = _TC_TILES
_RTX4090 = (f"{_TORCH_PERF_DB}, issue #78 (2025-10-17, RTX 4090, torch 2.7.0+cu128): at n=8192 bf16 160.17, fp16 "
            "155.50, fp32 53.41 TFLOP/s; best bf16 164.81 (n=2048), fp16 168.38 (n=4096)")


def _ada(sms: int, name: str, transferred: bool) -> KernelTable:
    """Ada (AD102): the RTX 4090's GEMM shares of its datasheet peaks (165.2 bf16/fp16 with
    FP32 accumulate, 82.6 fp32), from a community torch.matmul sweep at n=8192 (16 full
    waves of 128x256 tiles on 128 SMs). No fused-attention or streaming figure of an Ada GPU
    was found. The L40S (same die, 350 W, 142 SMs) has no GEMM sweep: it transfers these
    shares and says so (``basis: transferred``)."""
    prefix = "transferred from the RTX 4090 (same AD102 die at 450 W; the L40S's 350 W may hold lower clocks): " \
        if transferred else ""
    return KernelTable(
        sms=sms, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(160.17 / 165.2), tiles=_ADA_TILES),
              "fp16": GemmRate(fraction=_share(155.50 / 165.2), tiles=_ADA_TILES),
              "fp32": GemmRate(fraction=_share(53.41 / 82.6), tiles=_SIMT_TILES)},
        basis="transferred" if transferred else "kernel data",
        sources={"sms": f"NVIDIA Ada Lovelace architecture whitepaper: {name}",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{prefix}{_RTX4090}; {_TILE_ESTIMATE}",
                 "gemm.fp16": f"{prefix}{_RTX4090}",
                 "gemm.fp32": f"{prefix}{_RTX4090}"})


_RTX5090 = (f"{_TORCH_PERF_DB}, issue #96 (2025-12-16, RTX 5090, torch 2.7.0+cu128): bf16 240.05, fp16 234.63 "
            "(n=10240), fp32 70.47 (n=2048) TFLOP/s")


def _blackwell_geforce() -> KernelTable:
    """RTX 5090 (GB202, sm_120): GEMM shares of its dense peaks (419.2 bf16/fp16: the sweep's
    240 TFLOP/s rules out the half-rate FP32 accumulate of GeForce Ada), from a community
    torch.matmul sweep; no attention or streaming figure found."""
    return KernelTable(
        sms=170, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(240.05 / 419.2), tiles=_TC_TILES),
              "fp16": GemmRate(fraction=_share(234.63 / 419.2), tiles=_TC_TILES),
              "fp32": GemmRate(fraction=_share(70.47 / 104.8), tiles=_SIMT_TILES)},
        basis="kernel data",
        sources={"sms": "NVIDIA RTX Blackwell GPU architecture: 170 SMs on the RTX 5090",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{_RTX5090}; {_TILE_ESTIMATE}",
                 "gemm.fp16": _RTX5090, "gemm.fp32": _RTX5090})


_AMD_MAF = "AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (2025-02-28, hipBLASLt, ROCm 6.3)"


def _mi325x() -> KernelTable:
    """MI325X (CDNA 3 at 1,000 W, 6 TB/s): GEMM shares from its own sweeps, above MI300X's."""
    return KernelTable(
        sms=304, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": GemmRate(fraction=_share(784.9 / 1307.4), tiles=_HOPPER_TILES),
              "fp16": GemmRate(fraction=_share(794 / 1307.4), tiles=_HOPPER_TILES),
              "fp8": GemmRate(fraction=_share(1519 / 2614.9), tiles=_HOPPER_TILES)},
        basis="kernel data",
        sources={"sms": "AMD CDNA 3 white paper: 304 compute units (MI325X: the MI300X's compute)",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{MAMF_TABLE}: MI325X bf16 784.9 TFLOP/s with PyTorch and TunableOp (of 1307.4; "
                              f"hipBLASLt alone 843, {_AMD_MAF}); {_TILE_ESTIMATE}",
                 "gemm.fp16": f"{_AMD_MAF}: MI325X fp16 GEMM 794 TFLOP/s",
                 "gemm.fp8": f"{_AMD_MAF}: MI325X fp8 GEMM 1519 TFLOP/s"})


def _cdna4() -> KernelTable:
    """MI355X (CDNA 4, 256 CUs): bf16 GEMM share from the MAMF table against the 2,516.6
    TFLOP/s dense peak (256 CUs x 4,096 bf16 FLOP/clock x 2.4 GHz); fp16 as bf16; no fp8,
    fp4 or attention sweep found."""
    rate = GemmRate(fraction=_share(1565.0 / 2516.6), tiles=_HOPPER_TILES)
    return KernelTable(
        sms=256, launch_floor_us=4.0, memory_fraction=round(2711.3 / 3350, 3),
        gemm={"bf16": rate, "fp16": rate}, basis="kernel data",
        sources={"sms": "AMD ISSCC 2026 (MI355X): 8 XCDs x 32 active compute units",
                 "launch_floor_us": _FLOOR, "memory_fraction": _MEMORY_TRANSFER,
                 "gemm.bf16": f"{MAMF_TABLE}: MI355X bf16 1565.0 TFLOP/s (torch 2.8.0+rocm7.0.2, shape "
                              f"12288x8192x8192), of 2516.6; {_TILE_ESTIMATE}",
                 "gemm.fp16": "as bf16 (same matrix-core rate)"})


SHIPPED: dict[str, KernelTable] = {
    "hopper-sxm": _hopper(132),
    "hopper-pcie": _hopper(114),
    "ampere": _ampere(),
    "volta": _older(80, "V100", tensor_cores=True),
    "turing": _older(72, "TITAN RTX", tensor_cores=True),
    "pascal": _older(28, "GTX 1080 Ti", tensor_cores=False),
    "blackwell": _blackwell(),
    "cdna3": _cdna3(),
    "blackwell-ultra": _blackwell_ultra(),
    "blackwell-geforce": _blackwell_geforce(),
    "ada": _ada(128, "128 SMs on the RTX 4090", transferred=False),
    "ada-l40s": _ada(142, "142 SMs on the L40S", transferred=True),
    "cdna3-mi325x": _mi325x(),
    "cdna4": _cdna4(),
}
"""Tables by GPU family; ``family_of`` maps a model name onto them."""

_FAMILY_WORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("H100", "PCIE"), "hopper-pcie"),
    (("H100",), "hopper-sxm"), (("H200",), "hopper-sxm"), (("GH200",), "hopper-sxm"),
    (("B300",), "blackwell-ultra"), (("GB300",), "blackwell-ultra"),
    (("B200",), "blackwell"), (("GB200",), "blackwell"), (("MI300X",), "cdna3"), (("MI325X",), "cdna3-mi325x"),
    (("MI355X",), "cdna4"), (("RTX", "5090"), "blackwell-geforce"), (("RTX", "4090"), "ada"),
    (("L40S",), "ada-l40s"),
    (("A100",), "ampere"), (("V100",), "volta"), (("TITAN", "RTX"), "turing"), (("1080",), "pascal"),
)


def family_of(model: str) -> str | None:
    """The shipped table's family for a GPU model name (``H100-SXM5-80GB``, ``NVIDIA H100
    80GB HBM3``, ``A100-SXM4-40GB`` ...), or None."""
    upper = model.upper().replace("-", " ").replace("_", " ")
    words = set(upper.split())
    for needed, family in _FAMILY_WORDS:
        if all(any(w.startswith(n) or n in w for w in words) for n in needed):
            return family
    return None


def shipped_table(model: str) -> KernelTable | None:
    family = family_of(model)
    return SHIPPED[family] if family else None
