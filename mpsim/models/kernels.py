"""GPU kernel semantics for layers that are traced on CPU.

A CPU kernel does not always keep for the backward what the CUDA kernel keeps. The
tracer runs layers on fake CPU tensors, so the layers call the functions here, which keep
exactly what the CUDA kernels keep and count FLOPs the way those kernels do them:

- ``dropout``: CUDA's fused dropout (``aten.native_dropout``) keeps a 1-byte mask; CPU's
  ``F.dropout`` keeps a noise tensor as wide as the data type.
- ``rms_norm``: a fused RMSNorm (as Apex, Transformer Engine and PyTorch's CUDA
  ``_fused_rms_norm``) keeps the input and one fp32 reciprocal RMS per row.
- ``attention`` with one of four backends (``ATTENTION_BACKENDS``):

  ``eager``
      written out: scores, scale, mask, softmax, dropout, weighted sum. Keeps
      Korthikanti et al.'s 5*a*s^2*b bytes per layer (2 softmax + 1 mask + 2 dropped
      probabilities, fp16) beside q, k, v.
  ``fused-softmax``
      Megatron's fused scale-mask-softmax: the same tensors kept, without the scaled and
      masked copies of the scores (less transient memory and traffic).
  ``mem-efficient``
      the memory-efficient (xFormers/CUTLASS) kernel: keeps q, k, v, the output and an
      fp32 log-sum-exp per query row, padded to 32 rows; no s x s tensor.
  ``flash``
      FlashAttention-2 (Dao 2023): keeps q, k, v, the output and an fp32 log-sum-exp of
      a*s*b values. Dropout inside both fused kernels is regenerated from the RNG seed, so
      no mask is kept.

  The fused kernels' FLOPs: forward two matmuls (4*b*a*s_q*s_k*d), backward five
  (it recomputes the scores: FlashAttention section 3.1), both halved under a causal mask
  because the kernels skip the blocks above the diagonal.

Outside tracing the functions compute the same results as PyTorch's own layers (the
custom operators have real CPU and CUDA implementations), so the executor runs them too.

``TraceProbe`` lets the tracer see which saved tensors belong to the attention core
(what selective recompute, Korthikanti et al. section 4.2, drops) and what the core's
forward costs to run again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast, get_args

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

AttentionBackend = Literal["eager", "fused-softmax", "mem-efficient", "flash"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
FUSED_ATTENTION_OPS = frozenset({"fused_attention", "fused_attention_backward"})
"""Operator names whose FLOPs run in a fused attention kernel (their own efficiency class)."""
_LSE_ROWS = {"mem-efficient": 32, "flash": 1}
"""The log-sum-exp's query rows are padded to a multiple of this (PyTorch's CUTLASS kernel pads to 32)."""


def default_attention(compute_capability: float | None, compute_dtype: str = "fp16") -> AttentionBackend:
    """The backend PyTorch's scaled_dot_product_attention picks: FlashAttention-2 for 16-bit
    inputs from Ampere (8.0) on, the memory-efficient kernel before (Volta, Turing, Pascal)
    and for fp32 inputs, which FlashAttention does not take; flash when the GPU is unknown."""
    if compute_dtype in ("fp32", "tf32") or (compute_capability is not None and compute_capability < 8.0):
        return "mem-efficient"
    return "flash"


def check_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    return cast(AttentionBackend, name)


# --- what the tracer watches -------------------------------------------------------------


@dataclass
class TraceProbe:
    """Filled while tracing: the storages the attention core keeps for its backward (its
    inputs excluded), its inputs (the checkpoint selective recompute keeps) and the FLOPs
    its forward costs to recompute."""

    core_saved: dict[int, int] = field(default_factory=dict)
    core_inputs: dict[int, int] = field(default_factory=dict)
    core_fwd_flops: float = 0.0
    in_core: bool = False


_PROBE: ContextVar[TraceProbe | None] = ContextVar("mpsim_trace_probe", default=None)
P = TypeVar("P")


@contextmanager
def scoped(var: ContextVar[P | None], value: P) -> Iterator[P]:
    """``var`` set to ``value`` inside the block (the tracer's probes)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def probing(probe: TraceProbe) -> AbstractContextManager[TraceProbe]:
    return scoped(_PROBE, probe)


def storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return t.untyped_storage()._cdata


def note_saved(t: Tensor) -> None:
    """Called by the tracer's pack hook: remembers a tensor the attention core keeps."""
    probe = _PROBE.get()
    if probe is not None and probe.in_core:
        key = storage_key(t)
        if key not in probe.core_inputs:
            probe.core_saved.setdefault(key, t.untyped_storage().nbytes())


@contextmanager
def _core(*inputs: Tensor) -> Iterator[None]:
    probe = _PROBE.get()
    if probe is None or probe.in_core:
        yield
        return
    probe.core_inputs.update((storage_key(t), t.untyped_storage().nbytes()) for t in inputs)
    probe.in_core = True
    try:
        with FlopCounterMode(display=False) as flops:
            yield
        probe.core_fwd_flops += flops.get_total_flops()
    finally:
        probe.in_core = False


# --- dropout and RMSNorm -------------------------------------------------------------------


def _wide(t: Tensor) -> Tensor:
    """``t`` in at least fp32, as the kernels accumulate (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """CUDA's fused dropout: the output and a 1-byte keep mask (the mask is what is saved)."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


class CudaDropout(torch.overrides.TorchFunctionMode):
    """Sends every ``F.dropout`` (so any model's ``nn.Dropout``: Hugging Face's, a user's
    module) to ``dropout``, CUDA's fused dropout with its 1-byte mask. The tracer runs
    each layer under it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            return dropout(bound["input"], bound.get("p", 0.5), bound.get("training", True))
        return func(*args, **kwargs)


@torch.library.custom_op("mpsim::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
    return (_wide(x) * rstd).to(x.dtype) * weight, rstd


@_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("mpsim::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    normed = _wide(x) * rstd
    g = _wide(grad) * _wide(weight)
    dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
    dw = (_wide(grad) * normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_grad(ctx, grad: Tensor, _grad_rstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mpsim.rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


_rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Fused RMSNorm (Zhang and Sennrich 2019): keeps x and a per-row fp32 reciprocal RMS.
    On a real CUDA tensor PyTorch's own fused kernel runs."""
    if _real_cuda(x):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.ops.mpsim.rms_norm(x, weight, eps)[0]


def _real_cuda(t: Tensor) -> bool:
    """A CUDA tensor with storage (not fake, not traced): run the vendor kernels themselves."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_cuda and not isinstance(t, FakeTensor) and _PROBE.get() is None


# --- attention --------------------------------------------------------------------------------


@torch.library.custom_op("mpsim::scaled_masked_softmax", mutates_args=())
def _scaled_masked_softmax(scores: Tensor, scale: float, causal: bool) -> Tensor:
    x = scores * scale
    if causal:
        s_q, s_k = x.shape[-2:]
        x = x.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=x.device).triu(1 + s_k - s_q), -math.inf)
    return torch.softmax(x, dim=-1)


@_scaled_masked_softmax.register_fake
def _(scores: Tensor, scale: float, causal: bool) -> Tensor:
    return torch.empty_like(scores)


@torch.library.custom_op("mpsim::scaled_masked_softmax_backward", mutates_args=())
def _scaled_masked_softmax_backward(grad: Tensor, probs: Tensor, scale: float) -> Tensor:
    return (grad - (grad * probs).sum(-1, keepdim=True)) * probs * scale


@_scaled_masked_softmax_backward.register_fake
def _(grad: Tensor, probs: Tensor, scale: float) -> Tensor:
    return torch.empty_like(grad)


def _softmax_setup(ctx, inputs, output) -> None:
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _softmax_grad(ctx, grad: Tensor):
    (probs,) = ctx.saved_tensors
    return torch.ops.mpsim.scaled_masked_softmax_backward(grad, probs, ctx.scale), None, None


_scaled_masked_softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def _attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Output and fp32 log-sum-exp per query row, written out (real runs and tests)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (_wide(q) @ _wide(k).transpose(-2, -1)) * scale
    if causal:
        s_q, s_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1 + s_k - s_q),
                                    -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ _wide(v)).to(q.dtype)
    return out, lse


@torch.library.custom_op("mpsim::fused_attention", mutates_args=())
def _fused_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                     lse_rows: int) -> tuple[Tensor, Tensor]:
    out, lse = _attention_reference(q, k, v, causal, scale)
    padded = math.ceil(q.shape[2] / lse_rows) * lse_rows
    return out, F.pad(lse, (0, padded - lse.shape[-1]))


@_fused_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, lse_rows: int) -> tuple[Tensor, Tensor]:
    padded = math.ceil(q.shape[2] / lse_rows) * lse_rows
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1], padded), dtype=lse_dtype)


@torch.library.custom_op("mpsim::fused_attention_backward", mutates_args=())
def _fused_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention's backward (Dao 2023, Algorithm 2): probabilities recomputed from the
    scores and the saved log-sum-exp, D = rowsum(dO * O), dS = P * (dP - D)."""
    b, a, s_q, d = q.shape
    kv = k.shape[1]
    groups = a // kv
    kf, vf = (_wide(t).repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (_wide(q) @ kf.transpose(-2, -1)) * scale
    if causal:
        s_k = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1 + s_k - s_q),
                                    -math.inf)
    probs = torch.exp(scores - lse[..., :s_q].unsqueeze(-1))
    g = _wide(grad)
    dv = probs.transpose(-2, -1) @ g
    d_probs = g @ vf.transpose(-2, -1)
    d_scores = probs * (d_probs - (g * _wide(out)).sum(-1, keepdim=True)) * scale
    dq = d_scores @ kf
    dk = d_scores.transpose(-2, -1) @ _wide(q)
    dk, dv = (t.reshape(b, kv, groups, *t.shape[2:]).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_fused_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale, _rows = inputs
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, output[0], output[1])


