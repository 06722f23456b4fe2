"""Mixture-of-experts layers of Hugging Face models, traced under a stated routing assumption.

transformers 5 keeps a layer's routed experts as fused 3-D weights (``gate_up_proj``:
experts x 2f x h, ``down_proj``: experts x h x f) and runs them through an "experts
implementation" chosen by name (``transformers.integrations.moe.ExpertsInterface``), as it
runs attention through ``AttentionInterface``. Every implementation transformers ships
reads the router's choices (``nonzero``, ``where``, a sort and a histogram of them), which
FakeTensor cannot: the shapes depend on the data.

``uniform_experts_forward`` is registered under ``EXPERTS_IMPLEMENTATION`` instead. The
router still runs for real, as the family writes it (its gate linear, softmax or sigmoid
scores, top-k, optional normalisation and scaling: ``MixtralTopKRouter``,
``DeepseekV3TopkRouter`` ...); only which expert each routed copy goes to is assumed:

**Uniform load.** The T tokens' T*k routed copies are spread as evenly as integers allow:
with T*k = q*E + r, r experts take q + 1 copies and E - r take q. With a capacity factor
c (``capacity_factor`` in the config: mpsim's field, as Megatron-Core's
``moe_expert_capacity_factor``), each expert holds at most C = ceil(c * T*k / E) copies
(GShard, Lepikhin et al. 2021, section 2.2; Switch Transformer, Fedus et al. 2022,
section 2.2) and the rest are dropped: none under uniform load when c >= 1.

The copies are gathered expert by expert (``index_select``, as transformers'
``grouped_mm_experts_forward`` gathers them), each group of experts with the same share
runs its MLP as one batched GEMM on its real weights (``bmm``: what a grouped GEMM
computes and keeps; the family's own gate, ``_apply_gate``, SwiGLU or gpt-oss's clamped
GLU), the outputs are scaled by the router's weights and summed per token. So FLOPs,
saved activations and kernel shapes are those of a grouped-GEMM execution at uniform
load; the kernel records hold one GEMM per group of equal shares, with the experts as its
batch.

Llama 4 (``Llama4TextMoe``) keeps its experts outside that interface and runs every
expert on every token, each copy scaled by its sigmoid score (0 where not chosen);
``adopt`` gives the model's MoE blocks ``llama4_moe_forward`` instead, which runs the same
router and shared expert and routes the k chosen copies under uniform load, scaled before
the experts as transformers scales them.

``ExpertProbe`` records, while the tracer's forward runs, what the trace row's expert
fields need (``mpsim.models.trace.LayerRow``: ``experts`` ... ``dispatch_bytes``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import functional as F

from mpsim.models.kernels import scoped, storage_key

EXPERTS_IMPLEMENTATION = "mpsim_uniform"
"""The name ``uniform_experts_forward`` is registered under with transformers."""
ROUTING = "uniform"
K = TypeVar("K", bool, tuple[bool, str])


# --- what the tracer records ---------------------------------------------------------------------


@dataclass
class ExpertProbe:
    """Filled during a traced forward: the routed experts' shape, the GEMM FLOPs they run
    (forward, and backward as the data and weight gradients of each GEMM), the storages
    saved for the backward while they ran, and the bytes of the dispatched copies."""

    experts: int = 0
    top_k: int = 0
    params: int = 0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    dispatch_bytes: int = 0
    saved: dict[int, int] = field(default_factory=dict)
    active: bool = False


_PROBE: ContextVar[ExpertProbe | None] = ContextVar("mpsim_expert_probe", default=None)


def probing(probe: ExpertProbe) -> AbstractContextManager[ExpertProbe]:
    return scoped(_PROBE, probe)


def note_saved(t: Tensor) -> None:
    """Called by the tracer's pack hook: remembers a tensor saved while the experts run."""
    probe = _PROBE.get()
    if probe is not None and probe.active:
        probe.saved.setdefault(storage_key(t), t.untyped_storage().nbytes())


