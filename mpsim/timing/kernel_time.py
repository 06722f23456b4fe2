"""Kernel-shape time: each GPU kernel's seconds from its shape and the GPU's kernel table.

One efficiency per operation class, fitted near one shape, is wrong away from it: a GEMM
whose tiles fill 1.1 waves of the GPU's SMs takes as long as one filling 2; FlashAttention
on short sequences runs well below its long-sequence rate; a thousand small element-wise
kernels cost their launches, not their bytes. Here each kernel of a trace
(``mpsim.hardware.kernel_records``) is timed on its own:

- **GEMM** (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave
  quantization): for each tile the table lists, the output splits into
  ceil(m / rows) x ceil(n / cols) x batch tiles, run in ceil(tiles / SMs) waves, each as
  long as one tile's 2 rows cols k FLOPs at the SM's share of the dtype's peak
  (peak / SMs x fraction x the tile's relative rate); cuBLAS's choice is the fastest tile.
  At least the time to read A and B and write C at the streaming rate.
- **Attention** (FlashAttention-2, Dao 2023; ``AttentionRate``): the kernel's FLOPs at its
  share of peak, which rises with the length as a fixed per-block cost is amortised
  (e(s) = fraction x s / (s + half_seq), with s what one thread block visits: in the
  forward the keys of its ``block_rows`` queries, in the backward the queries of its keys;
  all of them, or under a causal mask their share), times the rate at the kernel's head
  dim relative to head dim 128. Without a mask, blocks of ``block_rows`` per batch and head
  (query rows forward, key rows backward) run in waves over the SMs. Under a causal mask a
  table may say how the kernel runs its blocks (``causal_blocks``): the tiles the diagonal
  crosses are computed whole (min(s_q, s_k) x block_rows / 2 masked elements more), and
  the blocks, of unequal work, finish no sooner than the heaviest (all the keys, or all the
  queries); a forward that launches its query blocks in order (FlashAttention-2) leaves
  each of the SMs' resident block slots idle half a heaviest block at the end on average,
  which is why its published causal forward rates sit 5-12% under the unmasked ones at 2k-16k
  (batch x sequence 16k tokens: 2048 query blocks at head dim 128) and why the gap closes at
  long sequence. Past the longest measured sequence nothing changes with the length, so
  the rate holds its long-sequence fraction (the largest published kernel figures stop at
  16k). The memory-efficient kernel runs at ``mem_efficient_relative`` of that.
- **Convolution** (NVIDIA, "Convolutional Layers User's Guide"): the pass's implicit GEMM
  (``ConvKernel.gemm_shape``), ``groups`` of them; where cuDNN runs 3x3 stride-1 passes as
  Winograd (the table's ``winograd`` dtypes), their FLOPs divided by its reduction
  (F(2x2,3x3): 2.25, Lavin and Gray 2016) when that is faster.
- **Memory-bound kernels** (element-wise, norms, softmax, dropout, casts; the optimizer
  step): bytes at the streaming share of bandwidth.
- **Low-precision GEMMs** (a recipe's FP8 GEMMs, ``GemmKernel.low_precision``,
  ``mpsim.models.low_precision``): as any GEMM, at the FP8 peak and the table's FP8 rate, with
  1-byte operands; their casts are memory-bound kernels of the trace.

Every kernel takes at least the launch floor. A layer's pass is the sum of its kernels: on
one stream they run one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpsim.hardware.gpu_tables import AttentionRate, GemmRate, KernelTable
from mpsim.hardware.kernel_records import AttentionKernel, ConvKernel, GemmKernel, Kernel, MemoryKernel
from mpsim.hardware.topology import Dtype

ITEMSIZE: dict[str, float] = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp8": 1, "fp4": 0.5}


@dataclass(frozen=True)
class KernelRates:
    """What times kernels on one GPU at one precision."""

    table: KernelTable
    dtype: Dtype
    peak_flops_per_s: float
    """The dtype's dense peak (the topology's ``peak_tflops``)."""
    bandwidth_bytes_per_s: float
    """Peak memory bandwidth (the topology's ``memory_bandwidth_gbps``)."""
    itemsize: float
    """Bytes per element of the layers' tensors (the trace's compute dtype)."""
    low: KernelRates | None = None
    """A low-precision recipe's rates for its FP8 GEMMs (``GemmKernel.low_precision``): the
    same table at the GEMM dtype's peak and efficiency, its operands' bytes; None: none run."""

    @property
    def floor_s(self) -> float:
        return self.table.launch_floor_us * 1e-6

    @property
    def stream_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.table.memory_fraction

    @property
    def gemm_rate(self) -> GemmRate:
        rate = self.table.gemm.get(self.dtype)
        if rate is None:
            raise KeyError(self.dtype)
        return rate


def gemm_seconds(m: int, n: int, k: int, batch: int, rates: KernelRates) -> float:
    """Seconds of C[batch, m, n] = A[batch, m, k] @ B[batch, k, n] (module doc)."""
    rate = rates.gemm_rate
    sms = rates.table.sms
    per_sm_flops = rates.peak_flops_per_s / sms * rate.fraction
    compute_s = min(_waves(math.ceil(m / t.rows) * math.ceil(n / t.cols) * batch, sms)
                    * 2.0 * t.rows * t.cols * k / (per_sm_flops * t.relative) for t in rate.tiles)
    io_s = (m * k + k * n + m * n) * batch * rates.itemsize / rates.stream_bytes_per_s
    return max(compute_s, io_s, rates.floor_s)


def _waves(blocks: int, sms: int) -> int:
    return max(1, math.ceil(blocks / sms))


def attention_rate(rates: KernelRates) -> AttentionRate | None:
    return rates.table.attention.get(rates.dtype)


def attention_seconds(kernel: AttentionKernel, rates: KernelRates) -> float:
    """Seconds of one fused attention kernel (module doc). A dtype the table has no
    attention rate for (fp32's memory-efficient kernel) runs at the GEMM rate times
    ``mem_efficient_relative``."""
    rate = attention_rate(rates)
    sms = rates.table.sms
    if rate is None:
        efficiency = rates.gemm_rate.fraction * rates.table.mem_efficient_relative
        blocks = kernel.batch * kernel.heads * math.ceil(kernel.s_q / 128)
        quantization = _waves(blocks, sms) * sms / blocks
    else:
        efficiency, quantization = _flash_efficiency(kernel, rate, sms)
        if kernel.backend == "mem-efficient":
            efficiency *= rates.table.mem_efficient_relative
    compute_s = kernel.flops / (rates.peak_flops_per_s * efficiency) * quantization
    elements = kernel.batch * kernel.head_dim * (2 * kernel.heads * kernel.s_q + 2 * kernel.kv_heads * kernel.s_k)
    io_s = elements * rates.itemsize * (2 if kernel.backward else 1) / rates.stream_bytes_per_s
    return max(compute_s, io_s, rates.floor_s)


def attention_efficiency(kernel: AttentionKernel, rates: KernelRates) -> float:
    """The share of the dtype's peak ``kernel`` runs at: its FLOPs over its seconds (the
    launch floor and the streaming bound included)."""
    return kernel.flops / (attention_seconds(kernel, rates) * rates.peak_flops_per_s)


def _flash_efficiency(kernel: AttentionKernel, rate: AttentionRate, sms: int) -> tuple[float, float]:
    """A fused kernel's share of peak over the work it does, and the factor its blocks'
    scheduling stretches that by (module doc)."""
    backward = kernel.backward
    fraction, half = (rate.bwd_fraction, rate.bwd_half_seq) if backward else (rate.fwd_fraction, rate.fwd_half_seq)
    share = kernel.causal_share
    own, other = (kernel.s_k, kernel.s_q) if backward else (kernel.s_q, kernel.s_k)
    visited = other * share  # what one block (of ``own``'s rows) visits: keys forward, queries backward
    efficiency = fraction * rate.head_dim_relative(kernel.head_dim, backward) * visited / (visited + half)
    rows = rate.block_rows
    blocks = kernel.batch * kernel.heads * math.ceil(own / rows)
    if not (kernel.causal and rate.causal_blocks != "ideal"):
        return efficiency, _waves(blocks, sms) * sms / blocks
    useful = share * kernel.s_q * kernel.s_k
    efficiency *= useful / (useful + min(kernel.s_q, kernel.s_k) * rows / 2)  # the diagonal's tiles, whole
    slots = sms * rate.ctas_per_sm
    even = blocks * visited / slots  # the work spread evenly over the slots, in visited rows
    tail = other / 2 if not backward and rate.causal_blocks == "in-order" else 0.0
    return efficiency, max(even + tail, other) / even


def conv_seconds(kernel: ConvKernel, rates: KernelRates) -> float:
    """Seconds of one convolution pass: its implicit GEMM, or Winograd where cuDNN picks it."""
    m, n, k = kernel.gemm_shape()
    implicit_s = gemm_seconds(m, n, k, kernel.groups, rates)
    reduction = rates.table.winograd.get(rates.dtype)
    if reduction and kernel.winograd_eligible and kernel.pass_ != "wgrad":
        return max(rates.floor_s, min(implicit_s, implicit_s / reduction))
    return implicit_s


def memory_seconds(n_bytes: float, rates: KernelRates) -> float:
    return max(n_bytes / rates.stream_bytes_per_s, rates.floor_s)


def kernel_seconds(kernel: Kernel, rates: KernelRates) -> float:
    """Seconds of one launch of ``kernel``."""
    if isinstance(kernel, GemmKernel):
        at = rates.low if kernel.low_precision and rates.low is not None else rates
        return gemm_seconds(kernel.m, kernel.n, kernel.k, kernel.batch, at)
    if isinstance(kernel, AttentionKernel):
        return attention_seconds(kernel, rates)
    if isinstance(kernel, ConvKernel):
        return conv_seconds(kernel, rates)
    assert isinstance(kernel, MemoryKernel)
    return memory_seconds(kernel.bytes_, rates)


def pass_seconds(kernels: list[Kernel], rates: KernelRates) -> float:
    """Seconds of a layer's forward or backward: its kernels one after another."""
    return sum(kernel_seconds(k, rates) * k.count for k in kernels)


def gemm_pass_seconds(kernels: list[Kernel], rates: KernelRates) -> float:
    """Seconds of a pass's GEMMs alone: what a collective overlapped with them can hide behind."""
    return sum(kernel_seconds(k, rates) * k.count for k in kernels if isinstance(k, GemmKernel))


def attention_pass_seconds(kernels: list[Kernel], rates: KernelRates) -> float:
    """Seconds of a pass's fused attention kernels alone: what a context-parallel ring's sends
    hide behind."""
    return sum(kernel_seconds(k, rates) * k.count for k in kernels if isinstance(k, AttentionKernel))


def low_precision_flops(kernels: list[Kernel]) -> float:
    """FLOPs of a pass's low-precision (FP8) GEMMs, launches counted."""
    return sum(k.flops * k.count for k in kernels if isinstance(k, GemmKernel) and k.low_precision)


def launches(kernels: list[Kernel]) -> int:
    """Kernel launches of a pass (each record's ``count``)."""
    return sum(k.count for k in kernels)


def can_time(table: KernelTable | None, dtype: Dtype) -> bool:
    """Whether ``table`` times kernels at ``dtype`` (it has that dtype's GEMM rate)."""
    return table is not None and dtype in table.gemm
