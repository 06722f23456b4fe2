"""Trace a Hugging Face model from its config.json: no weights, no hub access.

The model's own ``transformers`` modules run under FakeTensor mode, built with one
transformer block in the recipe's compute dtype. The embedding, that block (repeated for
every layer) and the head (final norm, vocabulary projection, cross-entropy) are traced
as their own layers by ``mpsim.models.tracer.trace_layer``.

Mixture-of-experts families (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and V3,
gpt-oss, Llama 4) run their routed experts through ``mpsim.models.moe``'s experts
implementation (uniform load, the router for real; Llama 4's MoE blocks, whose experts
transformers runs outside its experts interface, through ``moe.llama4_moe_forward``).
Where dense and MoE layers mix (DeepSeek's ``first_k_dense_replace``, Qwen's
``decoder_sparse_step`` and ``mlp_only_layers``, Llama 4's ``moe_layers``) or the
attention differs by layer (Llama 4's NoPE layers: ``_layer_kinds``) the model is built up
to the first block of each kind, each is traced, and each layer index gets its kind's row
(``mpsim.models.moe.moe_layers``: transformers' own rule).

GPU kernel semantics, as ``mpsim.models.kernels`` gives them to mpsim's own layers:

- attention goes through a function registered with transformers' ``AttentionInterface``
  that calls ``kernels.attention`` with the chosen backend (eager, fused-softmax,
  mem-efficient, flash), so the saved tensors are what that CUDA kernel keeps;
- ``torch.nn.functional.dropout`` is redirected to ``kernels.dropout`` (CUDA's fused
  dropout, a 1-byte mask) by a ``TorchFunctionMode``.

Everything else runs as the model writes it, one eager kernel per op, as it would on a
GPU without a compiler: Llama's RMSNorm upcasts to fp32 and keeps fp32 copies, GPT-2's
tanh GELU keeps its intermediate tensors.

A rotary model's cos and sin are built once per forward and read by every block, as the
backbone's forward builds them (``LlamaModel.rotary_emb``): the embedding's row keeps them
once, a block holds them as buffers and so does not count them. The trace's model names
the framework ``hf`` (``mpsim.models.workloads.FRAMEWORKS``): mpsim's own ``hf`` layer keeps the
same bytes (tests/test_hf.py), and a tensor-parallel shard of the trace is re-traced with it.

Ops whose output shape depends on the data (``nonzero``, ``.item()``) cannot run on fake
tensors; they end the trace with an ``MpsimError`` naming the op and the model.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mpsim.errors import MpsimError
from mpsim.models import adapters, kernels, moe
from mpsim.models.finetune import FineTune
from mpsim.models.hf_fields import check_overrides, config_path, read_checked
from mpsim.models.hf_fields import shipped_configs as shipped_configs  # where callers have found it
from mpsim.models.trace import RECIPES, Trace

#: Overrides ``trace_hf`` accepts, mapped to the config's canonical key (each config's
#: ``attribute_map`` turns that into its own, e.g. GPT-2's ``n_layer``).
OVERRIDE_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads"}
ATTN_IMPLEMENTATION = "mpsim"
"""The name ``_mpsim_attention`` is registered under (transformers treats any name with
"flash" in it as a hub kernel, so the backend is not part of it)."""
_BACKEND: ContextVar[kernels.AttentionBackend] = ContextVar("mpsim_hf_backend", default="flash")
_DEFAULT_SEQ_LEN = 4096
"""Sequence length of a model that is no preset: its maximum positions, at most this."""
Kind = tuple[bool, str]
"""A layer's kind: whether it routes to experts, and its attention where that differs by
layer (``_layer_kinds``)."""


@dataclass(frozen=True)
class FamilyLayout:
    """Where a family keeps its layers and how they are called.

    ``base``: the attribute holding the backbone; ``blocks``: the block list inside it;
    ``rotary``: the backbone's rotary-embedding module whose (cos, sin) each block is given,
    or None; ``embed`` and ``head``: tokens -> hidden states and hidden states -> logits,
    with the names (relative to the full model) of the modules they use."""

    family: str
    masked_lm: bool
    base: str
    blocks: str
    rotary: str | None
    embed_modules: tuple[str, ...]
    head_modules: tuple[str, ...]
    embed: Callable[[Any, torch.Tensor], torch.Tensor]
    head: Callable[[Any, torch.Tensor], torch.Tensor]
    required: tuple[str, ...] = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device)


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def _decoder(family: str = "llama", head: Callable[[Any, torch.Tensor], torch.Tensor] | None = None) -> FamilyLayout:
    """Llama's layout, shared by Mistral and Qwen2, and by Phi-3 and Gemma 2 and 3 under
    their own family names (their blocks are not mpsim's Llama layer, so a tensor-parallel
    shard cannot be re-traced with it: ``mpsim.models.tensor_parallel`` refuses them)."""
    return FamilyLayout(family=family, masked_lm=False, base="model", blocks="layers", rotary="rotary_emb",
                        embed_modules=("model.embed_tokens",), head_modules=("model.norm", "lm_head"),
                        embed=lambda m, t: m.model.embed_tokens(t),
                        head=head or (lambda m, x: m.lm_head(m.model.norm(x))), required=_SHAPE_KEYS)


def _soft_capped_head(model: Any, x: torch.Tensor) -> torch.Tensor:
    """Gemma's head: the final norm, the vocabulary projection, and the logits soft-capped
    as its config says (``final_logit_softcapping``: cap x tanh(logits / cap), whose tanh
    keeps a logits-sized tensor for the backward)."""
    logits = model.lm_head(model.model.norm(x))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


#: model_type -> layout.
LAYOUTS: dict[str, FamilyLayout] = {
    "llama": _decoder(),
    "mistral": _decoder(),
    "qwen2": _decoder(),
    "phi3": _decoder("phi3"),
    "gemma2": _decoder("gemma2", _soft_capped_head),
    "gemma3_text": _decoder("gemma3", _soft_capped_head),
    # mixture-of-experts decoders (mpsim.models.moe), under family names of their own
    "mixtral": _decoder("mixtral"),
    "olmoe": _decoder("olmoe"),
    "qwen2_moe": _decoder("qwen2-moe"),
    "qwen3_moe": _decoder("qwen3-moe"),
    "deepseek_v2": _decoder("deepseek-v2"),
    "deepseek_v3": _decoder("deepseek-v3"),
    "gpt_oss": _decoder("gpt-oss"),
    "llama4_text": _decoder("llama4"),
    "gpt2": FamilyLayout(
        family="gpt", masked_lm=False, base="transformer", blocks="h", rotary=None,
        embed_modules=("transformer.wte", "transformer.wpe", "transformer.drop"),
        head_modules=("transformer.ln_f", "lm_head"),
        embed=lambda m, t: m.transformer.drop(m.transformer.wte(t) + m.transformer.wpe(_positions(t))),
        head=lambda m, x: m.lm_head(m.transformer.ln_f(x))),
    "gpt_neox": FamilyLayout(
        family="gpt", masked_lm=False, base="gpt_neox", blocks="layers", rotary="rotary_emb",
        embed_modules=("gpt_neox.embed_in", "gpt_neox.emb_dropout"),
        head_modules=("gpt_neox.final_layer_norm", "lm_head"),
        embed=lambda m, t: m.gpt_neox.emb_dropout(m.gpt_neox.embed_in(t)),
        head=lambda m, x: m.lm_head(m.gpt_neox.final_layer_norm(x)),
        required=_SHAPE_KEYS),
    "bert": FamilyLayout(
        family="bert", masked_lm=True, base="bert", blocks="encoder.layer", rotary=None,
        embed_modules=("bert.embeddings",), head_modules=("cls",),
        embed=lambda m, t: m.bert.embeddings(input_ids=t), head=lambda m, x: m.cls(x),
        required=_SHAPE_KEYS),
}


# --- configs -------------------------------------------------------------------------------------


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise MpsimError("--hf needs Hugging Face transformers: pip install 'mpsim[hf]'") from None
    return transformers


def load_config(source: str, overrides: dict[str, int] | None = None) -> Any:
    """The ``PretrainedConfig`` of SOURCE, built locally from its JSON (never the network);
    ``overrides`` (``trace --hf``'s) only say which fields the caller will replace."""
    path, raw = read_checked(source, overrides)
    if "model_type" not in raw:
        raise MpsimError(f"{path}: no model_type in the config")
    model_type = raw["model_type"]
    if not isinstance(model_type, str) or model_type not in LAYOUTS:
        raise MpsimError(f"{path}: model_type {model_type!r} is not supported; expected one of {', '.join(LAYOUTS)}")
    transformers = _transformers()
    config_class = transformers.CONFIG_MAPPING[model_type]
    aliases = getattr(config_class, "attribute_map", {})
    missing = [k for k in LAYOUTS[model_type].required if k not in raw and aliases.get(k) not in raw]
    if missing:
        raise MpsimError(f"{path}: {model_type} config lacks {', '.join(missing)}")
    try:
        config = config_class.from_dict(raw)
    except Exception as e:  # noqa: BLE001 (transformers' and huggingface_hub's checks raise their own types)
        raise MpsimError(f"{path}: bad {model_type} config: {_one_line(e)}") from None
    for field in ("hidden_act", "activation_function"):
        name = raw.get(field)
        if isinstance(name, str) and name not in transformers.activations.ACT2FN:
            raise MpsimError(f"{path}: {field}: unknown activation {name!r}; transformers has "
                             f"{', '.join(sorted(transformers.activations.ACT2FN))}")
    return config


def _one_line(e: BaseException) -> str:
    """An exception's message on one line: its first lines joined, at most 200 characters."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines()[:3] if line.strip())
    return (text or type(e).__name__)[:200]


def _apply_overrides(config: Any, overrides: dict[str, int], seq_len: int) -> None:
    unknown = set(overrides) - set(OVERRIDE_KEYS)
    if unknown:
        raise MpsimError(f"unknown --hf override(s) {', '.join(sorted(unknown))}: expected {', '.join(OVERRIDE_KEYS)}")
    for key, value in overrides.items():
        setattr(config, OVERRIDE_KEYS[key], value)
    if "hidden" in overrides or "heads" in overrides:
        if config.hidden_size % config.num_attention_heads:
            raise MpsimError(f"bad model shape: hidden {config.hidden_size} is not divisible by heads "
                             f"{config.num_attention_heads}")
        if hasattr(config, "head_dim"):
            config.head_dim = config.hidden_size // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None)
    if kv and config.num_attention_heads % kv:
        raise MpsimError(f"bad model shape: heads {config.num_attention_heads} is not divisible by kv heads {kv}")
    if config.max_position_embeddings < seq_len:  # learned positions need a row per position
        config.max_position_embeddings = seq_len


# --- GPU kernel semantics ------------------------------------------------------------------------


def _mpsim_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: q (b, a, s, d), k and v (b, kv_heads, s, d) to
    (b, s, a, d), as transformers' own functions return it. Blocks are called without a
    mask (training without padding): causal as the module says. Sliding windows
    (Mistral, Gemma's local layers) are not modelled, as in ``mpsim.models.workloads``: their
    kernels keep the same tensors, and the FLOPs counted are the full causal ones. Gemma 2's
    attention soft-capping (``softcap``) runs inside the fused kernel and keeps nothing more,
    nor do gpt-oss's attention sinks (``s_aux``, left out). Llama 4's chunked attention
    (``attention_chunk_size``, 8192 in its releases) is causal attention within each chunk:
    the same as causal up to the chunk size, and counted as fully causal beyond it.
    Multi-head latent attention (DeepSeek-V2 and V3: 192-wide queries and keys, 128-wide
    values) runs as FlashAttention-2 runs it, one head width for all three: the values
    padded with zeros to the queries' width and the output cut back (as transformers'
    DeepSeek code did for flash attention)."""
    if attention_mask is not None:
        raise MpsimError("mpsim attention takes no explicit attention mask (causal or bidirectional only)")
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    v_dim = value.shape[-1]
    if v_dim < query.shape[-1]:  # MLA (DeepSeek): values narrower than queries and keys
        value = F.pad(value, (0, query.shape[-1] - v_dim))
    out = kernels.attention(query, key, value, causal=causal, dropout_p=dropout, training=module.training,
                            backend=_BACKEND.get(), scale=scale)
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


@contextmanager
def _attention_backend(transformers: Any, backend: str) -> Iterator[None]:
    """``_mpsim_attention`` registered, running ``backend``; the uniform-load experts too
    (``mpsim.models.moe``)."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, _mpsim_attention)
    moe.register(transformers)
    token = _BACKEND.set(kernels.check_backend(backend))
    try:
        yield
    finally:
        _BACKEND.reset(token)


@contextmanager
def _config_errors(source: str, model_type: str) -> Iterator[None]:
    """A config whose values transformers accepts but its modules cannot run with (an
    unknown activation, a string where a number belongs) fails while the model is built
    or traced: one line naming the config and what failed, never a traceback."""
    try:
        yield
    except MpsimError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, RuntimeError,
            AssertionError) as e:
        raise MpsimError(f"{config_path(source)}: the {model_type} model cannot be built from this config "
                         f"({type(e).__name__}: {_one_line(e)})") from None


@contextmanager
def _fake_errors(model_type: str) -> Iterator[None]:
    """Data-dependent ops, which FakeTensor cannot run, as one line naming op and model."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        op = getattr(e, "func", None) or str(e)
        raise MpsimError(f"{model_type}: {op} depends on the data, which FakeTensor mode cannot trace; "
                         f"the model cannot be traced with --hf") from None


# --- tracing -------------------------------------------------------------------------------------


def _submodule(model: nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), model)


