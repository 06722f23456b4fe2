"""What a lone kernel reaches at best on each GPU: the physical ceiling of every efficiency.

No time model may run a GPU faster than the best published lone kernel of its class on that
GPU: a GEMM at the "maximum achievable matmul FLOPS" (the best shape of a sweep, not the
datasheet peak), a fused attention kernel at its paper's best point, a streaming kernel at
the best measured copy bandwidth. Training runs many kernels, some of them small, so a
layer's efficiency is at most this and usually below it.

``CEILINGS`` holds, per GPU family (``mpsim.hardware.gpu_tables.family_of``) and precision,
those best shares of the dtype's dense peak (or of the datasheet memory bandwidth), each with
its source. ``check_efficiency`` and ``check_table`` say which figure of a topology's
``efficiency`` block or of a kernel table is above its ceiling; the tests pin every shipped
GPU under them, and a topology file whose figure is above one is refused
(``GpuSpec``'s validator).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpsim.hardware.gpu_tables import MAMF_TABLE, OUR_H100_PROBE, KernelTable, family_of

__all__ = ["CEILINGS", "Ceiling", "ceiling_for", "check_efficiency", "check_table"]


@dataclass(frozen=True)
class Ceiling:
    """Best lone-kernel shares of peak on one GPU family at one precision."""

    gemm: float
    """Best GEMM over shapes, share of the dtype's dense peak."""
    attention: float
    """Best fused attention kernel (forward or backward, any published kernel), share of peak."""
    memory: float
    """Best streaming kernel (device copy, STREAM-like), share of datasheet bandwidth."""
    source: str


_FA3 = "FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608): 740 TFLOP/s fp16 forward on H100 SXM5, 75% of peak"
_FA2 = "FlashAttention-2 (Dao 2023, arXiv 2307.08691): forward up to 73% of A100 peak"
_COPY = "device-to-device copy 2711.3 of 3350 GB/s (0.81) in " + OUR_H100_PROBE + "; ceiling 0.9 allows STREAM triad"

_HOPPER_TC = Ceiling(gemm=round(794.5 / 989, 3), attention=0.765, memory=0.9,
                     source=f"gemm: {MAMF_TABLE}: H100 SXM bf16 794.5 of 989 TFLOP/s (792.1 with CUDA 12.1); "
                            f"attention: {_FA3}, 756 TFLOP/s at head dim 256 (0.765); memory: {_COPY}")
_HOPPER_FP8 = Ceiling(gemm=round(1402.6 / 1979, 3), attention=0.765, memory=0.9,
                      source=f"gemm: {MAMF_TABLE}: H100 SXM fp8 1402.6 of 1979 TFLOP/s; attention and memory as "
                             "bf16's")
_AMPERE_TC = Ceiling(gemm=round(271.2 / 312, 3), attention=0.73, memory=0.97,
                     source=f"gemm: {MAMF_TABLE}: A100 SXM bf16 271.2 of 312 TFLOP/s (shape 1024x10240x5120, "
                            f"torch 2.6); attention: {_FA2}; memory: te42kyfo/gpu-benches stream, A100 40GB up to "
                            "97% of datasheet bandwidth")
_VOLTA_TC = Ceiling(gemm=round(95 / 125, 3), attention=0.76, memory=0.99,
                    source="gemm: mli/transformers-benchmarks micro_bench (2022): torch.matmul fp16 95 of 125 "
                           "TFLOP/s on V100 (best square size to 8192); attention (no fused kernel on Volta) as "
                           "GEMM; memory: te42kyfo/gpu-benches gpu-stream on V100, store 895 of 900 GB/s")
_SIMT_FP32 = Ceiling(gemm=0.9, attention=0.9, memory=0.99,
                     source="CUDA-core SGEMM: our H100 probe 51.35 of 67 TFLOP/s (0.77, " + OUR_H100_PROBE
                            + "), V100 14 of 15.7 (0.89, mli/transformers-benchmarks micro_bench); ceiling 0.9; "
                              "memory: the best stream figure of any GPU (V100, 0.99)")
