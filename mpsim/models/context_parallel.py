"""Context-parallel shards of a trace: what one GPU of a context group runs.

Context parallelism splits every sequence of s tokens over the c GPUs of a group
(``mpsim.plans.context_parallel``). Each GPU runs every token-wise op (projections, MLP,
norms, the embedding and the head) on its s/c tokens, so a row's saved bytes, FLOPs and
bytes moved outside attention are 1/c of the unsplit row's (the weights' fixed part of the
bytes moved stays), and its GEMMs are the unsplit ones with their token dimension cut by c
(``kernel_records.rescale_kernel``). Its queries attend over the whole sequence:

- ``ring`` (Liu et al. 2023, Ring Attention; Megatron-Core's context parallelism): the
  sequence is cut into 2c chunks and GPU i holds chunks i and 2c-1-i, so under a causal
  mask every GPU does the same work (Megatron-Core's load balancing; Llama 3, Dubey et al.
  2024, section 3.3.2). Its attention runs as c blocks: its own keys (an s/c x s/c causal
  block) and, for each of the c-1 blocks that come around the ring, half of an s/c x s/c
  block without a mask (both query chunks against the earlier key chunk, or the later
  query chunk against both), each 1/2 (s/c)^2 of work as the diagonal block is: 1/c of
  the whole causal attention, exactly. Each of the c-1 steps sends the keys and values of
  s/c tokens to the ring's next GPU (``send-recv``, ``steps`` c-1) while the block before
  is computed; the backward sends them again with their gradients (twice the bytes), as
  Megatron-Core's (Transformer Engine's) ring backward does. The engine hides each pass's
  sends behind the last (c-1)/c of its attention time and no more
  (``mpsim.sim.context_group``). Two key/value blocks are in flight beside the compute
  (double buffering): the forward's workspace grows by two blocks, the backward's by four.
- ``all-gather`` (Llama 3, section 3.3.2): the keys and values of the whole sequence are
  all-gathered before attention (exposed), the attention runs on the local queries as the
  ring's blocks do (the same work), and the backward gathers them again and
  reduce-scatters their gradients. The gathered keys and values are transient workspace.
- ``all-to-all`` (DeepSpeed-Ulysses, Jacobs et al. 2023): q, k and v of the local tokens go
  out in an all-to-all that leaves each GPU the whole sequence of 1/c of the heads (and of
  the key/value heads), the attention runs on those (the unsplit kernel with heads/c), and
  a second all-to-all returns the output; the backward runs the two in reverse. It needs
  the heads and key/value heads to divide by c.

Every GPU of the group runs the same shard, so the engine simulates the first. A mixture
of experts' routed copies are its own tokens' (1/c of them); the expert-parallel shard is
taken of this one (``mpsim.models.expert_parallel``).
Parameters, gradients and optimizer states are the unsplit row's: the context group holds
the same weights and joins the gradient reduction (``Parallelism.replicas``). Only fused
attention (flash, memory-efficient) splits: eager attention's s x s scores are what
context parallelism exists to avoid. Shards are made once per process and kept
(``SHARDS``).
"""

from __future__ import annotations

from typing import Literal

from mpsim.caches import Lru
from mpsim.errors import MpsimError
from mpsim.hardware.kernel_records import AttentionKernel, Kernel, rescale_kernel
from mpsim.models.trace import Collective, LayerRow, Trace, scaled_row

ContextAttention = Literal["ring", "all-gather", "all-to-all"]
"""How context-parallel attention reaches the keys and values other GPUs hold (module doc)."""

SHARDS = 64
"""Context shards remembered per process."""
_SHARDS: Lru[tuple[object, ...], Trace] = Lru(SHARDS)
_ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4}
"""Bytes per element of q, k, v at a recipe's compute dtype (FP8 recipes keep attention in 16 bits)."""