def _group(model: nn.Module, paths: tuple[str, ...]) -> nn.Module:
    return nn.ModuleList([_submodule(model, p) for p in paths])


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _build(transformers: Any, config: Any, layout: FamilyLayout, dtype: torch.dtype) -> nn.Module:
    auto = transformers.AutoModelForMaskedLM if layout.masked_lm else transformers.AutoModelForCausalLM
    experts = {"experts_implementation": moe.EXPERTS_IMPLEMENTATION} if config.model_type in moe.FAMILIES else {}
    model = auto.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype, **experts)
    moe.adopt(model)
    return model.train()


class _SharedTables(nn.Module):
    """The tables a decoder's rotary embedding builds once per forward and hands to every
    block (``LlamaModel.forward``: ``position_embeddings``), held as buffers: a traced block
    leaves them out of its saved bytes, as it does parameters, since the embedding's row
    keeps them once (``_embed``)."""

    def __init__(self, tables: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        for i, table in enumerate(tables):
            self.register_buffer(f"table{i}", table, persistent=False)


def _embed(model: Any, layout: FamilyLayout, rotary: nn.Module | None, tokens: torch.Tensor) -> torch.Tensor:
    """The embedding and, for a rotary model, the (cos, sin) every block reads, built once
    right after it as the backbone's forward does, kept until the backward."""
    from mpsim.models.workloads import hold_for_backward

    x = layout.embed(model, tokens)
    if not x.requires_grad:  # a frozen embedding (fine-tuning): as PEFT's enable_input_require_grads
        x.requires_grad_(True)
    if rotary is None:
        return x
    tables = _rotary_tables(model.config, rotary, x, _positions(x).unsqueeze(0))
    return hold_for_backward(x, *[t for pair in tables.values() for t in pair])


def _rotary_tables(config: Any, rotary: nn.Module, x: torch.Tensor,
                   positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, ...]]:
    """The (cos, sin) the backbone builds once per forward: one pair, or one per attention
    type where the layers alternate (Gemma 3: local layers with their own RoPE base); or
    the one complex table DeepSeek-V2 builds (``DeepseekV2RotaryEmbedding``: freqs_cis)."""
    types = getattr(config, "layer_types", None)
    if types and "layer_type" in inspect.signature(rotary.forward).parameters:
        return {t: _tables(rotary(x, positions, t)) for t in dict.fromkeys(types)}
    return {None: _tables(rotary(x, position_ids=positions))}


