"""Tensor-parallel shards of a trace: what one GPU of a stage's tensor-parallel group runs.

Megatron-LM splits each transformer layer over t GPUs (Shoeybi et al. 2019, section 3):
1/t of the attention heads (and of the KV heads under grouped-query attention) with a
column-parallel q|k|v and a row-parallel output projection, 1/t of the MLP the same way,
the vocabulary of the embedding and of the output projection in t parts, the norms
replicated. Every GPU of the group runs the same shard, so the engine simulates the
group's first GPU with the shard's rows and runs each layer's collectives over the group
on the critical path (``mpsim.sim.tensor_group``).

The shard is not scaled from the whole layer's row: it is traced, with the workloads'
modules built at 1/t of their widths (``mpsim.models.tracer.trace_model`` with a
``TensorShard``), so its parameters, FLOPs, bytes moved, saved bytes and collectives are
those of the shard's own tensors. Without sequence parallelism that gives Korthikanti et
al. 2022's sbh(10 + 24/t + 5as/(ht)) bytes per GPT layer (Table 2), with it
sbh/t (34 + 5as/h), and selective recompute drops the 5as/h term (tests hold all three
within 2% for t = 1, 2, 4, 8).

A trace can be sharded when it describes a model of ``mpsim.models.workloads`` (its ``model``
block is a ``ModelConfig``: every shipped trace and every ``mpsim trace`` preset) whose
heads, KV heads and MLP width divide by t (and the sequence, with sequence parallelism).
Times a trace measured (``fwd_ms``/``bwd_ms``) are scaled by the shard's share of the
layer's FLOPs, an estimate. Shards are traced once per process and kept (``SHARDS``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

from mpsim.caches import Lru
from mpsim.errors import MpsimError
from mpsim.models.trace import LayerRow, Trace

if TYPE_CHECKING:
    from mpsim.models.workloads import ModelConfig

SHARDS = 64
"""Shard traces remembered per process."""
_SHARDS: Lru[tuple[object, ...], Trace] = Lru(SHARDS)
_ROW_OF_KIND = {"embedding": 0, "transformer": 1, "head": 2}
"""Which row of a traced shard (embedding, one layer, head) stands for a row of each kind."""
_CONFIG_KEYS = ("family", "layers", "hidden", "heads", "seq_len", "vocab")


def check_shardable(trace: Trace, degree: int, sequence_parallel: bool = False) -> None:
    """One-line ``MpsimError`` unless ``trace`` can be split over ``degree`` GPUs (module doc)."""
    if degree == 1:
        return
    model = trace.spec.model
    name = trace.name
    if "tensor_parallel" in model:
        raise MpsimError(f"{name} is already one GPU's tensor-parallel shard; give the whole model's trace")
    if trace.spec.finetune is not None:
        raise MpsimError(f"{name}: tensor parallelism of a fine-tune ({trace.spec.finetune.describe()}) is not "
                         "modelled yet (the shard would lose its adapters); use data parallelism, FSDP or pipeline "
                         "stages")
    if model.get("family") not in ("gpt", "bert", "llama") or any(k not in model for k in _CONFIG_KEYS):
        raise MpsimError(f"{name}: tensor parallelism needs a trace of an mpsim model (gpt, bert, llama: "
                         "`mpsim trace --preset` or a shipped trace); this one's layers cannot be re-traced as shards")
    odd = sorted({r.kind for r in trace.layers} - set(_ROW_OF_KIND))
    if odd:
        raise MpsimError(f"{name}: has {odd[0]} layers, which tensor parallelism does not split")
    heads, kv = model["heads"], model.get("kv_heads") or model["heads"]
    ffn = model.get("ffn_hidden") or 4 * model["hidden"]
    for what, n in (("attention heads", heads), ("KV heads", kv), ("MLP width", ffn)):
        if n % degree:
            raise MpsimError(f"{name}: {n} {what} do not split over a tensor-parallel degree of {degree}")
    if sequence_parallel and model["seq_len"] % degree:
        raise MpsimError(f"{name}: sequence {model['seq_len']} does not split over {degree} GPUs "
                         "(sequence parallel)")


def shard_trace(trace: Trace, degree: int, sequence_parallel: bool = False, saves_gathered: bool = False) -> Trace:
    """One GPU's shard of ``trace`` over a tensor-parallel group of ``degree`` (module doc);
    ``saves_gathered``: the column-parallel layers keep the gathered input under sequence
    parallelism, as DTensor runs them (the executor), instead of the shard (Megatron)."""
    if degree == 1:
        return trace
    key = (trace.content_hash, degree, sequence_parallel, saves_gathered and sequence_parallel)
    found = _SHARDS.get(key)
    if found is not None:
        return found
    check_shardable(trace, degree, sequence_parallel)
    model = {k: v for k, v in trace.spec.model.items() if k != "layers"}
    traced = _traced_shard(json.dumps(model, sort_keys=True), trace.microbatch, trace.spec.precision.recipe, degree,
                           sequence_parallel, saves_gathered and sequence_parallel)
    rows = [_shard_row(r, traced.layers[_ROW_OF_KIND[r.kind]]) for r in trace.layers]
    model = dict(trace.spec.model, tensor_parallel=traced.spec.model["tensor_parallel"])
    shard = Trace(trace.spec.model_copy(update={"layers": rows, "model": model}), trace.source)
    return _SHARDS.put(key, shard)


def _config(model: dict) -> ModelConfig:
    from mpsim.models.workloads import ModelConfig

    fields = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in model.items() if k in fields} | {"layers": 1})


@lru_cache(maxsize=SHARDS)
def _traced_shard(model_json: str, microbatch: int, recipe: str, degree: int, sequence_parallel: bool,
                  saves_gathered: bool) -> Trace:
    """The embedding, one layer and the head of a shard, traced once per shape (a depth
    search's traces differ in their layer count only, which a row does not depend on)."""
    from mpsim.models.tp_ops import TensorShard
    from mpsim.models.tracer import trace_model

    shard = TensorShard(degree, sequence_parallel, saves_gathered)
    return trace_model(_config(json.loads(model_json)), microbatch, recipe, None, shard)


def _shard_row(row: LayerRow, traced: LayerRow) -> LayerRow:
    """``traced``'s measured fields under ``row``'s name, kind and split dimensions; a
    measured time scaled by the shard's share of the FLOPs."""
    keep: dict[str, object] = {"name": row.name, "kind": row.kind, "split_dims": row.split_dims}
    for k, flops in (("fwd_ms", "fwd_flops"), ("bwd_ms", "bwd_flops")):
        measured = getattr(row, k)
        total = getattr(row, flops)
        keep[k] = None if measured is None else (measured * getattr(traced, flops) / total if total else measured)
    return traced.model_copy(update=keep)
