"""A Hugging Face config.json read and its shape checked before anything is built: no
torch, no transformers, so a config asking for too much is refused in one line at once
(``mpsim trace --hf``, the page's uploads).

Every shape field the tracer reads is checked under whichever name the config uses (GPT-2
says ``n_layer`` for ``num_hidden_layers``): a whole number (not a bool, not a string)
within the range below, the field named in the error. The layer count is bounded by the
trace's own limit (``mpsim.limits.MAX_LAYERS``: embedding and head rows included), the
widths by ``MAX_WIDTH`` and friends, tens of times the largest public model's. Fields
transformers checks itself (their types) are reported by ``mpsim.models.hf.load_config`` with
the field it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpsim.datafile import data_dir, read_bounded
from mpsim.errors import MpsimError
from mpsim.limits import MAX_LAYERS

MAX_WIDTH = 1 << 18
"""Hidden and intermediate sizes up to 262,144 (Llama-3-405B: 16,384 and 53,248)."""
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_VOCAB = 1 << 23
"""Vocabularies up to 8,388,608 entries (Gemma's: 256,000)."""
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 1 << 13
"""Routed experts per layer up to 8,192 (DeepSeek-V3: 256, Kimi K2: 384)."""
MOE_MODEL_TYPES = frozenset({"mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
                             "llama4_text"})
"""The mixture-of-experts families ``mpsim.models.moe`` traces."""
#: Fields that say a config has experts (a dense model_type with any of them is refused).
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
              "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts")
#: Counts that may be zero, and their largest values: shared experts, leading dense layers.
ZERO_OR_MORE_FIELDS = {"n_shared_experts": MAX_EXPERTS, "first_k_dense_replace": MAX_LAYERS}
#: Lists of layer indices (Qwen's dense layers, Llama 4's MoE layers) and of 0/1 flags (Llama 4's RoPE layers).
LAYER_LISTS = ("mlp_only_layers", "moe_layers")
FLAG_LISTS = ("no_rope_layers",)
#: Number fields the modules compute with, and their ranges (low, high; both included).
NUMBER_FIELDS: dict[str, tuple[float, float]] = {
    "rope_theta": (1e-6, 1e12), "rms_norm_eps": (0.0, 1.0), "layer_norm_epsilon": (0.0, 1.0),
    "layer_norm_eps": (0.0, 1.0), "norm_eps": (0.0, 1.0), "initializer_range": (0.0, 1e3),
    "attention_dropout": (0.0, 1.0), "hidden_dropout": (0.0, 1.0), "hidden_dropout_prob": (0.0, 1.0),
    "attention_probs_dropout_prob": (0.0, 1.0), "resid_pdrop": (0.0, 1.0), "embd_pdrop": (0.0, 1.0),
    "attn_pdrop": (0.0, 1.0), "partial_rotary_factor": (0.0, 1.0), "rotary_pct": (0.0, 1.0),
    "final_logit_softcapping": (1e-6, 1e6), "attn_logit_softcapping": (1e-6, 1e6),
    "query_pre_attn_scalar": (1e-6, 1e9), "rope_local_base_freq": (1e-6, 1e12),
    "routed_scaling_factor": (1e-6, 1e3), "router_jitter_noise": (0.0, 1.0), "router_aux_loss_coef": (0.0, 1e3),
    "capacity_factor": (1e-3, 1e3), "attn_scale": (0.0, 1e3),
}
#: Fields that name something and must be a string.
NAME_FIELDS = ("model_type", "hidden_act", "activation_function", "torch_dtype", "position_embedding_type")
MAX_CONFIG_DEPTH = 64
"""Nesting deeper than this is refused (real configs nest two or three levels)."""