def row_fields(probe: ExpertProbe, saved: dict[int, int]) -> dict[str, Any]:
    """The expert fields of a trace row (``LayerRow``) from ``probe``; none for a dense layer.
    ``saved``: every storage the layer keeps, of which the experts' are a part."""
    if not probe.experts:
        return {}
    return {"experts": probe.experts, "experts_per_token": probe.top_k, "expert_params": probe.params,
            "expert_act_bytes": sum(n for k, n in probe.saved.items() if k in saved),
            "expert_fwd_flops": probe.fwd_flops, "expert_bwd_flops": probe.bwd_flops,
            "dispatch_bytes": probe.dispatch_bytes}


# --- uniform load --------------------------------------------------------------------------------


def capacity(copies: int, experts: int, factor: float | None) -> int | None:
    """Copies one expert holds: ceil(factor * copies / experts) (module doc), or None
    without a capacity factor."""
    return None if factor is None else math.ceil(factor * copies / experts)


def expert_groups(copies: int, experts: int, cap: int | None = None) -> list[tuple[int, int]]:
    """(experts, copies each) of the uniform load (module doc): r experts with q + 1 and
    E - r with q, or every expert with ``cap`` where the capacity is below its share.
    Groups of no copies are kept (their weights are split off but run nothing)."""
    q, r = divmod(copies, experts)
    if cap is not None and cap <= q:
        return [(experts, cap)]
    return [(n, rows) for n, rows in ((r, q + 1), (experts - r, q)) if n]


def kept_copies(copies: int, experts: int, cap: int | None = None) -> int:
    """Routed copies the experts run; the rest (``copies`` minus these) are dropped."""
    return sum(n * rows for n, rows in expert_groups(copies, experts, cap))


# --- the experts implementation ------------------------------------------------------------------


def _split(t: Tensor | None, sizes: list[int]) -> list[Tensor | None]:
    """``t``'s experts split into the groups' (one ``split``: its backward is one concatenation)."""
    if t is None:
        return [None] * len(sizes)
    return [t] if len(sizes) == 1 else list(torch.split(t, sizes))


class _GroupedGemm(torch.autograd.Function):
    """y = x W^T for each expert: x (n, rows, in), W (n, out, in), or W (n, in, out) where
    the family stores it transposed (gpt-oss). Its backward runs the two GEMMs a grouped
    GEMM's backward runs, the data gradient and the weight gradient, this one written in
    the weight's own layout (``bmm``'s own backward writes it transposed, and a copy then
    lays it out as the parameter: traffic a grouped GEMM does not have)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, transposed: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.transposed = transposed
        return torch.bmm(x, weight if transposed else weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        w_in_out = weight if ctx.transposed else weight.transpose(1, 2)
        grad_x = torch.bmm(grad, w_in_out.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(x.transpose(1, 2), grad) if ctx.transposed else torch.bmm(grad.transpose(1, 2), x)
        return grad_x, grad_w, None


def _grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """x (n, rows, in) through n experts' weights (``_GroupedGemm``) and biases; the GEMM's
    FLOPs noted on the probe (forward; backward: data and weight gradients)."""
    out = _GroupedGemm.apply(x, weight, transposed)
    if bias is not None:
        out = out + bias.unsqueeze(1)
    probe = _PROBE.get()
    if probe is not None and probe.active:
        gemm = 2.0 * x.shape[0] * x.shape[1] * x.shape[2] * out.shape[2]
        probe.fwd_flops += gemm
        probe.bwd_flops += gemm * (int(x.requires_grad) + int(weight.requires_grad))
    return out


def _expert_mlp(experts: Any, x: Tensor, up: Tensor, up_bias: Tensor | None, down: Tensor,
                down_bias: Tensor | None) -> Tensor:
    """One group's experts on their copies x (n, rows, h): up (or gate|up), the family's
    gate or activation, down, and a post-expert norm where the family has one."""
    transposed = bool(experts.is_transposed)
    y = _grouped_linear(x, up, up_bias, transposed)
    y = experts._apply_gate(y) if experts.has_gate else experts.act_fn(y)
    y = _grouped_linear(y, down, down_bias, transposed)
    return experts.post_expert_norm(y) if experts.has_post_expert_norm else y


def _weights(experts: Any) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """(up, up bias, down, down bias) of an experts module (``use_experts_implementation``'s
    flags: ``has_gate``, ``has_bias``)."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    up_bias = (experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias) if experts.has_bias else None
    down_bias = experts.down_proj_bias if experts.has_bias else None
    return up, up_bias, experts.down_proj, down_bias


