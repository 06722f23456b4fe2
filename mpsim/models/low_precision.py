"""Low-precision (FP8) recipes in a trace: which GEMMs run in FP8, the casts that feed them,
and what the backward keeps of their inputs.

Under a recipe with a ``gemm_dtype`` (``mpsim.models.trace.RECIPES``: ``fp8-delayed``,
``fp8-current``, ``mxfp8``, ``fp8-blockwise``) the tracer (``mpsim.models.tracer.trace_layer``)
runs the layer as the recipe's framework does (Transformer Engine's ``Linear``, DeepSeek-V3's
FP8 framework, Liu et al. 2024, section 3.3):

- **Which GEMMs.** A forward GEMM with a weight operand (a linear layer, an expert's
  batched GEMM) runs in FP8, and so do its data gradient (the GEMM with the weight in the
  backward) and its weight gradient (the backward GEMM that reads its saved input).
  GEMMs between two activations (eager attention's scores) stay in the compute dtype;
  fused attention kernels are not touched; so do the output head (``trace_layer``'s
  ``keep_precision``) and the MoE routers (``routers``), as DeepSeek-V3 keeps the
  embedding, the head and the gating in their original precision (section 3.3).
- **Casts.** Each FP8 operand is cast first, a memory-bound kernel recorded beside the
  GEMM: it reads the tensor (twice under current scaling, whose amax pass reads it before
  the cast) and writes ``quantized_copies`` copies of ``quantized_bytes`` an element (the
  tensor and its transpose; MX's rowwise and columnwise blocks). Forward: the input and the
  weight (every microbatch: the kernel is counted even where a framework caches the
  weight's copy); backward: the output's gradient, before the data-gradient GEMM.
- **Saved inputs.** A saved tensor that the backward reads only in FP8 GEMMs is kept as one
  quantized copy (``quantized_bytes`` an element); one that other backward kernels read too
  (the attention output, which the attention kernel's backward reads in bf16) is kept as it
  was plus one quantized copy. The layer's own input is always kept whole (pipeline
  checkpoints and recomputation keep it).
- **Weight copies** cached over an iteration (``weight_cache_bytes_per_param``) are counted by
  the engine as a buffer beside the weights (``mpsim.sim.program.static_bytes``).

Which kernels read a saved tensor is seen in the backward itself (the dispatch of each op
and its operands' storages), so the rule needs no list of modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from mpsim.models.kernels import storage_key
from mpsim.models.trace import Precision

_RECIPE: ContextVar[Precision | None] = ContextVar("mpsim_low_precision", default=None)


@contextmanager
def recipe(precision: Precision) -> Iterator[None]:
    """Trace under ``precision``: FP8 GEMMs, casts and saved copies when it is low precision."""
    token = _RECIPE.set(precision if precision.low_precision else None)
    try:
        yield
    finally:
        _RECIPE.reset(token)


def active() -> Precision | None:
    """The low-precision recipe being traced, or None."""
    return _RECIPE.get()


ROUTER_NAMES = frozenset({"gate", "router"})
"""What a mixture of experts' router module is called in transformers' MoE blocks (Mixtral,
Qwen, OLMoE, DeepSeek: ``gate``; gpt-oss, Llama 4: ``router``); its GEMM stays in the compute
dtype, as DeepSeek-V3 keeps its gating (section 3.3.1) and Megatron-Core its router."""


def routers(module: torch.nn.Module) -> set[int]:
    """Storages of the weights of ``module``'s MoE routers (``ROUTER_NAMES``)."""
    return {storage_key(p) for name, sub in module.named_modules() if name.rsplit(".", 1)[-1] in ROUTER_NAMES
            for p in sub.parameters(recurse=False)}


@dataclass
class LowPrecisionProbe:
    """One layer's FP8 GEMMs: the weights' storages, the storages of the forward FP8 GEMMs'
    activation inputs, and, in the backward, which saved storages which kernels read."""

    precision: Precision
    params: set[int]
    kept: set[int] = field(default_factory=set)
    """Weights whose GEMMs stay in the compute dtype (the MoE routers, ``routers``)."""
    inputs: set[int] = field(default_factory=set)
    """Storages of the forward FP8 GEMMs' activation operands."""
    gemm_reads: set[int] = field(default_factory=set)
    other_reads: set[int] = field(default_factory=set)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, backward: bool) -> tuple[bool, int]:
        """Whether the GEMM of ``a`` and ``b`` runs in FP8, and the bytes its casts move
        (module doc)."""
        keys = (storage_key(a), storage_key(b))
        if any(k in self.kept for k in keys):
            return False, 0
        weight = [t for t, k in zip((a, b), keys, strict=True) if k in self.params]
        if not backward:
            if not weight:
                return False, 0
            others = [t for t, k in zip((a, b), keys, strict=True) if k not in self.params]
            self.inputs.update(storage_key(t) for t in others)
            return True, sum(self.cast_bytes(t) for t in (*others, *weight))
        if weight:  # the data gradient: the output's gradient is cast
            grad = next(t for t, k in zip((a, b), keys, strict=True) if k not in self.params)
            return True, self.cast_bytes(grad)
        return any(k in self.inputs for k in keys), 0  # the weight gradient reads the saved FP8 copies

    def cast_bytes(self, t: torch.Tensor) -> int:
        """Bytes one cast of ``t`` moves: its reads (two under current scaling) and its copies."""
        p = self.precision
        n = t.numel()
        reads = n * t.element_size() * (2 if p.amax_pass else 1)
        return reads + round(n * p.quantized_bytes * p.quantized_copies)

    def backward_read(self, key: int, by_fp8_gemm: bool) -> None:
        (self.gemm_reads if by_fp8_gemm else self.other_reads).add(key)

    def saved_bytes(self, saved: dict[int, int], itemsize: dict[int, int], keep_whole: set[int]) -> dict[int, int]:
        """``saved`` (storage -> bytes) as the recipe keeps it (module doc)."""
        out = {}
        for k, n in saved.items():
            if k not in self.gemm_reads or k in keep_whole:
                out[k] = n
                continue
            copy = round(n / itemsize[k] * self.precision.quantized_bytes)
            out[k] = n + copy if k in self.other_reads else copy
        return out