def _tables(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _given(tables: tuple[torch.Tensor, ...]) -> Any:
    """What a block is given as ``position_embeddings``: the (cos, sin) pair, or the one table."""
    return tables[0] if len(tables) == 1 else tables


def _trace_rows(model: Any, layout: FamilyLayout, b: int, s: int, dtype: torch.dtype,
                blocks: dict[Kind, int]) -> tuple[dict, dict[Kind, dict], dict]:
    """The embedding's row, the rows of ``blocks`` (layer index by kind: ``_layer_kinds``)
    and the head's."""
    from mpsim.models.tracer import trace_layer

    base = _submodule(model, layout.base)
    rotary = _submodule(base, layout.rotary) if layout.rotary else None
    tokens = torch.zeros(b, s, dtype=torch.long)
    emb = trace_layer(_group(model, layout.embed_modules), [tokens], lambda _m, t: _embed(model, layout, rotary, t))
    traced = {kind: _trace_block(model, layout, rotary, i, (b, s, dtype)) for kind, i in blocks.items()}

    def run_head(_m: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = layout.head(model, x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    x2 = torch.randn(b, s, model.config.hidden_size, dtype=dtype, requires_grad=True)
    head_modules = _group(model, layout.head_modules)
    head = trace_layer(head_modules, [x2, tokens], run_head, keep_precision=True)
    tied, frozen, frozen_bytes = _tied(_group(model, layout.embed_modules), head_modules)
    return emb, traced, dict(head, params=head["params"] - tied, frozen_params=head["frozen_params"] - frozen,
                             frozen_param_bytes=head["frozen_param_bytes"] - frozen_bytes)


def _tied(embedding: nn.Module, head: nn.Module) -> tuple[int, int, int]:
    """Parameters the head shares with the embedding (a tied output projection,
    ``tie_word_embeddings``): one tensor, counted in the embedding's row only, so that a
    GPU holding both holds it once, as the model does. (all, frozen, frozen bytes)."""
    shared = {id(p) for p in embedding.parameters()}
    tied = [p for p in head.parameters() if id(p) in shared]
    frozen = [p for p in tied if not p.requires_grad]
    return (sum(p.numel() for p in tied), sum(p.numel() for p in frozen),
            sum(p.numel() * p.element_size() for p in frozen))


def _trace_block(model: Any, layout: FamilyLayout, rotary: nn.Module | None, index: int,
                 shape: tuple[int, int, torch.dtype]) -> dict:
    """The row of block ``index``, given the (cos, sin) of its layer type where the layers
    alternate, as the backbone's forward gives them."""
    from mpsim.models.tracer import trace_layer

    b, s, dtype = shape
    block = _submodule(_submodule(model, layout.base), layout.blocks)[index]
    x = torch.randn(b, s, model.config.hidden_size, dtype=dtype, requires_grad=True)
    positions = _positions(x).unsqueeze(0)
    extra: dict[str, Any] = {}
    tables: dict[str | None, tuple[torch.Tensor, ...]] = {}
    if rotary is not None:
        tables = _rotary_tables(model.config, rotary, x, positions)
        types = getattr(model.config, "layer_types", None) or [None]
        own = types[index] if index < len(types) else types[0]
        extra = {"position_ids": positions,
                 "position_embeddings": _given(tables.get(own, next(iter(tables.values()))))}
    shared = _SharedTables(tuple(t for pair in tables.values() for t in pair))
    return trace_layer(nn.ModuleList([block, shared]), [x],
                       lambda _m, x: _first(block(x, attention_mask=None, **extra)))


def _full_params(model: nn.Module, layout: FamilyLayout, per_layer: list[int]) -> int:
    """Unique parameters of the full model: the built model's outside its blocks, plus
    each layer's (``per_layer``: its kind's traced block)."""
    blocks = _submodule(_submodule(model, layout.base), layout.blocks)
    return adapters.logical_params(model) - adapters.logical_params(blocks) + sum(per_layer)


def _moe_info(config: Any, traced: dict[Kind, dict], kinds: list[Kind], tokens: int,
              params: int) -> dict[str, Any]:
    """The model block's ``moe`` (``mpsim.models.moe.moe_block``, with the number of MoE
    layers and the routed copies a layer drops per microbatch under uniform load) and
    ``active_params`` (the routed experts counted top-k of their number); empty for a
    dense model."""
    block = moe.moe_block(config)
    row = next((row for (routed, _attention), row in traced.items() if routed), None)
    if block is None or row is None:
        return {}
    experts, top_k = row["experts"], row["experts_per_token"]
    layers = sum(routed for routed, _attention in kinds)
    idle = layers * row["expert_params"] * (experts - top_k) // experts
    _kept, dropped = moe.routed_copies(block, tokens)
    return {"moe": {**block, "moe_layers": layers, "dropped_copies": dropped}, "active_params": params - idle}


def _decoder_shape(model: Any, layout: FamilyLayout) -> dict[str, Any]:
    """A Llama-layout model's MLP width, q|k|v biases, RoPE base and dropout in
    ``mpsim.models.workloads.ModelConfig``'s terms, so that a tensor-parallel shard of the trace
    (re-traced with mpsim's own hf-framework layer) has the model's shape."""
    if layout.family != "llama":
        return {}
    config = model.config
    attention = _submodule(_submodule(model, layout.base), layout.blocks)[0].self_attn
    rope = getattr(config, "rope_parameters", None) or {}
    return {"ffn_hidden": config.intermediate_size, "qkv_bias": attention.q_proj.bias is not None,
            "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            "dropout": float(getattr(config, "attention_dropout", 0.0))}


def _layer_kinds(config: Any, layers: int) -> list[Kind]:
    """Each layer's kind: MoE or dense (``mpsim.models.moe.moe_layers``) and, for Llama 4,
    RoPE or NoPE attention (``Llama4TextAttention``: ``use_rope = no_rope_layers[i]``; a
    RoPE layer L2-normalises its queries and keys where ``use_qk_norm``, a NoPE layer scales
    its queries by position where ``attn_temperature_tuning``), traced once each."""
    routed = moe.moe_layers(config, layers)
    if config.model_type != "llama4_text":
        return [(r, "") for r in routed]
    rope = list(config.no_rope_layers)
    if len(rope) < layers:
        raise MpsimError(f"llama4_text: no_rope_layers gives {len(rope)} layers' attention, not {layers}: "
                         "give the config's own layer count, or a no_rope_layers for each layer")
    return [(r, "rope" if rope[i] else "nope") for i, r in enumerate(routed)]


def _defaults(source: str) -> tuple[int | None, int, str]:
    """(seq_len, microbatch, recipe) of a preset as ``mpsim.models.workloads.PRESETS`` trains it."""
    from mpsim.models.workloads import PRESETS

    if source in PRESETS:
        cfg, mb, recipe = PRESETS[source]
        return cfg.seq_len, mb, recipe
    return None, 1, "mixed-bf16"


def trace_hf(source: str, microbatch: int | None = None, recipe: str | None = None, attention: str | None = None,
             overrides: dict[str, int] | None = None, name: str | None = None,
             fine_tune: FineTune | None = None) -> Trace:
    """Trace the Hugging Face model of SOURCE (a preset name, a model folder or a
    config.json). ``overrides``: layers, hidden, heads, seq_len (see the module docstring).
    ``fine_tune``: the base frozen (stored quantized for QLoRA) under PEFT's adapters
    (``mpsim.models.adapters.prepare``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mpsim.models.tracer import DTYPES, compute_dtype, make_trace

    transformers = _transformers()
    overrides = dict(overrides or {})
    check_overrides(overrides)
    config = load_config(source, overrides)
    layout = LAYOUTS[config.model_type]
    preset_seq, preset_mb, preset_recipe = _defaults(source)
    seq_len = overrides.pop("seq_len", None) or preset_seq or min(config.max_position_embeddings, _DEFAULT_SEQ_LEN)
    _apply_overrides(config, overrides, seq_len)
    recipe = recipe or preset_recipe
    if recipe not in RECIPES:
        raise MpsimError(f"unknown recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if fine_tune is not None:
        check_fine_tune(fine_tune, recipe, config.model_type)
    backend = attention or kernels.default_attention(None, RECIPES[recipe].compute_dtype)
    layers = config.num_hidden_layers
    kinds = _layer_kinds(config, layers)  # whether each layer routes to experts, its attention
    blocks = moe.representatives(kinds)
    config.num_hidden_layers = max(blocks.values()) + 1  # built up to one block of each kind
    b = microbatch or preset_mb
    with (_config_errors(source, config.model_type), _fake_errors(config.model_type),
          _attention_backend(transformers, backend), compute_dtype(recipe), FakeTensorMode()):
        dtype = DTYPES[RECIPES[recipe].compute_dtype]
        model = _build(transformers, config, layout, dtype)
        if fine_tune is not None:
            adapters.prepare(model, _submodule(_submodule(model, layout.base), layout.blocks), fine_tune)
        emb, traced, head = _trace_rows(model, layout, b, seq_len, dtype, blocks)
        params = _full_params(model, layout, [traced[kind]["params"] for kind in kinds])
    model_info = {"family": layout.family, "model_type": config.model_type, "layers": layers,
                  "hidden": config.hidden_size, "heads": config.num_attention_heads,
                  "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                  "seq_len": seq_len, "vocab": config.vocab_size, "attention": backend, "framework": "hf",
                  **_decoder_shape(model, layout), **_moe_info(config, traced, kinds, b * seq_len, params),
                  "source": f"hf:{config.model_type}"}
    named = [("embedding", "embedding", emb),
             *[(f"layer{i}", "transformer", traced[kind]) for i, kind in enumerate(kinds)], ("head", "head", head)]
    plain = not overrides and microbatch in (None, preset_mb) and preset_seq == seq_len
    default_name = source if plain else f"hf-{config.model_type}-{layers}l-{config.hidden_size}h-{seq_len}s"
    if fine_tune is not None:
        default_name += f"-{fine_tune.method}-r{fine_tune.r}"
    return make_trace(name or default_name, model_info, params, b, recipe, named,  # type: ignore[arg-type]
                      fine_tune=fine_tune)


def check_fine_tune(spec: FineTune, recipe: str, model_type: str) -> None:
    """Refuse, in one line, a fine-tune mpsim does not model: under a low-precision recipe,
    or of a mixture of experts (its experts are batched tensors, not linear layers PEFT
    wraps one by one)."""
    if RECIPES[recipe].low_precision:
        raise MpsimError(f"{spec.method} under recipe {recipe}: fine-tuning is modelled under the 16- and 32-bit "
                         "recipes only; give --recipe mixed-bf16")
    if model_type in moe.FAMILIES:
        raise MpsimError(f"{spec.method} of a mixture of experts ({model_type}) is not modelled yet: its experts "
                         "are batched tensors, not the linear layers PEFT adapts; fine-tune a dense model")