_TC_GENERIC = Ceiling(gemm=0.9, attention=0.9, memory=0.9,
                      source="no published sweep of this GPU and precision used: 0.9, above what any tensor-core "
                             "GEMM sweep of ours or published reaches; attention (no fused kernel figure) as GEMM")

_BLACKWELL = Ceiling(gemm=round(1745 / 2250, 3), attention=round(1613 / 2250, 3), memory=0.9,
                     source=f"gemm: {MAMF_TABLE}: B200 bf16 1745 of 2250 TFLOP/s (GB200 1822 of 2500: 0.729); "
                            "attention: FlashAttention-4 (arXiv 2603.05451), 1613 of 2250 TFLOP/s on B200; memory: "
                            "as Hopper's")
_BLACKWELL_FP8 = Ceiling(gemm=round(3432.5 / 4500, 3), attention=round(1613 / 2250, 3), memory=0.9,
                         source=f"gemm: {MAMF_TABLE}: B200 fp8 3432.5 of 4500 TFLOP/s; the rest as bf16's")
_CDNA3 = Ceiling(gemm=round(708 / 1307.4, 3), attention=round(708 / 1307.4, 3), memory=0.9,
                 source="gemm: AMD ROCm blog (2025-02-28), MI300X bf16 GEMM 708 TFLOP/s with AMD's own library, "
                        "above the 668.4 PyTorch reaches (" + MAMF_TABLE + "); attention (no fused kernel figure) "
                        "as GEMM; memory as Hopper's")

_FA4_B200 = "FlashAttention-4 (arXiv 2603.05451), 1613 of 2250 TFLOP/s on B200"
_BLACKWELL_ULTRA = Ceiling(gemm=round(1769.0 / 2250, 3), attention=round(1613 / 2250, 3), memory=0.9,
                           source=f"gemm: {MAMF_TABLE}: B300 bf16 1769.0 of 2250 TFLOP/s; attention: {_FA4_B200} "
                                  "(no B300 attention figure found); memory: as Hopper's")
_BLACKWELL_ULTRA_FP8 = Ceiling(gemm=round(3353.3 / 4500, 3), attention=round(1613 / 2250, 3), memory=0.9,
                               source=f"gemm: {MAMF_TABLE}: B300 fp8 3353.3 of 4500 TFLOP/s; the rest as bf16's")
_TORCH_PERF_DB = "zzc0721/torch-performance-test-data"
_ADA_TC = Ceiling(gemm=1.0, attention=1.0, memory=0.9,
                  source=f"gemm: {_TORCH_PERF_DB} issue #78, RTX 4090 torch.matmul fp16 168.38 and bf16 164.81 of "
                         "165.2 TFLOP/s: a GeForce card boosts above the clock its datasheet peak assumes, so the "
                         "best lone GEMM reaches the peak (ceiling 1.0); attention (no fused kernel figure) as GEMM; "
                         "memory: as Hopper's")
_BLACKWELL_GEFORCE = Ceiling(gemm=round(240.05 / 419.2, 3), attention=round(240.05 / 419.2, 3), memory=0.9,
                             source=f"gemm: {_TORCH_PERF_DB} issue #96, RTX 5090 torch.matmul bf16 240.05 of 419.2 "
                                    "TFLOP/s (the best 16-bit figure; fp16 234.63); attention (no fused kernel "
                                    "figure) as GEMM; memory: as Hopper's")
_AMD_MAF = "AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (2025-02-28)"
_MI325X = Ceiling(gemm=round(843 / 1307.4, 3), attention=round(843 / 1307.4, 3), memory=0.9,
                  source=f"gemm: {_AMD_MAF}, MI325X bf16 GEMM 843 TFLOP/s with hipBLASLt (PyTorch 784.9, "
                         f"{MAMF_TABLE}); attention (no fused kernel figure) as GEMM; memory: as Hopper's")
_MI325X_FP8 = Ceiling(gemm=round(1519 / 2614.9, 3), attention=round(843 / 1307.4, 3), memory=0.9,
                      source=f"gemm: {_AMD_MAF}, MI325X fp8 GEMM 1519 of 2614.9 TFLOP/s; the rest as bf16's")
