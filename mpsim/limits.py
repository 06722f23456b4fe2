"""How many layers mpsim takes, refused in one line before anything large is built.

Real models have at most a few hundred pipeline layers (an embedding, the transformer
layers, a head). Tracing, planning and simulating use memory linear in the number of
layers, but time grows faster: mCAP's memory-balanced partition weighs every layer range
of every stage (quadratic), and the planners' searches more. So a trace is refused above
``MAX_LAYERS``, tens of times the deepest real model. Measured at 10,000 layers (GPT-5.3B's
layer repeated, DGX-1, 2 shared cores): ``mpsim simulate`` 2 s and 180 MB, with
``--partition memory`` 4.5 s and 190 MB, ``mpsim trace`` 7 s and 450 MB; ``--strategy
mpress`` 1 GB but 8.5 minutes.

A trace file over the limit is refused before its rows are validated: ``count_layer_rows``
counts the layer rows in the raw text (a fraction of a second for a 100,000-layer file),
and ``check_trace_data`` counts them exactly once the JSON is parsed.
"""

from __future__ import annotations

import re
from numbers import Integral
from pathlib import Path

from mpsim.errors import MpsimError

DEFAULT_HEADROOM_GIB = 1.0
"""Margin below a GPU's memory that a plan should leave (``--headroom``): a plan whose
reserved estimate (``mpsim.sim.reserved``) comes closer is reported at risk."""
MAX_HEADROOM_GIB = 1024.0
"""The largest ``--headroom`` taken (more than any GPU's memory)."""

MAX_REPLICAS = 65536
"""The most data-parallel replicas of a job's pipeline: what a job (``Parallelism.data``)
takes and what a plan file's ``data_parallel`` block holds, one limit for both."""

MAX_LAYERS = 10_000
"""The most layers (trace rows) a trace may have: see the module docstring."""

_KIND_KEY = re.compile(r'"kind"\s*:\s*"(?:embedding|transformer|head|other)"')
"""A layer row's kind, as JSON writes it: one per row (``LayerRow.kind``)."""
_ESCAPED_KIND_KEY = re.compile(r'\\"kind"\s*:\s*"(?:embedding|transformer|head|other)"')


class TooManyLayersError(MpsimError):
    """A trace with more layers than ``MAX_LAYERS``."""

    def __init__(self, source: Path | str, n_layers: int) -> None:
        where = f"{source} has" if str(source) else "the trace has"
        super().__init__(f"{where} {n_layers} layers; mpsim handles at most {MAX_LAYERS} "
                         "(see MAX_LAYERS in mpsim/limits.py)")
        self.n_layers = n_layers


def check_layer_count(n_layers: int, source: Path | str = "") -> None:
    """Refuse a trace of ``n_layers`` layers above ``MAX_LAYERS``."""
    if n_layers > MAX_LAYERS:
        raise TooManyLayersError(source, n_layers)


def count_layer_rows(text: str) -> int:
    """The layer rows of a trace's JSON text, without parsing it: its ``"kind": "<layer
    kind>"`` pairs, one per row (a key written with escapes is not counted, nor one whose
    opening quote is escaped, which is part of a longer string). Exact for the files mpsim
    writes; ``check_trace_data`` counts exactly once the text is parsed."""
    return len(_KIND_KEY.findall(text)) - len(_ESCAPED_KIND_KEY.findall(text))


def check_trace_text(text: str, source: Path | str) -> None:
    """Refuse a trace file's text whose layer rows are over the limit, before parsing it."""
    check_layer_count(count_layer_rows(text), source)


def check_trace_data(data: object, source: Path | str) -> None:
    """Refuse parsed trace JSON whose ``layers`` list is over the limit, before validating it."""
    if isinstance(data, dict):
        rows = data.get("layers")
        if isinstance(rows, list):
            check_layer_count(len(rows), source)


MAX_MICROBATCH = 65536
"""The largest microbatch size (samples) a trace is rescaled to."""


def check_microbatch(microbatch: int) -> None:
    """The one check of a microbatch size (samples per microbatch)."""
    if isinstance(microbatch, bool) or not isinstance(microbatch, Integral) or microbatch < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {microbatch}")
    if microbatch > MAX_MICROBATCH:
        raise MpsimError(f"microbatch must be at most {MAX_MICROBATCH} samples, got {microbatch}")


MAX_SEQ_LEN = 1 << 20
"""The longest sequence (tokens per sample) a model is retraced at (``--seq-len``): 1,048,576,
past the longest context of any shipped model's family (Llama 3's 128K) eight times over.
Tracing runs under FakeTensor and allocates nothing, but an eager attention core's scores
grow with its square and the simulated bytes with them."""


def check_seq_len(seq_len: int, model: str, max_positions: int | None = None) -> None:
    """The one check of a sequence length asked of ``model``: a positive integer, at most
    the positions the model records (``max_positions``), else at most ``MAX_SEQ_LEN``."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, Integral) or seq_len < 1:
        raise MpsimError(f"--seq-len must be a positive integer, got {seq_len}")
    if max_positions is not None and seq_len > max_positions:
        raise MpsimError(f"--seq-len {seq_len}: {model} has {max_positions} positions (max_position_embeddings); "
                         f"give at most {max_positions}")
    if seq_len > MAX_SEQ_LEN:
        raise MpsimError(f"--seq-len {seq_len}: mpsim retraces {model} at most at {MAX_SEQ_LEN} tokens "
                         "(see MAX_SEQ_LEN in mpsim/limits.py)")