#: Each shape field: the names configs give it, whether it may be absent or null, and its largest value.
SHAPE_FIELDS: dict[str, tuple[tuple[str, ...], bool, int]] = {
    "num_hidden_layers": (("num_hidden_layers", "n_layer", "num_layers"), False, MAX_LAYERS - 2),
    "hidden_size": (("hidden_size", "n_embd", "d_model"), False, MAX_WIDTH),
    "num_attention_heads": (("num_attention_heads", "n_head", "num_heads"), False, MAX_HEADS),
    "vocab_size": (("vocab_size",), False, MAX_VOCAB),
    "num_key_value_heads": (("num_key_value_heads",), True, MAX_HEADS),
    "intermediate_size": (("intermediate_size", "n_inner", "ffn_dim"), True, MAX_WIDTH),
    "max_position_embeddings": (("max_position_embeddings", "n_positions"), True, MAX_POSITIONS),
    "head_dim": (("head_dim",), True, MAX_HEAD_DIM),
    "sliding_window": (("sliding_window",), True, MAX_POSITIONS),
    # mixture-of-experts shapes (transformers' names: Mixtral, Qwen-MoE, DeepSeek, gpt-oss)
    "num_local_experts": (("num_local_experts", "num_experts", "n_routed_experts"), True, MAX_EXPERTS),
    "num_experts_per_tok": (("num_experts_per_tok", "experts_per_token"), True, MAX_EXPERTS),
    "moe_intermediate_size": (("moe_intermediate_size",), True, MAX_WIDTH),
    "shared_expert_intermediate_size": (("shared_expert_intermediate_size",), True, MAX_WIDTH),
    "decoder_sparse_step": (("decoder_sparse_step",), True, MAX_LAYERS),
    # Llama 4: the dense layers' MLP width, the MoE and NoPE layers' spacing, chunked attention
    "intermediate_size_mlp": (("intermediate_size_mlp",), True, MAX_WIDTH),
    "interleave_moe_layer_step": (("interleave_moe_layer_step",), True, MAX_LAYERS),
    "no_rope_layer_interval": (("no_rope_layer_interval",), True, MAX_LAYERS),
    "attention_chunk_size": (("attention_chunk_size",), True, MAX_POSITIONS),
    "floor_scale": (("floor_scale",), True, MAX_POSITIONS),
    "n_group": (("n_group",), True, MAX_EXPERTS),
    "topk_group": (("topk_group",), True, MAX_EXPERTS),
    # multi-head latent attention (DeepSeek-V2 and V3)
    "q_lora_rank": (("q_lora_rank",), True, MAX_WIDTH),
    "kv_lora_rank": (("kv_lora_rank",), True, MAX_WIDTH),
    "qk_nope_head_dim": (("qk_nope_head_dim",), True, MAX_HEAD_DIM),
    "qk_rope_head_dim": (("qk_rope_head_dim",), True, MAX_HEAD_DIM),
    "v_head_dim": (("v_head_dim",), True, MAX_HEAD_DIM),
}


def shipped_configs() -> dict[str, Path]:
    """The shipped config.json files of public models, by preset name."""
    return {p.stem: p for p in sorted(data_dir("hf_configs").glob("*.json"))}


def config_path(source: str) -> Path:
    """SOURCE as a config.json file: a preset name, a model folder or the file itself."""
    shipped = shipped_configs()
    if source in shipped:
        return shipped[source]
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():  # a FIFO or a device exists: read_config says what it is
        raise MpsimError(f"--hf {source}: no such config.json, model folder or preset "
                         f"(presets: {', '.join(shipped)})")
    return path


def read_checked(source: str, overrides: dict[str, int] | None = None) -> tuple[Path, dict[str, Any]]:
    """SOURCE's config file and its JSON, its shape checked (``check_shape``; the fields
    ``overrides`` replace are checked with their new values by ``mpsim.models.hf``)."""
    path = config_path(source)
    raw = text_model(read_config(path))
    check_shape(raw, str(path), overrides)
    return path, raw