def _attention_grad(ctx, grad: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.mpsim.fused_attention_backward(grad, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


_fused_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def _causal_share(s_q: int, s_k: int, causal: bool) -> float:
    """Share of the s_q x s_k score blocks a kernel computes: under a causal mask the
    lower triangle with its diagonal."""
    if not causal:
        return 1.0
    return (s_k * (s_k + 1) / 2 - (s_k - s_q) * (s_k - s_q + 1) / 2) / (s_q * s_k)


@register_flop_formula(torch.ops.mpsim.fused_attention)
def _fused_attention_flops(q_shape, k_shape, v_shape, causal, scale, lse_rows, *args, **kwargs) -> int:
    b, a, s_q, d = q_shape
    s_k = k_shape[2]
    return round(4 * b * a * s_q * s_k * d * _causal_share(s_q, s_k, causal))


@register_flop_formula(torch.ops.mpsim.fused_attention_backward)
def _fused_attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, saved_out_shape, lse_shape, causal, scale,
                                    *args, **kwargs) -> int:
    b, a, s_q, d = q_shape
    s_k = k_shape[2]
    return round(10 * b * a * s_q * s_k * d * _causal_share(s_q, s_k, causal))


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """Grouped-query attention written out: each key/value head serves ``groups`` query heads."""
    if groups == 1:
        return t
    b, kv, s, d = t.shape
    return t[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def _cuda_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, dropout_p: float, scale: float,
                    backend: AttentionBackend) -> Tensor:
    """PyTorch's own CUDA kernel for ``backend`` (FlashAttention-2 or the memory-efficient one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "flash" and q.dtype == torch.float32:
        raise ValueError("FlashAttention takes fp16 or bf16 inputs; an fp32 model runs mem-efficient attention")
    kernel = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel([kernel]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, dropout_p: float, training: bool,
              backend: AttentionBackend, scale: float | None = None) -> Tensor:
    """Attention core on q (b, a, s, d) and k, v (b, kv_heads, s, d); returns (b, a, s, d)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend in _LSE_ROWS and _real_cuda(q):
        return _cuda_attention(q, k, v, causal, dropout_p if training else 0.0, scale, backend)
    with _core(q, k, v):
        if backend in _LSE_ROWS:
            return torch.ops.mpsim.fused_attention(q, k, v, causal, scale, _LSE_ROWS[backend])[0]
        groups = q.shape[1] // k.shape[1]
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        scores = q @ k.transpose(-2, -1)
        if backend == "fused-softmax":
            probs = torch.ops.mpsim.scaled_masked_softmax(scores, scale, causal)
        else:
            scores = scores * scale
            if causal:
                s_q, s_k = scores.shape[-2:]
                mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1 + s_k - s_q)
                scores = scores.masked_fill(mask, -math.inf)
            probs = torch.softmax(scores, dim=-1)
        return dropout(probs, dropout_p, training) @ v