def check_context_parallel(trace: Trace, degree: int, attention: ContextAttention = "ring", tensor: int = 1) -> None:
    """One-line ``MpsimError`` unless ``trace`` splits over a context group of ``degree``
    (``tensor``: the tensor-parallel degree its heads are split over first)."""
    if degree == 1:
        return
    name, model = trace.name, trace.spec.model
    if "context_parallel" in model:
        raise MpsimError(f"{name} is already one GPU's context-parallel shard; give the whole model's trace")
    kernels = [k for r in trace.layers for k in r.fwd_kernels if isinstance(k, AttentionKernel)]
    if not kernels and not any(r.kind == "transformer" for r in trace.layers):
        raise MpsimError(f"{name} has no attention layers: context parallelism splits a transformer's sequence")
    if not kernels:
        raise MpsimError(f"{name}: context parallelism splits fused attention (flash, mem-efficient) and this trace "
                         "has none: trace it with --attention flash (eager attention keeps the s x s scores)")
    seq = trace.seq_len or kernels[0].s_q
    chunks = 2 * degree if attention != "all-to-all" and kernels[0].causal else degree
    if seq % chunks:
        raise MpsimError(f"{name}: a sequence of {seq} tokens does not split into {chunks} equal chunks "
                         f"(context parallel x{degree}{', causal balance' if chunks > degree else ''})")
    if attention == "all-to-all":
        for what, n in (("attention heads", kernels[0].heads // tensor),
                        ("key/value heads", kernels[0].kv_heads // tensor)):
            if n % degree:
                raise MpsimError(f"{name}: {n} {what} (per tensor-parallel GPU) do not split over context parallel "
                                 f"x{degree}; the all-to-all (Ulysses) splits heads, the ring does not")


def context_shard(trace: Trace, degree: int, attention: ContextAttention = "ring") -> Trace:
    """One GPU's shard of ``trace`` over a context group of ``degree`` (module doc); the
    trace itself when ``degree`` is 1."""
    if degree == 1:
        return trace
    key = (trace.content_hash, degree, attention)
    found = _SHARDS.get(key)
    if found is not None:
        return found
    check_context_parallel(trace, degree, attention)
    element = _ELEMENT_BYTES[trace.spec.precision.compute_dtype]
    rows = [_shard_row(r, degree, attention, element) for r in trace.layers]
    model = dict(trace.spec.model, context_parallel={"degree": degree, "attention": attention})
    return _SHARDS.put(key, Trace(trace.spec.model_copy(update={"layers": rows, "model": model}), trace.source))


def _shard_row(row: LayerRow, c: int, attention: ContextAttention, element: int) -> LayerRow:
    """``row`` on one GPU of the group: its token-wise part 1/c (``trace.scaled_row``), its
    attention split as ``attention`` splits it, its communication added after its
    tensor-parallel collectives."""
    part = scaled_row(row, 1.0 / c)
    upd: dict[str, object] = {"fwd_kernels": _split_kernels(row.fwd_kernels, c, attention),
                              "bwd_kernels": _split_kernels(row.bwd_kernels, c, attention)}
    attn = [k for k in row.fwd_kernels if isinstance(k, AttentionKernel)]
    if attn:
        fwd_add, bwd_add, fwd_ws, bwd_ws = _communication(attn, c, attention, element)
        bwd_workspace = part.workspace_bytes if part.bwd_workspace_bytes is None else part.bwd_workspace_bytes
        upd |= {"fwd_collectives": [*part.fwd_collectives, *fwd_add],
                "bwd_collectives": [*part.bwd_collectives, *bwd_add],
                "workspace_bytes": part.workspace_bytes + fwd_ws, "bwd_workspace_bytes": bwd_workspace + bwd_ws}
    return part.model_copy(update=upd)


def kv_block_bytes(kernel: AttentionKernel, c: int, element: int) -> int:
    """Keys and values of one GPU's s/c tokens: 2 x batch x kv heads x s/c x head dim x
    the element's bytes (``count`` launches of the kernel)."""
    return 2 * kernel.batch * kernel.kv_heads * (kernel.s_k // c) * kernel.head_dim * element * kernel.count


def ulysses_bytes(kernel: AttentionKernel, c: int, element: int) -> tuple[int, int]:
    """What each GPU's two forward all-to-alls send under DeepSpeed-Ulysses: q, k and v of
    its s/c tokens (b x s/c x (heads + 2 kv heads) x head dim), then the attention's output
    (b x s/c x heads x head dim), in the element's bytes; the backward sends the same two."""
    tokens = kernel.batch * (kernel.s_q // c) * kernel.head_dim * element * kernel.count
    return tokens * (kernel.heads + 2 * kernel.kv_heads), tokens * kernel.heads


def _communication(kernels: list[AttentionKernel], c: int, attention: ContextAttention,
                   element: int) -> tuple[list[Collective], list[Collective], int, int]:
    """The forward's and the backward's context collectives of a layer's attention kernels,
    and the workspace each pass's transient buffers add (module doc)."""
    fwd: list[Collective] = []
    bwd: list[Collective] = []
    fwd_ws = bwd_ws = 0
    for k in kernels:
        kv = kv_block_bytes(k, c, element)
        if attention == "ring":
            fwd.append(Collective(op="send-recv", n_bytes=kv, axis="context", steps=c - 1))
            bwd.append(Collective(op="send-recv", n_bytes=2 * kv, axis="context", steps=c - 1))
            fwd_ws, bwd_ws = fwd_ws + 2 * kv, bwd_ws + 4 * kv
        elif attention == "all-gather":
            fwd.append(Collective(op="all-gather", n_bytes=c * kv, axis="context"))
            bwd += [Collective(op="all-gather", n_bytes=c * kv, axis="context"),
                    Collective(op="reduce-scatter", n_bytes=c * kv, axis="context")]
            fwd_ws, bwd_ws = fwd_ws + c * kv, bwd_ws + 2 * c * kv
        else:
            qkv, out = ulysses_bytes(k, c, element)
            fwd += [Collective(op="all-to-all", n_bytes=qkv, axis="context"),
                    Collective(op="all-to-all", n_bytes=out, axis="context")]
            bwd += [Collective(op="all-to-all", n_bytes=out, axis="context"),
                    Collective(op="all-to-all", n_bytes=qkv, axis="context")]
            fwd_ws, bwd_ws = fwd_ws + qkv, bwd_ws + qkv
    return fwd, bwd, fwd_ws, bwd_ws


def _split_kernels(kernels: list[Kernel], c: int, attention: ContextAttention) -> list[Kernel]:
    """A pass's kernels on one GPU: token-wise ones at 1/c of their tokens, attention as
    ``attention`` runs it (``ring_blocks``, or the unsplit kernel on 1/c of the heads)."""
    out: list[Kernel] = []
    for k in kernels:
        if not isinstance(k, AttentionKernel):
            out.append(rescale_kernel(k, 1.0 / c))  # type: ignore[type-var]  # each kind is a K
        elif attention == "all-to-all":
            out.append(k.model_copy(update={"heads": k.heads // c, "kv_heads": k.kv_heads // c}))
        else:
            out += ring_blocks(k, c)
    return out


def ring_blocks(kernel: AttentionKernel, c: int) -> list[AttentionKernel]:
    """``kernel``'s share on one GPU of a ring of ``c`` (module doc): under a causal mask
    one s/c x s/c causal block and c-1 blocks of s/c x s/2c without a mask; without a mask
    c blocks of s/c x s/c. Their FLOPs sum to 1/c of ``kernel``'s."""
    local = kernel.s_q // c
    if not kernel.causal:
        return [kernel.model_copy(update={"s_q": local, "s_k": local, "count": kernel.count * c})]
    diagonal = kernel.model_copy(update={"s_q": local, "s_k": local})
    if c == 1:
        return [diagonal]
    half = kernel.model_copy(update={"s_q": local, "s_k": local // 2, "causal": False,
                                     "count": kernel.count * (c - 1)})
    return [diagonal, half]
