"""Megatron-LM's tensor-parallel communication, as the tracer sees it.

A tensor-parallel shard of a transformer layer (Shoeybi et al. 2019, section 3) runs
1/t of the attention heads and of the MLP: the layer's input goes to a column-parallel
projection (q|k|v, the MLP's first), whose output a row-parallel projection (the
attention's output, the MLP's second) turns into partial sums that the group adds up.
Between them nothing is communicated. The functions here are those two ends, and the
vocabulary-parallel cross-entropy of the head. Each records the collectives it runs (op
and bytes as nccl-tests counts them: the buffer of an all-reduce, the gathered output of
an all-gather, the input of a reduce-scatter) in the forward and in the backward, so a
traced shard carries its communication beside its FLOPs and saved bytes.

Without sequence parallelism (``TensorShard.sequence_parallel`` off) Megatron's ``f`` is
the identity forward and an all-reduce of the input gradient backward, ``g`` an all-reduce
forward and the identity backward: two all-reduces per layer each way. With it
(Korthikanti et al. 2022, section 4.2.2) the layer's norms, dropouts and residuals run on
the shard's 1/t of the sequence, ``f`` becomes an all-gather (reduce-scatter backward) and
``g`` a reduce-scatter (all-gather backward). Megatron's column-parallel layer then keeps
the sequence shard of its input for the backward and gathers it again there (its weight
gradient needs the whole input): what Korthikanti's Table 2 counts. DTensor's parallel
styles keep the gathered input instead (``TensorShard.saves_gathered``), as the executor
runs them.

These run under the tracer only, on fake tensors: a shard's collectives are shapes here
(new tensors of the gathered or scattered size), never arithmetic; the executor shards the
same modules with DTensor (``mpsim.models.workloads.qkv_rank_order``). With ``NO_SHARD`` every
function is the identity around the plain layer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mpsim.models.kernels import scoped


@dataclass(frozen=True)
class TensorShard:
    """One rank of a tensor-parallel group of ``degree`` GPUs."""

    degree: int = 1
    sequence_parallel: bool = False
    saves_gathered: bool = False
    """With sequence parallelism: the column-parallel layers keep the gathered input for the
    backward (DTensor's ``ColwiseParallel`` after ``SequenceParallel``) instead of the
    sequence shard (Megatron-LM)."""


NO_SHARD = TensorShard()


@dataclass
class CommProbe:
    """Collectives recorded while tracing one layer: (op, bytes) in forward and backward order."""

    forward: list[tuple[str, int]] = field(default_factory=list)
    backward: list[tuple[str, int]] = field(default_factory=list)


_PROBE: ContextVar[CommProbe | None] = ContextVar("mpsim_comm_probe", default=None)


def recording(probe: CommProbe) -> AbstractContextManager[CommProbe]:
    """Collectives of the shard modules run inside the block are recorded in ``probe``."""
    return scoped(_PROBE, probe)


def _record(backward: bool, op: str, t: Tensor) -> None:
    probe = _PROBE.get()
    if probe is None:
        raise RuntimeError("a tensor-parallel shard module runs under the tracer only (mpsim.models.tracer); the "
                           "executor shards the whole module with DTensor")
    (probe.backward if backward else probe.forward).append((op, t.numel() * t.element_size()))


def _sequence_gathered(x: Tensor, degree: int) -> Tensor:
    return x.new_empty((x.shape[0], x.shape[1] * degree, *x.shape[2:]))


def _sequence_scattered(x: Tensor, degree: int) -> Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // degree, *x.shape[2:]))


class _Copy(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        _record(True, "all-reduce", grad)
        return grad


class _Reduce(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        _record(False, "all-reduce", x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _Gather(torch.autograd.Function):
    """Sequence parallel ``f``: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: Tensor, degree: int) -> Tensor:
        ctx.degree = degree
        out = _sequence_gathered(x, degree)
        _record(False, "all-gather", out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _record(True, "reduce-scatter", grad)
        return _sequence_scattered(grad, ctx.degree), None


class _Scatter(torch.autograd.Function):
    """Sequence parallel ``g``: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: Tensor, degree: int) -> Tensor:
        ctx.degree = degree
        _record(False, "reduce-scatter", x)
        return _sequence_scattered(x, degree)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = _sequence_gathered(grad, ctx.degree)
        _record(True, "all-gather", out)
        return out, None


class _SequenceColumnLinear(torch.autograd.Function):
    """Megatron's column-parallel linear under sequence parallelism: gathers its input,
    keeps only the sequence shard for the backward, gathers it again there for the weight
    gradient and reduce-scatters the input gradient (Korthikanti et al. 2022, 4.2.2)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, degree: int) -> Tensor:
        full = _sequence_gathered(x, degree)
        _record(False, "all-gather", full)
        ctx.degree, ctx.has_bias = degree, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        full = _sequence_gathered(x, ctx.degree)
        _record(True, "all-gather", full)
        grad_full = grad @ weight
        _record(True, "reduce-scatter", grad_full)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return _sequence_scattered(grad_full, ctx.degree), grad_weight, grad_bias, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's cross-entropy over logits split by vocabulary: the row maximum, the sum
    of exponentials and the target's logit are each all-reduced over the group (one fp32
    value per token each); the backward needs no communication. Keeps the softmax of the
    shard's logits (fp32) and the labels."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor) -> Tensor:
        x = logits.float()
        row_max = x.amax(-1, keepdim=True)
        _record(False, "all-reduce", row_max)
        exp = (x - row_max).exp_()
        total = exp.sum(-1, keepdim=True)
        _record(False, "all-reduce", total)
        target = x.gather(-1, labels.unsqueeze(-1))
        _record(False, "all-reduce", target)
        loss = (total.log() + row_max - target).mean()
        softmax = exp.div_(total)
        ctx.dtype = logits.dtype
        ctx.save_for_backward(softmax, labels)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        softmax, labels = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, labels.unsqueeze(-1), 1.0)
        return ((softmax - one_hot) * (grad / labels.numel())).to(ctx.dtype), None


def column_parallel(x: Tensor, linear: nn.Linear, shard: TensorShard) -> Tensor:
    """``linear`` as the column-parallel layer opening a tensor-parallel region."""
    if shard.degree == 1:
        return linear(x)
    if not shard.sequence_parallel:
        return linear(_Copy.apply(x))
    if shard.saves_gathered:
        return linear(_Gather.apply(x, shard.degree))
    return _SequenceColumnLinear.apply(x, linear.weight, linear.bias, shard.degree)


def row_parallel_output(x: Tensor, shard: TensorShard) -> Tensor:
    """The partial sums of a row-parallel layer (or a vocabulary-parallel lookup) added up
    over the group: all-reduced, or reduce-scattered along the sequence."""
    if shard.degree == 1:
        return x
    if shard.sequence_parallel:
        return _Scatter.apply(x, shard.degree)
    return _Reduce.apply(x)


def gather_sequence(x: Tensor, shard: TensorShard) -> Tensor:
    """The whole sequence back from its shards (sequence parallel), else ``f``."""
    if shard.degree == 1:
        return x
    return _Gather.apply(x, shard.degree) if shard.sequence_parallel else _Copy.apply(x)


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, shard: TensorShard) -> Tensor:
    """Mean cross-entropy of logits split by vocabulary over the group (``_VocabParallelCrossEntropy``)."""
    del shard
    return _VocabParallelCrossEntropy.apply(logits, labels)
