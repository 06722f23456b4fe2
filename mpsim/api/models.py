"""Models: the shipped presets, and traces made from a preset or a shape (GPT, BERT,
Llama-style), from any PyTorch module cut into layers, or from a Hugging Face config.
Tracing runs under torch, imported when a trace is made."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mpsim.data.catalog import load_topology
from mpsim.errors import MpsimError
from mpsim.models.finetune import FineTune
from mpsim.models.retrace import at_finetune as at_finetune
from mpsim.models.retrace import at_recipe as at_recipe
from mpsim.models.retrace import at_seq_len as at_seq_len
from mpsim.models.retrace import retraced as retraced
from mpsim.models.trace import RECIPES, Trace
from mpsim.plans.job import DEFAULT_MODEL

if TYPE_CHECKING:
    from mpsim.models.workloads import ModelConfig

DEFAULT_PRESET = DEFAULT_MODEL
"""The shape a trace starts from when no preset is named."""


@dataclass(frozen=True)
class Measure:
    """Run the layers for real (``mpsim trace --measure``): on ``device`` with ``threads``
    intra-op threads, ``repeats`` timed runs per layer (the median is kept)."""

    device: str = "cpu"
    threads: int = 1
    repeats: int = 10


def presets() -> dict[str, tuple[ModelConfig, int, str]]:
    """The shipped configurations by name: shape, microbatch and precision recipe."""
    from mpsim.models.workloads import ZOO

    return dict(ZOO)


def default_attention(server: str | None, recipe: str | None) -> str:
    """The kernel PyTorch's scaled_dot_product_attention picks on ``server``'s GPUs for the
    recipe's compute dtype (mixed-fp16 when none is given; flash without a server)."""
    from mpsim.models.kernels import default_attention as picked

    dtype = RECIPES[recipe].compute_dtype if recipe in RECIPES else "fp16"
    capability = None if server is None else load_topology(server).spec.gpu.compute_capability
    return picked(capability, dtype)


def model_config(preset: str | None, shape: dict[str, Any], attention: str | None = None, server: str | None = None,
                 recipe: str | None = None) -> tuple[ModelConfig, int, str, bool]:
    """The configuration a preset (``DEFAULT_PRESET`` when None) takes with ``shape``'s
    values that are not None (the framework among them); the attention kernel as given,
    else the preset's, else (no preset, or a ``server`` named) the one PyTorch picks.
    Returns it with the preset's microbatch and recipe, and whether it is the preset
    unchanged but for the kernel (a framework named that is the preset's own changes nothing)."""
    zoo = presets()
    if preset is not None and preset not in zoo:
        raise MpsimError(f"unknown --preset {preset!r}: expected one of {', '.join(zoo)}")
    base, base_mb, base_recipe = zoo[preset or DEFAULT_PRESET]
    changes = {k: v for k, v in shape.items() if v is not None}
    if attention is not None or server is not None or preset is None:
        changes["attention"] = attention or default_attention(server, recipe or base_recipe)
    try:
        cfg = replace(base, **changes)
    except ValueError as e:
        raise MpsimError(f"bad model shape: {e}") from None
    return cfg, base_mb, base_recipe, set(changes) <= {"attention", "framework"} and cfg == base


def trace_shape(preset: str | None, shape: dict[str, Any], attention: str | None = None, server: str | None = None,
                microbatch: int | None = None, recipe: str | None = None, name: str | None = None,
                measure: Measure | None = None) -> Trace:
    """Trace ``model_config``'s model under FakeTensor mode, or measure its layers; named
    after the preset when it is the preset at its own microbatch."""
    cfg, base_mb, base_recipe, unchanged = model_config(preset, shape, attention, server, recipe)
    if name is None and preset is not None and unchanged and microbatch in (None, base_mb):
        name = preset
    if measure is not None:
        from mpsim.models.profiler import measure_trace

        return measure_trace(cfg, microbatch or base_mb, recipe or base_recipe, measure.device, measure.threads,
                             repeats=measure.repeats, name=name)
    from mpsim.models.tracer import trace_model

    return trace_model(cfg, microbatch or base_mb, recipe or base_recipe, name)


def trace_module(spec: str, microbatch: int | None = None, recipe: str | None = None, name: str | None = None) -> Trace:
    """Trace the model a builder function returns (``package.module:build`` or
    ``file.py:build``), one row per block; fp32 unless ``recipe`` says (TSPLIT, mCAP)."""
    from mpsim.models.modules import trace_builder

    return trace_builder(spec, microbatch, recipe or "fp32", name)


def trace_hf(source: str, microbatch: int | None = None, recipe: str | None = None, attention: str | None = None,
             overrides: dict[str, int] | None = None, name: str | None = None,
             fine_tune: FineTune | None = None) -> Trace:
    """Trace a Hugging Face model with its own modules from its config.json (a folder, the
    file, or a shipped one); ``overrides``: layers, hidden, heads, seq_len; ``fine_tune``:
    frozen under PEFT's adapters (``mpsim.models.finetune``)."""
    from mpsim.models.hf import (
        trace_hf as traced,  # its config checked as it is read (``check_hf`` does it without torch)
    )

    return traced(source, microbatch, recipe, attention, overrides, name, fine_tune)


def check_hf(source: str, overrides: dict[str, int] | None = None) -> None:
    """SOURCE's config.json read and its shape (with ``overrides``) checked, in one line
    where it is bad, without importing torch or transformers (``mpsim.models.hf_fields``)."""
    from mpsim.models.hf_fields import precheck

    precheck(source, overrides)


def hf_config(source: str) -> Any:
    """The ``PretrainedConfig`` of ``source``, built locally (the checks of ``trace --hf``)."""
    from mpsim.models.hf_fields import precheck

    precheck(source)
    from mpsim.models.hf import load_config

    return load_config(source)
