"""The GPU kernels a traced layer runs, by shape: what ``mpsim.timing.kernel_time`` times.

The tracer (``mpsim.models.tracer``) sees every operator a layer dispatches and records each as
one kernel of four kinds:

- ``gemm``: a matrix multiply, C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]
  (``mm``, ``addmm``, ``bmm``, ``baddbmm``; a linear layer's forward and both of its
  backward products);
- ``attention``: a fused attention kernel (FlashAttention-2 or the memory-efficient one),
  forward or backward, by batch, heads, query and key lengths, head dimension and mask;
- ``conv``: a 2-D convolution pass (forward, data gradient, weight gradient) by shape;
- ``memory``: any other kernel (element-wise, normalisation, softmax, dropout, casts,
  reductions, gathers), by the bytes it reads and writes.

Identical kernels are kept once with a ``count``. Each record says how it grows with the
microbatch, found by tracing the layer again at twice the batch (``Trace.rescale``):
the GEMM dimension that doubled (``grows``: the tokens are ``m`` in a forward product and
``k`` in a weight gradient), the attention and convolution batch, and for a memory kernel
the part of its bytes that stays (``fixed_bytes``: a weight read, a weight gradient
written).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from mpsim.units import MAX_BYTES

MAX_DIM = 2**40
"""Largest size of one kernel dimension (rows, tokens, channels)."""
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
"""A kernel dimension: a whole number from 1 to ``MAX_DIM``."""
MAX_COUNT = 2**20
"""Most launches of one kernel shape in one layer's pass."""


class _Kernel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    count: int = Field(default=1, ge=1, le=MAX_COUNT, description="launches of this shape in the pass")


GemmDim = Literal["m", "n", "k", "batch", "none"]


class GemmKernel(_Kernel):
    """C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]."""

    op: Literal["gemm"] = "gemm"
    m: Dim
    n: Dim
    k: Dim
    batch: int = Field(default=1, ge=1, le=MAX_DIM)
    grows: GemmDim = Field(default="m", description="the dimension proportional to the microbatch")
    low_precision: bool = Field(default=False, description="runs at the recipe's GEMM dtype (FP8), not its "
                                                           "compute dtype")

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch


class AttentionKernel(_Kernel):
    """One fused attention kernel on q (batch, heads, s_q, head_dim), k and v (batch,
    kv heads, s_k, head_dim). FLOPs as the kernels do them (``mpsim.models.kernels``): forward two
    matmuls, backward five, under a causal mask only the blocks on or below the diagonal."""

    op: Literal["attention"] = "attention"
    backend: Literal["flash", "mem-efficient"] = "flash"
    backward: bool = False
    batch: Dim
    heads: Dim
    kv_heads: Dim
    s_q: Dim
    s_k: Dim
    head_dim: Dim
    causal: bool = False

    @property
    def causal_share(self) -> float:
        """Share of the s_q x s_k score blocks computed: the lower triangle with its diagonal."""
        if not self.causal:
            return 1.0
        s_q, s_k = self.s_q, self.s_k
        return (s_k * (s_k + 1) / 2 - (s_k - s_q) * (s_k - s_q + 1) / 2) / (s_q * s_k)

    @property
    def flops(self) -> float:
        matmuls = 5 if self.backward else 2
        return 2.0 * matmuls * self.batch * self.heads * self.s_q * self.s_k * self.head_dim * self.causal_share


class ConvKernel(_Kernel):
    """One pass of a 2-D convolution: input (n, c_in, h, w), weight (c_out, c_in/groups,
    r, s), output (n, c_out, p, q). As implicit GEMMs (NVIDIA, "Convolutional Layers User's
    Guide", forward/dgrad/wgrad): forward M = n p q, N = c_out/g, K = c_in/g r s; data
    gradient M = n h w, N = c_in/g, K = c_out/g r s; weight gradient M = c_out/g,
    N = c_in/g r s, K = n p q; each ``groups`` times."""

    op: Literal["conv"] = "conv"
    pass_: Literal["fwd", "dgrad", "wgrad"] = Field(alias="pass")
    n: Dim
    c_in: Dim
    h: Dim
    w: Dim
    c_out: Dim
    r: Dim
    s: Dim
    p: Dim
    q: Dim
    stride: int = Field(default=1, ge=1, le=MAX_DIM)
    groups: int = Field(default=1, ge=1, le=MAX_DIM)

    def gemm_shape(self) -> tuple[int, int, int]:
        """(M, N, K) of one group's implicit GEMM for this pass."""
        g = self.groups
        if self.pass_ == "fwd":
            return self.n * self.p * self.q, self.c_out // g, self.c_in // g * self.r * self.s
        if self.pass_ == "dgrad":
            return self.n * self.h * self.w, self.c_in // g, self.c_out // g * self.r * self.s
        return self.c_out // g, self.c_in // g * self.r * self.s, self.n * self.p * self.q

    @property
    def flops(self) -> float:
        m, n, k = self.gemm_shape()
        return 2.0 * m * n * k * self.groups

    @property
    def winograd_eligible(self) -> bool:
        """3x3, stride 1, ungrouped: the shapes cuDNN's Winograd kernels take."""
        return self.r == 3 and self.s == 3 and self.stride == 1 and self.groups == 1


class MemoryKernel(_Kernel):
    """A memory-bound kernel: ``bytes`` read and written, ``fixed_bytes`` of them the same
    at any microbatch."""

    op: Literal["memory"] = "memory"
    bytes_: int = Field(alias="bytes", ge=0, le=MAX_BYTES)
    fixed_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)


Kernel = Annotated[GemmKernel | AttentionKernel | ConvKernel | MemoryKernel, Field(discriminator="op")]


K = TypeVar("K", GemmKernel, AttentionKernel, ConvKernel, MemoryKernel)


def rescale_kernel(kernel: K, factor: float) -> K:
    """``kernel`` at ``factor`` times the microbatch (see the module doc)."""
    if factor == 1.0:
        return kernel

    def grown(v: int) -> int:
        return max(1, round(v * factor))

    if isinstance(kernel, GemmKernel):
        if kernel.grows == "none":
            return kernel
        return kernel.model_copy(update={kernel.grows: grown(getattr(kernel, kernel.grows))})
    if isinstance(kernel, AttentionKernel):
        return kernel.model_copy(update={"batch": grown(kernel.batch)})
    if isinstance(kernel, ConvKernel):
        return kernel.model_copy(update={"n": grown(kernel.n)})
    per_sample = kernel.bytes_ - kernel.fixed_bytes
    return kernel.model_copy(update={"bytes_": kernel.fixed_bytes + round(per_sample * factor)})


def kernel_flops(kernels: list[Kernel]) -> float:
    """FLOPs of a pass's compute kernels (GEMMs, attention, convolutions), launches counted."""
    return sum(k.flops * k.count for k in kernels if not isinstance(k, MemoryKernel))
