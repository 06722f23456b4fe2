"""Model traces: per-layer time and bytes for one microbatch size (JSON, ``traces/``).

A trace row is one layer of the pipeline (embedding, transformer layer, loss head). Byte
counts are exact for the traced shapes; times are either measured (``fwd_ms``/``bwd_ms``)
or derived for a GPU from FLOPs and bytes moved (``mpsim.timing.costs``).

Rescaling rule (``scaling.rule = "linear-microbatch"``): activation, output, workspace
bytes, FLOPs, bytes moved and measured times scale linearly with the microbatch size;
parameter, gradient and optimizer bytes do not, nor does the part of the bytes moved that
is the same at any batch (``fwd_fixed_mem_bytes``, ``bwd_fixed_mem_bytes``: a convolution's
weight read and its gradient written, an embedding table's gradient).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from pydantic import ConfigDict, Field, model_validator

from mpsim.datafile import FileModel, read_data_file, validate
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.kernel_records import Kernel, rescale_kernel
from mpsim.hardware.topology import Dtype, GpuSpec
from mpsim.limits import MAX_LAYERS, MAX_MICROBATCH, check_microbatch, check_trace_data
from mpsim.models.finetune import FineTune
from mpsim.units import MAX_BYTES

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 1


MAX_FLOPS = 1e21
"""Per layer and microbatch (a zettaFLOP): far beyond any layer, so times stay finite."""
MAX_MS = 1e7
"""A measured layer time of at most about three hours."""
MAX_PARAMS = 2**50



class Precision(FileModel):
    """Bytes per parameter of a training recipe. Mixed-precision Adam (the default) keeps
    fp16 weights (2) and gradients (2), an fp32 master copy (4) and two fp32 Adam moments
    (8): 16 bytes per parameter."""

    recipe: Literal["mixed-fp16", "mixed-bf16", "mixed-fp16-fp32grad", "mixed-bf16-fp32grad", "fp32", "tf32",
                    "fp8-delayed", "fp8-current", "mxfp8", "fp8-blockwise", "nvfp4"] = "mixed-fp16"
    compute_dtype: Literal["fp16", "bf16", "fp32", "tf32"] = "fp16"
    weight_bytes_per_param: int = Field(default=2, gt=0, le=64)
    grad_bytes_per_param: int = Field(default=2, gt=0, le=64)
    optimizer_bytes_per_param: int = Field(default=12, ge=0, le=256, description="master weights + Adam moments")
    gemm_dtype: Literal["fp8", "fp4"] | None = Field(
        default=None, description="low-precision recipes: the dtype of every GEMM with a weight operand (and of "
                                  "its data and weight gradients); None: the compute dtype")
    quantized_bytes: float = Field(
        default=0.0, ge=0, le=4, description="bytes per element of one quantized copy, scales included")
    quantized_copies: int = Field(
        default=0, ge=0, le=4, description="copies a cast writes (the tensor and its transpose, or rowwise and "
                                           "columnwise); a saved GEMM input keeps one")
    amax_pass: bool = Field(default=False, description="current scaling: the tensor is read once for its amax "
                                                       "before the cast")
    weight_cache_bytes_per_param: float = Field(
        default=0.0, ge=0, le=16, description="quantized weight copies kept from the first microbatch to the last")

    @property
    def low_precision(self) -> bool:
        """Whether the recipe runs its weight GEMMs below the compute dtype (FP8)."""
        return self.gemm_dtype is not None


RECIPES: dict[str, Precision] = {
    "mixed-fp16": Precision(),
    "mixed-bf16": Precision(recipe="mixed-bf16", compute_dtype="bf16"),
    # fp32 gradient accumulation (Megatron-LM's main_grad): the gradient buffer is fp32, 18 bytes a parameter.
    "mixed-fp16-fp32grad": Precision(recipe="mixed-fp16-fp32grad", grad_bytes_per_param=4),
    "mixed-bf16-fp32grad": Precision(recipe="mixed-bf16-fp32grad", compute_dtype="bf16", grad_bytes_per_param=4),
    "fp32": Precision(recipe="fp32", compute_dtype="fp32", weight_bytes_per_param=4, grad_bytes_per_param=4,
                      optimizer_bytes_per_param=8),
    # fp32 storage, matmuls on TF32 tensor cores (Ampere on): the bytes of fp32, the rate of tf32.
    "tf32": Precision(recipe="tf32", compute_dtype="tf32", weight_bytes_per_param=4, grad_bytes_per_param=4,
                      optimizer_bytes_per_param=8),
    # FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): bf16 weights, gradients and the rest of
    # each layer, fp32 master weights and Adam moments (16 bytes a parameter, as mixed-bf16); every GEMM with a
    # weight operand, and its data and weight gradients, on FP8 tensor cores.
    # Transformer Engine's per-tensor delayed scaling: a fused cast-transpose writes each FP8 operand and its
    # transpose (Hopper's FP8 GEMMs take K-major operands), a saved GEMM input is kept in FP8, the weights' FP8
    # copies are cached over an iteration's microbatches.
    "fp8-delayed": Precision(recipe="fp8-delayed", compute_dtype="bf16", gemm_dtype="fp8", quantized_bytes=1.0,
                             quantized_copies=2, weight_cache_bytes_per_param=2.0),
    # Per-tensor current scaling (Transformer Engine's Float8CurrentScaling): an amax pass over each tensor
    # before its cast; otherwise as fp8-delayed.
    "fp8-current": Precision(recipe="fp8-current", compute_dtype="bf16", gemm_dtype="fp8", quantized_bytes=1.0,
                             quantized_copies=2, amax_pass=True, weight_cache_bytes_per_param=2.0),
    # MXFP8 (OCP Microscaling Formats v1.0: blocks of 32 elements share an 8-bit E8M0 scale, 1 + 1/32 bytes an
    # element); Blackwell's MX GEMMs need rowwise and columnwise quantized copies.
    "mxfp8": Precision(recipe="mxfp8", compute_dtype="bf16", gemm_dtype="fp8", quantized_bytes=1.0 + 1 / 32,
                       quantized_copies=2, weight_cache_bytes_per_param=2 * (1.0 + 1 / 32)),
    # DeepSeek-V3's blockwise FP8 (Liu et al. 2024, section 3.3): 1 x 128 activation tiles and 128 x 128 weight
    # blocks with fp32 scales (1 + 4/128 bytes an element), activations cached in FP8 for the backward; the
    # weights cast every microbatch.
    "fp8-blockwise": Precision(recipe="fp8-blockwise", compute_dtype="bf16", gemm_dtype="fp8",
                               quantized_bytes=1.0 + 4 / 128, quantized_copies=2),
    # NVFP4 (Blackwell): 4-bit E2M1 values, one E4M3 scale per 16 elements (0.5 + 1/16 bytes an element) and a
    # per-tensor fp32 scale; every weight GEMM and its gradients in FP4 here (NVIDIA's pretraining recipe keeps
    # a few final layers in bf16, not modelled), rowwise and columnwise copies as MXFP8.
    "nvfp4": Precision(recipe="nvfp4", compute_dtype="bf16", gemm_dtype="fp4", quantized_bytes=0.5 + 1 / 16,
                       quantized_copies=2, weight_cache_bytes_per_param=2 * (0.5 + 1 / 16)),
}
RECIPE_HELP = ("mixed-fp16 / mixed-bf16: 16-bit weights and gradients, fp32 master weights and Adam moments "
               "(16 bytes a parameter); -fp32grad: gradients accumulated in fp32 (18); fp32 (16, no master copy); "
               "tf32: fp32 bytes at tensor-core TF32 rate; fp8-delayed, fp8-current (Transformer Engine's "
               "per-tensor scaling), mxfp8 (Blackwell's 32-element blocks), fp8-blockwise (DeepSeek-V3's tiles): "
               "mixed-bf16's bytes, weight GEMMs on FP8 tensor cores, their saved inputs in FP8; nvfp4: the same "
               "in 4-bit blocks on FP4 tensor cores (Blackwell)")
_RATE_FALLBACK = {"tf32": ("tf32", "fp32"), "bf16": ("bf16", "fp16", "fp32"), "fp16": ("fp16", "fp32"),
                  "fp32": ("fp32",)}


class Source(FileModel):
    kind: Literal["derived", "measured"]
    tool: str = ""
    torch_version: str = ""
    device: str | None = Field(default=None, description="device the times were measured on")


class Scaling(FileModel):
    rule: Literal["linear-microbatch"] = "linear-microbatch"


LayerKind = Literal["embedding", "transformer", "head", "other"]
RECOMPUTABLE: frozenset[str] = frozenset({"transformer", "other"})
"""Kinds of layer a planner may recompute (checkpoint the input, run the forward again before
the backward): a transformer layer, or a block of a ``--module`` trace such as a ResNet
bottleneck (the embedding's input is only token ids; the head runs the loss)."""


CollectiveOp = Literal["all-reduce", "reduce-scatter", "all-gather", "all-to-all", "send-recv"]


class Collective(FileModel):
    """One collective a shard runs over its group: a tensor-parallel shard's over the tensor
    group, on the critical path; a context-parallel shard's over the context group
    (``mpsim.models.context_parallel``). ``n_bytes`` as nccl-tests counts them (all-reduce:
    the buffer; all-gather: the gathered output; reduce-scatter: the input; all-to-all: each
    rank's send buffer; send-recv: what each rank sends its ring successor in one step,
    ``steps`` times, beside the last ``steps`` of the ``steps + 1`` equal parts of the
    pass's attention)."""

    op: CollectiveOp
    n_bytes: int = Field(ge=0, le=MAX_BYTES)
    axis: Literal["tensor", "context"] = Field(default="tensor", description="the mesh axis whose group runs it")
    steps: int = Field(default=1, ge=1, le=1 << 16, description="send-recv: ring steps, one send each")


class LayerRow(FileModel):
    name: str
    kind: LayerKind
    params: int = Field(ge=0, le=MAX_PARAMS)
    param_bytes: int = Field(ge=0, le=MAX_BYTES, description="working-precision weights")
    grad_bytes: int = Field(ge=0, le=MAX_BYTES)
    optimizer_bytes: int = Field(ge=0, le=MAX_BYTES, description="master weights and optimizer moments")
    act_bytes: int = Field(ge=0, le=MAX_BYTES, description="saved for backward, layer input included when saves_input")
    saves_input: bool = Field(description="whether the layer's input is among its saved tensors")
    input_bytes: int = Field(ge=0, le=MAX_BYTES)
    output_bytes: int = Field(ge=0, le=MAX_BYTES, description="what crosses a stage boundary after this layer")
    workspace_bytes: int = Field(
        ge=0, le=MAX_BYTES, description="largest transient tensor of the forward, freed within the layer")
    bwd_workspace_bytes: int | None = Field(
        default=None, ge=0, le=MAX_BYTES,
        description="transient bytes of the backward beyond the input gradient (measured traces); "
                    "absent: taken equal to workspace_bytes")
    fwd_flops: float = Field(ge=0, le=MAX_FLOPS)
    bwd_flops: float = Field(ge=0, le=MAX_FLOPS)
    fwd_mem_bytes: float = Field(
        ge=0, le=MAX_BYTES, description="bytes read and written by the forward's non-matmul ops")
    bwd_mem_bytes: float = Field(ge=0, le=MAX_BYTES)
    fwd_fixed_mem_bytes: float = Field(
        default=0.0, ge=0, le=MAX_BYTES,
        description="part of fwd_mem_bytes that does not grow with the microbatch (weights read)")
    bwd_fixed_mem_bytes: float = Field(
        default=0.0, ge=0, le=MAX_BYTES,
        description="part of bwd_mem_bytes that does not grow with the microbatch: weights read, weight "
                    "gradients written")
    fwd_ms: float | None = Field(default=None, gt=0, le=MAX_MS, description="measured forward time")
    bwd_ms: float | None = Field(default=None, gt=0, le=MAX_MS, description="measured backward time")
    split_dims: list[Literal["batch", "sequence", "hidden"]] = Field(default_factory=list)
    fwd_attention_flops: float = Field(
        default=0.0, ge=0, le=MAX_FLOPS, description="part of fwd_flops run inside a fused attention kernel")
    bwd_attention_flops: float = Field(default=0.0, ge=0, le=MAX_FLOPS, description="part of bwd_flops likewise")
    attention_core_bytes: int = Field(
        default=0, ge=0, le=MAX_BYTES,
        description="part of act_bytes kept by the attention core beyond q, k, v: what selective recompute drops")
    attention_core_flops: float = Field(
        default=0.0, ge=0, le=MAX_FLOPS, description="forward FLOPs of the attention core (selective recompute)")
    attention_core_mem_bytes: float = Field(
        default=0.0, ge=0, le=MAX_BYTES, description="bytes the attention core's non-matmul ops move, forward")
    fwd_collectives: list[Collective] = Field(
        default_factory=list, description="a tensor-parallel shard's collectives in the forward, in order")
    bwd_collectives: list[Collective] = Field(
        default_factory=list, description="a tensor-parallel shard's collectives in the backward, in order")
    fwd_kernels: list[Kernel] = Field(
        default_factory=list, description="the forward's GPU kernels by shape (mpsim.hardware.kernel_records); empty "
                                          "in traces made before kernels were recorded")
    bwd_kernels: list[Kernel] = Field(default_factory=list, description="the backward's GPU kernels by shape")
    experts: int = Field(default=0, ge=0, le=1 << 16, description="routed experts of a mixture-of-experts layer "
                                                                 "(0: a dense layer)")
    experts_per_token: int = Field(default=0, ge=0, le=1 << 16, description="routed experts each token goes to (top-k)")
    expert_params: int = Field(
        default=0, ge=0, le=MAX_PARAMS,
        description="part of params in the routed experts: split over the expert-parallel group, their gradients "
                    "reduced over the expert-data-parallel group only")
    expert_act_bytes: int = Field(
        default=0, ge=0, le=MAX_BYTES, description="part of act_bytes the routed experts save (grows with their load)")
    expert_fwd_flops: float = Field(
        default=0.0, ge=0, le=MAX_FLOPS, description="part of fwd_flops run by the routed experts (uniform routing)")
    expert_bwd_flops: float = Field(default=0.0, ge=0, le=MAX_FLOPS, description="part of bwd_flops likewise")
    frozen_params: int = Field(
        default=0, ge=0, le=MAX_PARAMS,
        description="part of params that does not train (fine-tuning: the base under adapters): no gradient, "
                    "no optimizer state")
    frozen_param_bytes: int = Field(
        default=0, ge=0, le=MAX_BYTES,
        description="part of param_bytes the frozen parameters take as stored (4-bit for a QLoRA base)")
    dispatch_bytes: int = Field(
        default=0, ge=0, le=MAX_BYTES,
        description="bytes of the microbatch's routed token copies sent to their experts (tokens x top-k, or the "
                    "capacity's slots, x hidden x activation bytes): each of the dispatch and combine all-to-alls "
                    "of the forward and of the backward moves this much")

    @model_validator(mode="after")
    def _saved_input_fits(self) -> LayerRow:
        if self.saves_input and self.act_bytes < self.input_bytes:
            raise ValueError("act_bytes must include input_bytes when saves_input is true")
        if self.attention_core_bytes > self.act_bytes:
            raise ValueError("attention_core_bytes is part of act_bytes and cannot exceed it")
        if self.fwd_attention_flops > self.fwd_flops or self.bwd_attention_flops > self.bwd_flops:
            raise ValueError("attention FLOPs are part of fwd_flops and bwd_flops and cannot exceed them")
        if self.fwd_fixed_mem_bytes > self.fwd_mem_bytes or self.bwd_fixed_mem_bytes > self.bwd_mem_bytes:
            raise ValueError("fixed traffic is part of fwd_mem_bytes and bwd_mem_bytes and cannot exceed them")
        if self.expert_params > self.params or self.expert_act_bytes > self.act_bytes:
            raise ValueError("expert_params and expert_act_bytes are parts of params and act_bytes, "
                             "and cannot exceed them")
        if self.frozen_params > self.params or self.frozen_param_bytes > self.param_bytes:
            raise ValueError("frozen_params and frozen_param_bytes are parts of params and param_bytes, and cannot "
                             "exceed them")
        if self.expert_fwd_flops > self.fwd_flops or self.expert_bwd_flops > self.bwd_flops:
            raise ValueError("expert FLOPs are part of fwd_flops and bwd_flops and cannot exceed them")
        if (self.experts == 0) != (self.experts_per_token == 0) or self.experts_per_token > self.experts:
            raise ValueError("a mixture-of-experts layer routes each token to 1..experts of its experts "
                             "(experts and experts_per_token both 0 for a dense layer)")
        if self.experts == 0 and (self.expert_params or self.dispatch_bytes or self.expert_fwd_flops
                                  or self.expert_bwd_flops or self.expert_act_bytes):
            raise ValueError("expert fields need experts > 0")
        return self

    @property
    def is_moe(self) -> bool:
        """Whether the layer routes tokens to experts (a mixture-of-experts layer)."""
        return self.experts > 0

    @property
    def active_params(self) -> float:
        """Parameters one token runs through: the dense part and top-k of the routed experts."""
        if not self.experts:
            return float(self.params)
        return self.params - self.expert_params + self.expert_params * self.experts_per_token / self.experts

    def expert_part(self, n_bytes: int) -> int:
        """The routed experts' part of ``n_bytes`` of this row's parameters, gradients or
        optimizer states (their share of its parameters; 0 for a dense row)."""
        return n_bytes * self.expert_params // self.params if self.params else 0

    @property
    def trained_params(self) -> int:
        """Parameters the optimizer updates (all but the frozen ones)."""
        return self.params - self.frozen_params

    @property
    def trained_param_bytes(self) -> int:
        """Working-precision bytes of the trained parameters: what an optimizer step writes."""
        return self.param_bytes - self.frozen_param_bytes

    @property
    def own_bytes(self) -> int:
        """What recomputing the layer frees per microbatch: its saved activations less the
        input, which the checkpoint keeps (when the input is among them)."""
        return self.act_bytes - (self.input_bytes if self.saves_input else 0)


class TraceFile(FileModel):
    schema_: int = Field(alias="schema")
    name: str
    model: dict = Field(description="family and shape: family, layers, hidden, heads, seq_len, vocab ...")
    params: int = Field(gt=0, le=MAX_PARAMS, description="unique model parameters")
    microbatch: int = Field(gt=0, le=MAX_MICROBATCH)
    precision: Precision = Precision()
    source: Source
    scaling: Scaling = Scaling()
    finetune: FineTune | None = Field(default=None, description="fine-tuning: the adapters and the frozen base's "
                                                                "storage (mpsim.models.finetune); absent: every "
                                                                "parameter trains")
    layers: list[LayerRow] = Field(min_length=1, max_length=MAX_LAYERS)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


_SCALED = ("act_bytes", "input_bytes", "output_bytes", "workspace_bytes", "fwd_flops", "bwd_flops",
           "fwd_attention_flops", "bwd_attention_flops", "attention_core_bytes",
           "attention_core_flops", "attention_core_mem_bytes", "expert_act_bytes", "expert_fwd_flops",
           "expert_bwd_flops", "dispatch_bytes")
_SCALED_OPTIONAL = ("fwd_ms", "bwd_ms", "bwd_workspace_bytes")
_COLLECTIVE_FIELDS = ("fwd_collectives", "bwd_collectives")
"""Only a tensor-parallel shard's rows have them; linear in the batch (they move activations)."""
_KERNEL_FIELDS = ("fwd_kernels", "bwd_kernels")
"""Rescaled kernel by kernel (``kernel_records.rescale_kernel``); left out of the file when empty."""
_LOW_PRECISION_FIELDS = ("gemm_dtype", "quantized_bytes", "quantized_copies", "amax_pass",
                         "weight_cache_bytes_per_param")
"""A recipe's low-precision fields; left out of the file for the 16- and 32-bit recipes."""
_MOE_FIELDS = ("experts", "experts_per_token", "expert_params", "expert_act_bytes", "expert_fwd_flops",
               "expert_bwd_flops", "dispatch_bytes")
"""A mixture-of-experts layer's fields; left out of the file when zero (a dense layer)."""
_FROZEN_FIELDS = ("frozen_params", "frozen_param_bytes")
"""A row's frozen part; left out of the file when zero (every parameter trains)."""
_BYTE_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "act_bytes", "input_bytes", "output_bytes",
                "workspace_bytes", "bwd_workspace_bytes")


