"""A traced model retraced under another recipe or sequence length (``--recipe``,
``--seq-len``): the shape its ``model`` block records traced again under FakeTensor, at its
microbatch; refused in one line for a trace that cannot be (measured, or without a shape
mpsim's modules build). The CLI's options and the cluster search's workers
(``mpsim.studies.scale``) both retrace through here."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mpsim.errors import MpsimError
from mpsim.models.trace import Trace

if TYPE_CHECKING:
    from mpsim.models.workloads import ModelConfig


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