def text_model(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model of a config: a multimodal Llama 4 config (``model_type`` ``llama4``,
    ``Llama4Config``) by its ``text_config`` (``llama4_text``: ``Llama4ForCausalLM``, the
    vision tower and projector left out), any other config as it is. Meta's released Llama 4
    configs write ``attn_temperature_tuning`` as 4, which transformers 5's strict
    ``Llama4TextConfig`` refuses (a bool); its attention reads it as a flag
    (``if self.attn_temperature_tuning``), so a number is read as that flag."""
    text = raw.get("text_config")
    if raw.get("model_type") == "llama4" and isinstance(text, dict):
        raw = {**text, "model_type": text.get("model_type", "llama4_text")}
    flag = raw.get("attn_temperature_tuning")
    if raw.get("model_type") == "llama4_text" and type(flag) in (int, float):
        raw = {**raw, "attn_temperature_tuning": bool(flag)}
    return raw


def check_overrides(overrides: dict[str, int] | None) -> None:
    """``trace --hf``'s shape overrides (``OVERRIDES``) bounded like the fields they set."""
    for key, (field, largest) in OVERRIDES.items():
        if overrides and key in overrides:
            check_count(f"--{key} ({field})", overrides[key], largest)


def precheck(source: str, overrides: dict[str, int] | None = None) -> dict[str, Any]:
    """SOURCE's config read and checked, the overrides too: what ``trace --hf`` and the
    page refuse before torch or transformers is imported."""
    check_overrides(overrides)
    return read_checked(source, overrides)[1]


#: ``trace --hf``'s shape overrides: the field each sets and its largest value.
OVERRIDES = {"layers": ("num_hidden_layers", MAX_LAYERS - 2), "hidden": ("hidden_size", MAX_WIDTH),
             "heads": ("num_attention_heads", MAX_HEADS), "seq_len": ("sequence length", MAX_POSITIONS)}


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object of ``path``, refused in one line when it is not one or nests too deep."""
    raw = read_bounded(path, "config")  # a regular file of bounded size, or one line why not
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MpsimError(f"{path}: cannot read the config ({e})") from None
    depth = _max_depth(text)
    if depth > MAX_CONFIG_DEPTH:
        raise MpsimError(f"{path}: nested {depth} levels deep; a config nests at most {MAX_CONFIG_DEPTH}")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise MpsimError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise MpsimError(f"{path}: not a JSON object")
    return raw


def _max_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest in ``text``, strings skipped (before ``json.loads``,
    which would recurse that deep)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_shape(raw: dict[str, Any], where: str, overrides: dict[str, int] | None = None) -> None:
    """Every field of ``SHAPE_FIELDS`` the config gives: a whole number from 1 to its
    largest (module doc); ``NUMBER_FIELDS`` numbers in their ranges, ``NAME_FIELDS``
    strings; the heads splitting the width (``check_heads``). One line naming the field
    otherwise."""
    for names, optional, largest in SHAPE_FIELDS.values():
        given = [n for n in names if n in raw]
        if not given:
            continue  # missing required fields are named with the model type (mpsim.models.hf.load_config)
        for name in given:
            value = raw[name]
            if value is None and optional:
                continue
            check_count(f"{where}: {name}", value, largest)
    for name, (low, high) in NUMBER_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise MpsimError(f"{where}: {name}: expected a number from {low:g} to {high:g}, got {_shown(value)}")
    for name in NAME_FIELDS:
        if name in raw and raw[name] is not None and not isinstance(raw[name], str):
            raise MpsimError(f"{where}: {name}: expected a name (a string), got {_shown(raw[name])}")
    heads, kv = _value(raw, "num_attention_heads"), _value(raw, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > heads:
        raise MpsimError(f"{where}: num_key_value_heads {kv} is more than num_attention_heads {heads}")
    check_heads(raw, where, overrides)
    check_experts(raw, where)


def check_experts(raw: dict[str, Any], where: str) -> None:
    """A mixture-of-experts config's counts consistent: the shared experts and leading
    dense layers from 0 (``ZERO_OR_MORE_FIELDS``), the layer lists well formed
    (``_check_layer_lists``), top-k at most the experts, the expert groups (DeepSeek's ``n_group``)
    splitting the experts, ``topk_group`` at most ``n_group``; and expert fields only under
    a model_type that has experts (a Mixtral config relabelled ``mistral`` would otherwise
    be traced as a dense model without them)."""
    for name, largest in ZERO_OR_MORE_FIELDS.items():
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= largest):
            raise MpsimError(f"{where}: {name}: expected a whole number from 0 to {largest:,}, got {_shown(value)}")
    _check_layer_lists(raw, where)
    _check_routing(raw, where)
    model_type = raw.get("model_type")
    given = [f for f in MOE_FIELDS if raw.get(f) is not None]
    if isinstance(model_type, str) and model_type not in MOE_MODEL_TYPES and given:
        raise MpsimError(f"{where}: mixture-of-experts fields ({', '.join(given)}) under model_type {model_type!r}, "
                         "which has no experts: it would be traced as a dense model; give the model_type of its "
                         f"family ({', '.join(sorted(MOE_MODEL_TYPES))})")


def _check_layer_lists(raw: dict[str, Any], where: str) -> None:
    """Qwen's ``mlp_only_layers`` and Llama 4's ``moe_layers``: lists of layer indices;
    Llama 4's ``no_rope_layers``: a 0 or 1 per layer (``Llama4TextConfig``)."""
    for name in LAYER_LISTS:
        listed = raw.get(name)
        if listed is not None and (not isinstance(listed, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in listed)):
            raise MpsimError(f"{where}: {name}: expected a list of layer indices, got {_shown(listed)}")
    for name in FLAG_LISTS:
        flags = raw.get(name)
        if flags is not None and (not isinstance(flags, list) or len(flags) > MAX_LAYERS
                                  or not all(type(f) is int and f in (0, 1) for f in flags)):
            raise MpsimError(f"{where}: {name}: expected a list of 0 and 1 per layer, got {_shown(flags)}")


def _check_routing(raw: dict[str, Any], where: str) -> None:
    """Top-k within the experts, and DeepSeek's expert groups within them (``check_experts``)."""
    experts, top_k = _value(raw, "num_local_experts"), _value(raw, "num_experts_per_tok")
    names = {f: next((n for n in SHAPE_FIELDS[f][0] if n in raw), f) for f in ("num_local_experts",
                                                                             "num_experts_per_tok")}
    if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
        raise MpsimError(f"{where}: {names['num_experts_per_tok']} {top_k} is more than "
                         f"{names['num_local_experts']} {experts}: each token goes to top-k of the experts")
    groups, top_groups = raw.get("n_group"), raw.get("topk_group")
    if isinstance(experts, int) and isinstance(groups, int) and experts % groups:
        raise MpsimError(f"{where}: n_group {groups} does not divide {names['num_local_experts']} {experts} "
                         "into equal expert groups")
    if isinstance(groups, int) and isinstance(top_groups, int) and top_groups > groups:
        raise MpsimError(f"{where}: topk_group {top_groups} is more than n_group {groups}")


def check_heads(raw: dict[str, Any], where: str, overrides: dict[str, int] | None = None) -> None:
    """The attention heads split the width evenly: without a ``head_dim`` of its own a head
    gets ``hidden_size / num_attention_heads`` features, so the heads must divide the hidden
    size (else Phi-3's attention, say, fails deep in torch with a broadcast error; a family
    that takes ``head_dim`` and refuses it anyway says so through ``mpsim.models.hf.load_config``);
    the key-value heads must divide the heads (each serves as many query heads). Fields
    that ``overrides`` replace (``trace --hf --hidden/--heads``) are left to ``mpsim.models.hf``,
    which checks them with their new values."""
    if overrides and ("hidden" in overrides or "heads" in overrides):
        return
    hidden, heads, kv = (_value(raw, f) for f in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if not (isinstance(hidden, int) and isinstance(heads, int)):
        return  # absent (named with the model type by mpsim.models.hf.load_config)
    names = {f: next(n for n in SHAPE_FIELDS[f][0] if n in raw) for f in ("hidden_size", "num_attention_heads")}
    if _value(raw, "head_dim") is None and hidden % heads:
        raise MpsimError(f"{where}: {names['hidden_size']} {hidden} is not divisible by "
                         f"{names['num_attention_heads']} {heads}: each head gets {names['hidden_size']} / "
                         f"{names['num_attention_heads']} features")
    if isinstance(kv, int) and heads % kv:
        raise MpsimError(f"{where}: {names['num_attention_heads']} {heads} is not a multiple of "
                         f"num_key_value_heads {kv}: each key-value head serves as many query heads")


def check_count(label: str, value: Any, largest: int) -> None:
    """``value`` a whole number from 1 to ``largest``; ``label`` names it in the error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MpsimError(f"{label}: expected a whole number, got {_shown(value)}")
    if not 1 <= value <= largest:
        raise MpsimError(f"{label}: expected 1 to {largest:,}, got {_shown(value)}")


def _value(raw: dict[str, Any], canonical: str) -> Any:
    names = SHAPE_FIELDS[canonical][0]
    return next((raw[n] for n in names if n in raw), None)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