class Trace:
    """A validated trace. Immutable; ``rescale`` and ``with_layers`` return new traces."""

    def __init__(self, spec: TraceFile, source: str = "") -> None:
        if spec.schema_ != SCHEMA_VERSION:
            raise SchemaError(source, "schema", f"expected {SCHEMA_VERSION}, got {spec.schema_}")
        rows = spec.layers
        if not any(r.fwd_flops or r.bwd_flops or r.fwd_mem_bytes or r.bwd_mem_bytes or r.fwd_ms or r.bwd_ms
                   for r in rows):
            raise SchemaError(source, "layers", "every layer has zero FLOPs, no bytes moved and no measured time: "
                                                "expected some work to simulate")
        total = sum(getattr(r, k) or 0 for r in rows for k in _BYTE_FIELDS)
        if total > MAX_BYTES:
            raise SchemaError(source, "layers", f"the layers' bytes add up to {total:.3g}, expected at most 1 PiB "
                                                f"({MAX_BYTES}) in all at microbatch {spec.microbatch}")
        self.spec = spec
        self.source = source

    @cached_property
    def content_hash(self) -> str:
        """SHA-256 of the validated contents (not the name or path): equal contents, equal hash."""
        return hashlib.sha256(self.spec.model_dump_json(by_alias=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def layers(self) -> list[LayerRow]:
        return self.spec.layers

    @property
    def n_layers(self) -> int:
        return len(self.spec.layers)

    @property
    def seq_len(self) -> int | None:
        """Tokens per sample (``model.seq_len``); None for a model without one (a CNN)."""
        value = self.spec.model.get("seq_len")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    @property
    def microbatch(self) -> int:
        return self.spec.microbatch

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return any(r.experts for r in self.spec.layers)

    @cached_property
    def active_params(self) -> float:
        """Parameters one token runs through (the total, ``params``, for a dense model): the
        routed experts counted top-k of their number, shared parameters once."""
        return self.spec.params - sum(r.params - r.active_params for r in self.spec.layers)

    @cached_property
    def fwd_flops_total(self) -> float:
        return float(sum(r.fwd_flops for r in self.spec.layers))

    @cached_property
    def model_flops_total(self) -> float:
        """FLOPs of one microbatch's forward and backward, recomputation aside: 3 x the
        forward (Narayanan et al. 2021's model FLOPs); where parameters are frozen, the
        forward and backward the trace records, since a frozen weight's gradient is never
        computed."""
        if any(r.frozen_params for r in self.spec.layers):
            return float(sum(r.fwd_flops + r.bwd_flops for r in self.spec.layers))
        return 3.0 * self.fwd_flops_total

    @cached_property
    def trained_params(self) -> int:
        """Parameters the optimizer updates: all of them but the frozen ones."""
        return self.spec.params - sum(r.frozen_params for r in self.spec.layers)

    def to_frame(self) -> pd.DataFrame:
        """One row per layer, columns as in the file."""
        import pandas as pd  # here only: importing it took half of `import mpsim`

        return pd.DataFrame([r.model_dump() for r in self.spec.layers])

    def to_json(self) -> str:
        """The file's text; a row's collective lists are left out when empty (only
        tensor-parallel shards have them)."""
        data = self.spec.model_dump(by_alias=True)
        if data["finetune"] is None:
            del data["finetune"]
        for k in _LOW_PRECISION_FIELDS:  # left out unless the recipe is a low-precision one
            if not data["precision"][k]:
                del data["precision"][k]
        for row in data["layers"]:
            for k in (*_COLLECTIVE_FIELDS, *_KERNEL_FIELDS, *_MOE_FIELDS, *_FROZEN_FIELDS):
                if not row[k]:
                    del row[k]
            for k in _KERNEL_FIELDS:
                for kernel in row.get(k, ()):
                    if kernel.get("low_precision") is False:  # a GEMM at the compute dtype, as before FP8
                        del kernel["low_precision"]
        return json.dumps(data, indent=1)

    def rescale(self, microbatch: int) -> Trace:
        """The same model at another microbatch size, by the linear rule in the module doc."""
        check_microbatch(microbatch)
        if microbatch == self.microbatch:
            return self
        rows = [scaled_row(r, microbatch / self.microbatch) for r in self.spec.layers]
        return Trace(self.spec.model_copy(update={"layers": rows, "microbatch": microbatch}), self.source)

    def with_layers(self, n_transformer: int) -> Trace:
        """The same family with ``n_transformer`` identical transformer layers: the size knob
        that ``fits`` searches (hidden size, heads and sequence stay as traced). Where dense
        and mixture-of-experts layers mix (DeepSeek's first dense layers), layer i keeps
        the traced layer i's row and the layers past the traced depth repeat the last
        (``_deeper``)."""
        rows = self.spec.layers
        blocks = [r for r in rows if r.kind == "transformer"]
        if not blocks:
            raise MpsimError(f"{self.name}: has no transformer layers to repeat, so its depth cannot be changed "
                             "(a --module trace keeps the depth its builder gave)")
        if n_transformer < 1:
            raise MpsimError(f"{self.name}: cannot set the number of transformer layers to {n_transformer}")
        first = next(i for i, r in enumerate(rows) if r.kind == "transformer")
        last = max(i for i, r in enumerate(rows) if r.kind == "transformer")
        new_blocks = [r.model_copy(update={"name": f"layer{i}"}) for i, r in enumerate(_deeper(blocks, n_transformer))]
        new_rows = rows[:first] + new_blocks + rows[last + 1:]
        delta = sum(r.params for r in new_blocks) - sum(r.params for r in blocks)
        params = self.spec.params + delta
        model = dict(self.spec.model, layers=n_transformer)
        if "active_params" in model:  # the model block's figure (a mixture-of-experts trace), kept true
            model["active_params"] = round(params - sum(r.params - r.active_params for r in new_rows))
        name = f"{self.spec.model.get('family', 'model')}-{n_transformer}l"
        spec = self.spec.model_copy(update={"layers": new_rows, "params": params, "model": model, "name": name})
        return Trace(spec, self.source)

    def rate_dtype(self, gpu: GpuSpec) -> Dtype:
        """The datatype whose peak and efficiencies time this trace on ``gpu``: the compute
        dtype, else the next one down ``_RATE_FALLBACK`` that the GPU lists (bf16 on a V100
        runs at its fp16 rate)."""
        wanted = self.spec.precision.compute_dtype
        return cast(Dtype, next((d for d in _RATE_FALLBACK[wanted] if d in gpu.peak_tflops), "fp32"))


def scaled_row(r: LayerRow, f: float) -> LayerRow:
    """``r`` with ``f`` times its tokens, by the linear rule in the module doc: what grows
    with the tokens times ``f`` (saved and moved bytes, FLOPs, collectives, each kernel's
    token dimension: ``kernel_records.rescale_kernel``), the fixed part of the bytes moved
    as it is. The microbatch rescales rows by it (``Trace.rescale``), and a context shard
    its token-wise part (``mpsim.models.context_parallel``)."""
    upd = {k: (round(getattr(r, k) * f) if isinstance(getattr(r, k), int) else getattr(r, k) * f) for k in _SCALED}
    # bytes moved: the fixed part stays, the rest scales
    upd["fwd_mem_bytes"] = r.fwd_fixed_mem_bytes + (r.fwd_mem_bytes - r.fwd_fixed_mem_bytes) * f
    upd["bwd_mem_bytes"] = r.bwd_fixed_mem_bytes + (r.bwd_mem_bytes - r.bwd_fixed_mem_bytes) * f
    for k in _SCALED_OPTIONAL:
        v = getattr(r, k)
        if v is not None:
            upd[k] = round(v * f) if isinstance(v, int) else v * f
    for k in _COLLECTIVE_FIELDS:
        if getattr(r, k):
            upd[k] = [c.model_copy(update={"n_bytes": round(c.n_bytes * f)}) for c in getattr(r, k)]
    for k in _KERNEL_FIELDS:
        if getattr(r, k):
            upd[k] = [rescale_kernel(kern, f) for kern in getattr(r, k)]
    return r.model_copy(update=upd)


def _deeper(blocks: list[LayerRow], n: int) -> list[LayerRow]:
    """``n`` transformer rows from the traced ``blocks``: the first one repeated where
    every block is of one kind (the traced layer), else the traced layers in order, the
    last repeated past them (mixture-of-experts models with leading dense layers)."""
    if len({r.is_moe for r in blocks}) == 1:
        return [blocks[0]] * n
    return [blocks[min(i, len(blocks) - 1)] for i in range(n)]


_GENERIC_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO", "SXM", "SXM2", "SXM3", "SXM4", "SXM5", "PCIE", "HBM2",
                  "HBM2E", "HBM3", "HBM3E", "NVL", "TI"}


def _device_kind(name: str) -> frozenset[str]:
    """What identifies a device name: {"CPU"}, or the GPU model's numbered words (V100,
    H100, 1080 ...), empty when it names none (TITAN RTX, a hand-written trace)."""
    import re

    if name.strip().lower().startswith("cpu"):
        return frozenset({"CPU"})
    words = {w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w} - _GENERIC_WORDS
    return frozenset(w for w in words if re.search(r"\d", w) and not re.fullmatch(r"\d+GB", w))


def measured_elsewhere(trace: Trace, gpu_model: str, server: str) -> str | None:
    """One line when ``trace`` holds times measured on another kind of device than the
    server's GPUs (a CPU-measured trace simulated on a GPU server, say); else None. The
    measured times are used as they are, so the result describes that device, not the GPU."""
    source = trace.spec.source
    if source.kind != "measured" or not source.device or not any(r.fwd_ms or r.bwd_ms for r in trace.layers):
        return None
    measured, target = _device_kind(source.device), _device_kind(gpu_model)
    if "CPU" in measured | target:
        differ = measured != target
    else:  # two GPUs: different when both are named and share no model number
        differ = bool(measured and target and not measured & target)
    if not differ:
        return None
    return (f"{trace.name}: times measured on {source.device}, but {server} has {gpu_model} GPUs; "
            "the measured times are used as they are")


def _not_a_hf_config(data: object, source: str) -> None:
    """Refuse a Hugging Face config.json given where a trace goes (``--model``) in one line
    with the command that traces it: it has ``model_type`` or ``architectures`` and no
    trace ``schema``, which would otherwise be reported as some thirty missing fields."""
    if not isinstance(data, dict) or "schema" in data:
        return
    key = next((k for k in ("model_type", "architectures") if k in data), None)
    if key is None:
        return
    path = Path(source)
    out = path.with_name(f"{path.stem}-trace.json")
    raise MpsimError(f"{source}: a Hugging Face config.json (it has {key}), not an mpsim trace: trace it "
                     f"with `mpsim trace --hf {shlex.quote(source)} -o {shlex.quote(str(out))}` "
                     f"and give --model {shlex.quote(str(out))}")


def parse_trace(data: object, source: str = "<trace>") -> Trace:
    _not_a_hf_config(data, source)
    check_trace_data(data, source)  # a layer count over the limit in one line, before validating every row
    return Trace(validate(TraceFile, data, source), source)


def read_trace_file(path: Path) -> Trace:
    return parse_trace(read_data_file(path, "json", "trace"), str(path))
