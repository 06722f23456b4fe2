"""A traced model retraced under another recipe or sequence length (``--recipe``,
``--seq-len``) or fine-tuned (``--lora``, ``--qlora``, ``--peft-config``): the shape its
``model`` block records traced again under FakeTensor, at its
microbatch; refused in one line for a trace that cannot be (measured, or without a shape
mpsim's modules build). The CLI's options and the cluster search's workers
(``mpsim.studies.scale``) both retrace through here."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mpsim.errors import MpsimError
from mpsim.models.trace import Trace

if TYPE_CHECKING:
    from mpsim.models.finetune import FineTune
    from mpsim.models.workloads import ModelConfig

_SHAPE = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
          "vocab": "vocab_size", "ffn_hidden": "intermediate_size", "kv_heads": "num_key_value_heads"}
"""A trace's model block against a config.json: the fields that decide a dense model's shape."""


def at_recipe(trace: Trace, recipe: str | None) -> Trace:
    """``trace``'s model under another training recipe (``--recipe``: bytes per parameter,
    and for the FP8 recipes their GEMMs, casts and saved copies, ``mpsim.models.low_precision``;
    None or its own: ``trace`` itself), retraced under FakeTensor from the shape its ``model``
    block records, at its microbatch and sequence length. Refused in one line for an
    unknown recipe or a trace that cannot be retraced (a Hugging Face trace: trace it with
    ``mpsim trace --hf ... --recipe``)."""
    from mpsim.models.trace import RECIPES

    if recipe is None or recipe == trace.spec.precision.recipe:
        return trace
    if recipe not in RECIPES:
        raise MpsimError(f"--recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    shape = _retraceable(trace, "--recipe", f"under {trace.spec.precision.recipe}", f"under {recipe}",
                         f"--recipe {recipe}")
    from mpsim.models.tracer import trace_model

    return trace_model(shape, trace.microbatch, recipe, f"{trace.name}-{recipe}")


def at_seq_len(trace: Trace, seq_len: int | None) -> Trace:
    """``trace``'s model at ``seq_len`` tokens per sample (``--seq-len``; None or its own
    length: ``trace`` itself), retraced under FakeTensor from the shape its ``model`` block
    records, at its microbatch and recipe. Refused in one line, naming the model and the
    flag, for a model without that shape (a CNN, a ``--module`` or Hugging Face trace), a
    measured trace, or a length past its positions or ``mpsim.limits.MAX_SEQ_LEN``."""
    from mpsim.limits import check_seq_len

    if seq_len is None or seq_len == trace.seq_len:
        return trace
    positions = trace.spec.model.get("max_position_embeddings")
    check_seq_len(seq_len, trace.name, positions if isinstance(positions, int) else None)
    if trace.seq_len is None:
        raise MpsimError(f"--seq-len: {trace.name} has no sequence length (a CNN or a --module trace); it cannot be "
                         "retraced at one")
    shape = _retraceable(trace, "--seq-len", f"at {trace.seq_len} tokens", f"at {seq_len}", f"--seq-len {seq_len}")
    from mpsim.models.tracer import trace_model

    return trace_model(replace(shape, seq_len=seq_len), trace.microbatch, trace.spec.precision.recipe,
                       f"{trace.name}-seq{seq_len}")


def _retraceable(trace: Trace, flag: str, traced: str, asked: str, option: str) -> ModelConfig:
    """The shape ``trace``'s model block records, to retrace it as ``flag`` asks; one line
    naming the flag for a measured trace (``traced``: how it was measured; ``asked``: the
    new setting) or one without a shape mpsim's modules build (with the command that
    traces it, ``option``)."""
    if trace.spec.source.kind == "measured":
        raise MpsimError(f"{flag}: {trace.name} holds times measured {traced}; measure it {asked} "
                         f"(mpsim trace --measure {option}) instead")
    from mpsim.models.workloads import shape_of

    shape = shape_of(dict(trace.spec.model))
    if isinstance(shape, str):
        raise MpsimError(f"{flag}: {trace.name} cannot be retraced {asked}: {shape}; trace it {asked} "
                         f"(mpsim trace ... {option} -o FILE) and give that file as --model")
    return shape


def retraced(trace: Trace, seq_len: int | None = None, recipe: str | None = None,
             fine_tune: FineTune | None = None) -> Trace:
    """``trace`` as ``--seq-len``, ``--recipe`` and the fine-tuning flags ask: through
    mpsim's modules (``at_seq_len``, ``at_recipe``), or for a fine-tune through
    transformers and PEFT at that length and recipe (``at_finetune``)."""
    if fine_tune is None:
        return at_recipe(at_seq_len(trace, seq_len), recipe)
    return at_finetune(trace, fine_tune, seq_len, recipe)


def at_finetune(trace: Trace, spec: FineTune | None, seq_len: int | None = None, recipe: str | None = None,
                name: str | None = None) -> Trace:
    """``trace``'s model fine-tuned as ``spec`` says (``--lora``, ``--qlora``,
    ``--peft-config``; None: ``trace`` itself): the shipped config.json of the same shape
    traced through its transformers modules with PEFT's adapters
    (``mpsim.models.hf.trace_hf``), at the trace's microbatch and attention kernel, at
    ``seq_len`` tokens and under ``recipe`` (default: the trace's). Fine-tuning runs in
    transformers and PEFT, so the layers are theirs (framework ``hf``). Refused in one line
    for a measured trace, one already fine-tuned otherwise, or a model with no shipped
    config of its shape (with the command that traces it). ``name``: the new trace's
    (default: the trace's with the length and the fine-tune appended)."""
    from mpsim.limits import check_seq_len
    from mpsim.models.trace import RECIPES

    if spec is None or (spec == trace.spec.finetune and seq_len in (None, trace.seq_len)
                        and recipe in (None, trace.spec.precision.recipe)):
        return trace
    if recipe is not None and recipe not in RECIPES:
        raise MpsimError(f"--recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    flag = "--qlora" if spec.method == "qlora" else "--lora"
    if trace.spec.finetune is not None:
        raise MpsimError(f"{flag}: {trace.name} is already traced for {trace.spec.finetune.describe()}; give the "
                         "model it was traced from")
    if trace.spec.source.kind == "measured":
        raise MpsimError(f"{flag}: {trace.name} holds measured times; fine-tuning retraces the model, so give a "
                         "shipped model or a traced one")
    config = _shipped_config_of(trace)
    if config is None:
        raise MpsimError(f"{flag}: no shipped Hugging Face config.json has {trace.name}'s shape; trace it with "
                         f"`mpsim trace --hf CONFIG {flag} -o FILE` and give that file as --model")
    from mpsim.models.hf import trace_hf

    length = seq_len or trace.seq_len
    if seq_len is not None:
        positions = trace.spec.model.get("max_position_embeddings")
        check_seq_len(seq_len, trace.name, positions if isinstance(positions, int) else None)
    base = trace.name if length == trace.seq_len else f"{trace.name}-seq{length}"
    return trace_hf(config, trace.microbatch, recipe or trace.spec.precision.recipe, trace.spec.model.get("attention"),
                    {"seq_len": length} if length else {}, name=name or f"{base}-{spec.method}-r{spec.r}",
                    fine_tune=spec)


def _shipped_config_of(trace: Trace) -> str | None:
    """The shipped config.json named as ``trace`` is, else the one whose shape is its
    model's (``_SHAPE``; a mixture of experts never matches), or None."""
    import json

    from mpsim.models.hf_fields import shipped_configs

    shipped = shipped_configs()
    if trace.name in shipped:
        return trace.name
    model = trace.spec.model
    for name, path in shipped.items():
        config = json.loads(path.read_text())
        config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
        if not trace.is_moe and all(model.get(k) == config.get(v) for k, v in _SHAPE.items()):
            return name
    return None