def _run_groups(experts: Any, x: Tensor, groups: list[tuple[int, int]]) -> Tensor:
    """The dispatched copies x (kept, h), expert by expert, through their experts' MLPs."""
    sizes = [n for n, _ in groups]
    parts = zip(*(_split(t, sizes) for t in _weights(experts)), strict=True)
    outs, start = [], 0
    for (n, rows), (up, up_bias, down, down_bias) in zip(groups, parts, strict=True):
        if rows:
            xs = x[start:start + n * rows].view(n, rows, x.shape[-1])
            outs.append(_expert_mlp(experts, xs, up, up_bias, down, down_bias).reshape(n * rows, -1))
            start += n * rows
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _capacity_factor(experts: Any) -> float | None:
    value = getattr(getattr(experts, "config", None), "capacity_factor", None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _copy_weights(top_k_weights: Tensor, kept: int) -> Tensor:
    """The router's weight of each of the ``kept`` copies, token-major as dispatched: (kept, 1)."""
    return top_k_weights.reshape(-1)[:kept].unsqueeze(-1)


def uniform_experts_forward(experts: Any, hidden_states: Tensor, top_k_index: Tensor,
                            top_k_weights: Tensor, scale_inputs: bool = False) -> Tensor:
    """An ``ExpertsInterface`` function: hidden states (T, h) and the router's top-k
    weights (T, k) to the experts' weighted sum per token (T, h), under uniform load (module
    doc). ``top_k_index`` is read for its shape only: which experts were chosen is the
    assumption. The weights scale the experts' outputs, or with ``scale_inputs`` their
    dispatched inputs (Llama 4: ``Llama4TextMoe`` scales ``routed_in``)."""
    tokens, hidden = hidden_states.shape
    k, num = top_k_index.shape[-1], experts.num_experts
    copies = tokens * k
    groups = expert_groups(copies, num, capacity(copies, num, _capacity_factor(experts)))
    kept = sum(n * rows for n, rows in groups)
    probe = _PROBE.get()
    with _noting(probe, experts, k, kept * hidden * hidden_states.element_size()):
        index = torch.arange(kept, device=hidden_states.device) // k
        routed = hidden_states.index_select(0, index)
        if scale_inputs:
            routed = routed * _copy_weights(top_k_weights, kept)
        out = _run_groups(experts, routed, groups)
        weighted = out if scale_inputs else out * _copy_weights(top_k_weights, kept)
        if kept < copies:  # dropped copies add nothing; the residual carries their tokens
            weighted = F.pad(weighted, (0, 0, 0, copies - kept))
        return weighted.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


class _noting:
    """While the experts run: the probe (if any) active, with their shape and dispatch."""

    def __init__(self, probe: ExpertProbe | None, experts: Any, k: int, dispatch: int) -> None:
        self.probe, self.experts, self.k, self.dispatch = probe, experts, k, dispatch

    def __enter__(self) -> None:
        if self.probe is not None:
            p = self.probe
            p.experts, p.top_k, p.dispatch_bytes = self.experts.num_experts, self.k, self.dispatch
            p.params = sum(t.numel() for t in self.experts.parameters())
            p.active = True

    def __exit__(self, *exc: object) -> None:
        if self.probe is not None:
            self.probe.active = False


def register(transformers: Any) -> None:
    """``uniform_experts_forward`` registered with transformers under ``EXPERTS_IMPLEMENTATION``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, uniform_experts_forward)


# --- Llama 4: experts outside the experts interface ----------------------------------------------


class _Llama4Experts:
    """A ``Llama4TextExperts`` seen as ``use_experts_implementation`` sees an experts module,
    for ``uniform_experts_forward``: concatenated gate|up weights stored (in, out), experts
    x h x 2f and experts x f x h (``is_transposed``), SwiGLU as its forward writes it
    (``gate, up = gate_up.chunk(2)``, ``up * act_fn(gate)``), no biases; ``config``: the
    text config (for ``capacity_factor``)."""

    has_gate, has_bias, has_post_expert_norm, is_transposed = True, False, False, True

    def __init__(self, experts: Any, config: Any) -> None:
        self.experts, self.config = experts, config
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj

    def parameters(self) -> Any:
        return self.experts.parameters()

    def _apply_gate(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return up * self.act_fn(gate)


def llama4_moe_forward(block: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """``Llama4TextMoe.forward`` with its routed experts under uniform load. transformers
    runs every expert on every token (``routed_in``: the tokens repeated E times, each copy
    scaled by its sigmoid score, 0 where not chosen: E/k times the routed FLOPs); here the
    router runs as written (``Llama4Router``: top-k of the logits, the sigmoid of those),
    each token's k chosen scores are read back from its (T, E) scores, and its k copies,
    scaled by them as transformers scales its inputs, go through ``uniform_experts_forward``;
    the shared expert runs on every token and the routed outputs are added to it."""
    hidden = hidden_states.reshape(-1, block.hidden_dim)
    scores, logits = block.router(hidden)
    weights, index = scores.topk(block.top_k, dim=1)
    experts = _Llama4Experts(block.experts, block.shared_expert.config)
    routed = uniform_experts_forward(experts, hidden, index, weights, scale_inputs=True)
    out = block.shared_expert(hidden)
    out.add_(routed)
    return out, logits


def adopt(model: Any) -> None:
    """The MoE blocks of ``model`` whose experts transformers does not run through the
    experts interface (Llama 4's ``Llama4TextMoe``) given ``llama4_moe_forward``, on these
    instances only (transformers' classes are left as they are)."""
    for module in model.modules():
        if type(module).__name__ == "Llama4TextMoe":
            module.forward = functools.partial(llama4_moe_forward, module)


# --- the families' MoE shapes --------------------------------------------------------------------


@dataclass(frozen=True)
class MoeFamily:
    """Where a family's config keeps its MoE shape (transformers' config classes), and
    which of its layers are MoE layers (its decoder layer's constructor).

    ``experts`` and ``ffn``: the fields of the routed experts' count and MLP width;
    ``shared``: the shared experts' count and width; ``scoring``: the router's scores;
    ``is_moe``: (config, layer index) -> whether that layer routes to experts."""

    experts: str
    ffn: str
    scoring: str
    is_moe: Callable[[Any, int], bool]
    shared: Callable[[Any], tuple[int, int]] = lambda _c: (0, 0)
    first_dense: Callable[[Any], int] = lambda _c: 0


def _every_layer(_config: Any, _i: int) -> bool:
    return True


def _qwen_sparse(config: Any, i: int) -> bool:
    """Qwen2-MoE and Qwen3-MoE (``Qwen2MoeDecoderLayer``): a layer is sparse unless listed in
    ``mlp_only_layers``, every ``decoder_sparse_step``-th layer counting from 1."""
    return (i not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (i + 1) % config.decoder_sparse_step == 0)


def _deepseek_sparse(config: Any, i: int) -> bool:
    """DeepSeek-V2 and V3 (``DeepseekV2DecoderLayer``, ``DeepseekV3DecoderLayer``): dense
    below ``first_k_dense_replace``, sparse from there on (transformers reads no
    ``moe_layer_freq``; DeepSeek's released configs set it to 1)."""
    return i >= config.first_k_dense_replace


def _qwen2_shared(config: Any) -> tuple[int, int]:
    """Qwen2-MoE's one shared expert, ``shared_expert_intermediate_size`` wide."""
    return 1, config.shared_expert_intermediate_size


def _deepseek_shared(config: Any) -> tuple[int, int]:
    """DeepSeek's ``n_shared_experts``, run as one MLP of their summed width (``DeepseekV3MoE``)."""
    n = config.n_shared_experts or 0
    return n, n * config.moe_intermediate_size


def _llama4_sparse(config: Any, i: int) -> bool:
    """Llama 4 (``Llama4TextDecoderLayer``): a layer is MoE if listed in ``moe_layers``, which
    the config derives from ``interleave_moe_layer_step`` when not given (every step-th
    layer counting from 1: Scout's step 1 makes all 48 MoE, Maverick's 2 every other)."""
    return i in config.moe_layers


def _llama4_shared(config: Any) -> tuple[int, int]:
    """Llama 4's one shared expert (``Llama4TextMoe.shared_expert``), as wide as a routed one."""
    return 1, config.intermediate_size


def _llama4_first_dense(config: Any) -> int:
    return min(config.moe_layers, default=config.num_hidden_layers)


FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily("num_local_experts", "intermediate_size", "softmax", _every_layer),
    "olmoe": MoeFamily("num_experts", "intermediate_size", "softmax", _every_layer),
    "qwen2_moe": MoeFamily("num_experts", "moe_intermediate_size", "softmax", _qwen_sparse, _qwen2_shared),
    "qwen3_moe": MoeFamily("num_experts", "moe_intermediate_size", "softmax", _qwen_sparse),
    "deepseek_v2": MoeFamily("n_routed_experts", "moe_intermediate_size", "softmax", _deepseek_sparse,
                             _deepseek_shared, lambda c: c.first_k_dense_replace),
    "deepseek_v3": MoeFamily("n_routed_experts", "moe_intermediate_size", "sigmoid, group-limited",
                             _deepseek_sparse, _deepseek_shared, lambda c: c.first_k_dense_replace),
    "gpt_oss": MoeFamily("num_local_experts", "intermediate_size", "softmax over the top-k", _every_layer),
    "llama4_text": MoeFamily("num_local_experts", "intermediate_size", "sigmoid of the top-k", _llama4_sparse,
                             _llama4_shared, _llama4_first_dense),
}


def moe_layers(config: Any, layers: int) -> list[bool]:
    """Whether each of ``layers`` layers routes to experts (all False for a dense family)."""
    family = FAMILIES.get(config.model_type)
    return [family is not None and family.is_moe(config, i) for i in range(layers)]


def moe_block(config: Any) -> dict[str, Any] | None:
    """The trace's ``model.moe`` block: the routed and shared experts' shape, the dense layers
    before the first MoE layer, the router's scoring, the capacity factor and the routing
    assumption; None for a dense family."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        return None
    shared, shared_ffn = family.shared(config)
    factor = getattr(config, "capacity_factor", None)
    return {"experts": getattr(config, family.experts), "top_k": config.num_experts_per_tok,
            "shared_experts": shared, "shared_expert_ffn_hidden": shared_ffn,
            "expert_ffn_hidden": getattr(config, family.ffn), "first_dense_layers": family.first_dense(config),
            "scoring": family.scoring, "capacity_factor": factor, "routing": ROUTING}


def routed_copies(block: dict[str, Any], tokens: int) -> tuple[int, int]:
    """(kept, dropped) routed copies of ``tokens`` tokens in one MoE layer (uniform load)."""
    copies, experts = tokens * block["top_k"], block["experts"]
    kept = kept_copies(copies, experts, capacity(copies, experts, block["capacity_factor"]))
    return kept, copies - kept


def representatives(kinds: list[K]) -> dict[K, int]:
    """The first layer of each kind present (dense or MoE, and where the family's layers
    differ otherwise, e.g. Llama 4's RoPE and NoPE attention: ``mpsim.models.hf``), in
    the kinds' order: the blocks that are traced."""
    return {kind: kinds.index(kind) for kind in sorted(set(kinds))}