_CDNA4 = Ceiling(gemm=round(1565.0 / 2516.6, 3), attention=round(1565.0 / 2516.6, 3), memory=0.9,
                 source=f"gemm: {MAMF_TABLE}: MI355X bf16 1565.0 of 2516.6 TFLOP/s; attention (no fused kernel "
                        "figure) as GEMM; memory: as Hopper's")

CEILINGS: dict[str, dict[str, Ceiling]] = {
    "hopper-sxm": {"bf16": _HOPPER_TC, "fp16": _HOPPER_TC, "tf32": _HOPPER_TC, "fp8": _HOPPER_FP8,
                   "fp32": _SIMT_FP32},
    "hopper-pcie": {"bf16": _HOPPER_TC, "fp16": _HOPPER_TC, "tf32": _HOPPER_TC, "fp8": _HOPPER_FP8,
                    "fp32": _SIMT_FP32},
    "ampere": {"bf16": _AMPERE_TC, "fp16": _AMPERE_TC, "tf32": _TC_GENERIC, "fp32": _SIMT_FP32},
    "volta": {"fp16": _VOLTA_TC, "fp32": _SIMT_FP32},
    "turing": {"fp16": _TC_GENERIC, "fp32": _SIMT_FP32},
    "pascal": {"fp16": _SIMT_FP32, "fp32": _SIMT_FP32},
    "blackwell": {"bf16": _BLACKWELL, "fp16": _BLACKWELL, "fp8": _BLACKWELL_FP8},
    "cdna3": {"bf16": _CDNA3, "fp16": _CDNA3, "fp8": _CDNA3},
    "blackwell-ultra": {"bf16": _BLACKWELL_ULTRA, "fp16": _BLACKWELL_ULTRA, "fp8": _BLACKWELL_ULTRA_FP8},
    "blackwell-geforce": {"bf16": _BLACKWELL_GEFORCE, "fp16": _BLACKWELL_GEFORCE, "fp32": _SIMT_FP32},
    "ada": {"bf16": _ADA_TC, "fp16": _ADA_TC, "fp32": _SIMT_FP32},
    "ada-l40s": {"bf16": _ADA_TC, "fp16": _ADA_TC, "fp32": _SIMT_FP32},
    "cdna3-mi325x": {"bf16": _MI325X, "fp16": _MI325X, "fp8": _MI325X_FP8},
    "cdna4": {"bf16": _CDNA4, "fp16": _CDNA4},
}
"""Per GPU family, per precision: the ceilings (module doc)."""

_ANY = Ceiling(gemm=0.9, attention=0.9, memory=0.9,
               source="no GPU family known: 0.9, above every lone kernel any sweep we know of reaches")


def ceiling_for(gpu_model: str, dtype: str) -> Ceiling:
    """The ceiling of ``gpu_model`` at ``dtype`` (``_ANY`` for a GPU or precision not listed)."""
    family = family_of(gpu_model)
    return CEILINGS.get(family or "", {}).get(dtype, _ANY)


def check_efficiency(gpu_model: str, dtype: str, matmul: float, attention: float, memory: float) -> list[str]:
    """The figures of one ``efficiency`` block above their ceiling, each said in a phrase."""
    c = ceiling_for(gpu_model, dtype)
    pairs = (("matmul", matmul, c.gemm), ("attention", attention, c.attention), ("memory", memory, c.memory))
    return [f"{dtype}.{name} {value:g} is above {limit:g}, the best lone kernel on {gpu_model} ({c.source})"
            for name, value, limit in pairs if value > limit + 1e-9]


def check_table(gpu_model: str, table: KernelTable) -> list[str]:
    """The figures of a kernel table above their ceiling: a GEMM's full-wave fraction at its
    best tile, an attention kernel's long-sequence fractions, the streaming share."""
    out = []
    for dtype, rate in table.gemm.items():
        best = rate.fraction * max(t.relative for t in rate.tiles)
        out += check_efficiency(gpu_model, dtype, best, 0.0, table.memory_fraction)
    for dtype, att in table.attention.items():
        out += check_efficiency(gpu_model, dtype, 0.0, max(att.fwd_fraction, att.bwd_fraction), 0.0)
    return sorted(set(out))
