"""Tensor-parallel shards of a plan's stages in the executor (plan schema 3, ``tensor_parallel``).

Each stage of each replica runs on a group of ``t`` processes, rank ``(replica * stages +
stage) * t + i`` (tensor innermost, Megatron-LM's order) on GPU ``groups[r][s][i]``. Every
process builds the stage's whole layers (the same seed, so the same weights as one GPU
would have), reorders the rows of the fused projections (``workloads.qkv_rank_order``,
``gate_up_rank_order``) so that row shard ``i`` is rank ``i``'s heads, and shards them with
DTensor's ``parallelize_module`` over the group's ``tp`` mesh, as torchtitan shards Llama:

- attention and MLP (Shoeybi et al. 2019, section 3): ``ColwiseParallel`` on ``attn.qkv``
  and ``fc`` (1/t of the heads, of the MLP), ``RowwiseParallel`` on ``attn.proj`` and
  ``out`` (partial sums, all-reduced); the modules' own forwards run on the local shards;
- embedding: ``RowwiseParallel(input_layouts=Replicate())`` on ``Embedding.word``, 1/t of
  the vocabulary's rows; the lookups are all-reduced (Megatron-LM's vocabulary-parallel
  embedding);
- head: ``ColwiseParallel`` on ``LossHead.decoder`` (1/t of the vocabulary) whose logits
  stay a DTensor sharded over the vocabulary, and the head's ``F.cross_entropy`` under
  ``loss_parallel()`` (torch's vocabulary-parallel cross-entropy: the row maxima, sums and
  target logits reduced over the group);
- with sequence parallelism (Korthikanti et al. 2022, section 4.2.2): ``SequenceParallel``
  on ``ln1``, ``ln2`` and the head's norm (their weights replicated, their gradients
  reduced); the column-parallel layers take a sequence shard (``input_layouts=Shard(1)``)
  and all-gather it, the row-parallel ones reduce-scatter along the sequence
  (``output_layouts=Shard(1)``), the embedding's lookups too; residuals and dropouts run on
  the shard, and the pipeline sends a stage's shard to the next stage's same rank.

What differs from Megatron-LM: DTensor's column-parallel layers keep the all-gathered input
for the backward, where Megatron keeps the shard and gathers it again
(``TensorShard.saves_gathered``, which the simulator sets for this runtime). DTensor's
embedding backward builds the whole table's gradient (``keep_sharded_grad``), and
``loss_parallel``'s log-softmax holds one more fp32 logits shard at its forward peak than
Megatron's in-place cross-entropy: temporaries the simulator does not have
(reports/validation_tp_cpu.md). The GPT's
learned position table is replicated: under sequence parallelism each rank adds the rows of
its own part of the sequence (``SequencePositions``) and the table's gradient is summed over
the group (Megatron adds the positions to the whole sequence before scattering it). BERT is
not run with tensor parallelism (its post-norm embedding and masked-LM head are not
sharded here). Data parallelism over the shards is FSDP2's (``data_parallel``, on the
``dp`` mesh of the same world).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from mpsim.models.workloads import (
    Embedding,
    LossHead,
    ModelConfig,
    TransformerLayer,
    gate_up_rank_order,
    qkv_rank_order,
)
from mpsim.plans.plan import TensorParallelPlan

Sharder = Callable[[nn.Module], nn.Module]
"""Shards one layer of a stage in place (``layer_sharder``)."""


def _reorder_rows(linear: nn.Linear, order: torch.Tensor) -> None:
    """Permute a fused projection's output rows (weight and bias) to ``order``."""
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel styles of a ``TransformerLayer`` (module doc)."""
    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "fc": ColwiseParallel(), "out": RowwiseParallel()}
    seq = Shard(1)
    return {"ln1": SequenceParallel(use_local_output=True), "attn.qkv": ColwiseParallel(input_layouts=seq),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "ln2": SequenceParallel(use_local_output=True), "fc": ColwiseParallel(input_layouts=seq),
            "out": RowwiseParallel(output_layouts=seq)}


def head_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel styles of a ``LossHead``: logits stay sharded over the vocabulary (a
    DTensor) for ``loss_parallel``."""
    if not sequence_parallel:
        return {"decoder": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return {"norm": SequenceParallel(use_local_output=True),
            "decoder": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def embedding_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The parallel style of an ``Embedding``'s word table (rows: the vocabulary)."""
    out = Shard(1) if sequence_parallel else Replicate()
    return {"word": RowwiseParallel(input_layouts=Replicate(), output_layouts=out)}


class SequencePositions:
    """A learned position table under sequence parallelism: ``Embedding`` looks up
    ``arange(s / t)`` for its shard of the sequence; this pre-hook moves the lookup to the
    rank's own rows (``rank * s / t`` on), and a gradient hook sums the table's gradient
    over the group (each rank's covers its rows only)."""

    def __init__(self, table: nn.Embedding, mesh: DeviceMesh) -> None:
        self.rank = mesh.get_local_rank()
        self.group = mesh.get_group()
        table.register_forward_pre_hook(self._shift)
        table.weight.register_hook(self._sum_over_group)

    def _shift(self, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        (positions,) = args
        return (positions + self.rank * positions.numel(),)

    def _sum_over_group(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad


def keep_sharded_grad(weight: torch.Tensor) -> None:
    """Give a vocabulary-sharded table's gradient the table's own placement (its rows on this
    rank). DTensor's embedding backward has no row-sharded rule: from the replicated output
    gradient it computes the whole table's gradient, replicated; the hook keeps the rank's
    rows (a local slice, no communication) before the gradient is accumulated, so only the
    backward's temporary is whole (Megatron-LM computes the rank's rows only)."""
    assert isinstance(weight, DTensor)
    mesh, placements = weight.device_mesh, weight.placements

    def to_shard(grad: torch.Tensor) -> torch.Tensor:
        assert isinstance(grad, DTensor)
        return grad.redistribute(mesh, placements)

    weight.register_hook(to_shard)


_Strategies = list[tuple[list[Placement | None], list[Placement | None]]]


@functools.cache
def register_rms_norm_sharding() -> None:
    """DTensor sharding rules for ``mpsim.models.kernels``' RMSNorm on the CPU (a custom op that
    ``SequenceParallel`` runs on sequence shards; on CUDA torch's own ``F.rms_norm`` runs):
    the rows may be sharded on any dimension but the normalised one, the weight replicated;
    backward, the weight's gradient is then a partial sum."""

    def strategies(ndim: int, forward: bool) -> _Strategies:
        out: _Strategies = [([Replicate(), Replicate()],
                             [Replicate(), Replicate(), None] if forward else [Replicate()] * 4)]
        for d in range(ndim - 1):
            if forward:
                out.append(([Shard(d), Shard(d)], [Shard(d), Replicate(), None]))
            else:
                out.append(([Shard(d), Partial()], [Shard(d), Shard(d), Replicate(), Shard(d)]))
        return out

    @register_sharding(torch.ops.mpsim.rms_norm.default)
    def _forward(x, weight, eps) -> _Strategies:
        return strategies(x.ndim, True)

    @register_sharding(torch.ops.mpsim.rms_norm_backward.default)
    def _backward(grad, x, weight, rstd) -> _Strategies:
        return strategies(x.ndim, False)


def shard_layer(layer: nn.Module, cfg: ModelConfig, tp: TensorParallelPlan, mesh: DeviceMesh) -> nn.Module:
    """``layer`` (an ``Embedding``, ``TransformerLayer`` or the executor's head, whose
    ``head`` is a ``LossHead``) sharded over ``mesh`` in place (module doc)."""
    sp = tp.sequence_parallel
    if sp and cfg.family == "llama":
        register_rms_norm_sharding()
    if isinstance(layer, TransformerLayer):
        _reorder_rows(layer.attn.qkv, qkv_rank_order(cfg, tp.degree))
        if cfg.family == "llama":
            _reorder_rows(layer.fc, gate_up_rank_order(cfg, tp.degree))
        return parallelize_module(layer, mesh, layer_plan(sp))
    if isinstance(layer, Embedding):
        if sp and layer.position is not None:
            SequencePositions(layer.position, mesh)
        parallelize_module(layer, mesh, embedding_plan(sp))
        keep_sharded_grad(layer.word.weight)
        return layer
    head = getattr(layer, "head", None)
    if isinstance(head, LossHead):
        parallelize_module(head, mesh, head_plan(sp))
        return layer
    raise TypeError(f"no tensor-parallel plan for {type(layer).__name__}")


def layer_sharder(cfg: ModelConfig, tp: TensorParallelPlan | None, mesh: DeviceMesh | None) -> Sharder | None:
    """What ``build_stage`` applies to each layer before the plan's actions (None: no tensor
    parallelism)."""
    if tp is None:
        return None
    assert mesh is not None

    def shard(layer: nn.Module) -> nn.Module:
        return shard_layer(layer, cfg, tp, mesh)

    return shard


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The head's loss as a plain tensor (``loss_parallel`` returns a replicated DTensor),
    which is what the pipeline's stage returns."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def step_context(tp: TensorParallelPlan | None) -> AbstractContextManager[object]:
    """Around a pipeline step (forward and backward): ``loss_parallel`` with tensor
    parallelism, so the head's cross-entropy runs on the vocabulary shards."""
    return loss_parallel() if tp is not None else nullcontext()


def stage_sequence(cfg: ModelConfig, tp: TensorParallelPlan | None) -> int:
    """Sequence length of the hidden states a stage sends and receives: the shard's 1/t
    under sequence parallelism."""
    if tp is not None and tp.sequence_parallel:
        return cfg.seq_len // tp.degree
    return cfg.seq_len
