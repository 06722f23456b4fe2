"""Trace generation: run the real PyTorch layers under FakeTensor mode.

No memory is allocated and no arithmetic is done, so a 25B-parameter model traces on a
laptop in seconds. Per distinct layer (embedding, one transformer layer, loss head) we
record, for one forward and backward on a microbatch:

- saved-for-backward bytes, from ``torch.autograd.graph.saved_tensors_hooks`` (each
  storage counted once, parameters excluded), and whether the layer input is among them;
- FLOPs, from ``torch.utils.flop_counter.FlopCounterMode``;
- bytes read and written by non-matmul ops (for the roofline in ``Trace.layer_times``);
- the largest transient tensor that is neither saved nor the output (workspace).

The transformer layers of a model are identical, so one is traced and repeated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from mpsim.trace import RECIPES, SCHEMA_VERSION, LayerKind, LayerRow, Source, Trace, TraceFile
from mpsim.workloads import Embedding, LossHead, ModelConfig, TransformerLayer

_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_flash_attention"}
_NO_TRAFFIC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "device", "detach",
                   "alias", "lift_fresh", "_to_copy_meta"}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it). Only unique while the storage is
    alive, so callers keep every storage they key alive until they are done."""
    return t.untyped_storage()._cdata


class _OpBytes(TorchDispatchMode):
    """Counts bytes touched by non-matmul ops and remembers every op output's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.mem_bytes = 0
        self.outputs: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps storages alive so their keys are never reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outs:
            self.outputs.setdefault(_key(t), t.untyped_storage().nbytes())
            self._alive.append(t)
        op = func.__name__.split(".")[0]
        if not outs or getattr(func, "is_view", False) or op in _NO_TRAFFIC_OPS:
            pass  # metadata, views and uninitialised allocations move no bytes
        elif op == "embedding":  # a lookup touches the rows it gathers, not the whole table
            self.mem_bytes += 2 * sum(t.numel() * t.element_size() for t in outs)
        elif op not in _MATMUL_OPS:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.mem_bytes += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


def _trace_module(module: torch.nn.Module, inputs: list[torch.Tensor], grad_input: bool,
                  run: Callable[..., torch.Tensor]) -> dict:
    """Forward and backward of ``module`` on fake ``inputs``; returns the measured row fields."""
    param_keys = {_key(p) for p in module.parameters()}
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in param_keys:
            saved.setdefault(k, t.untyped_storage().nbytes())
            keep.append(t)
        return t

    counter = _OpBytes()
    with (FlopCounterMode(display=False) as fwd_flops, counter,
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
        out = run(module, *inputs)
    fwd_mem = counter.mem_bytes
    out_key = _key(out)
    first = inputs[0]
    workspace = max((n for k, n in counter.outputs.items()
                     if k not in saved and k != out_key and k not in param_keys), default=0)
    counter_b = _OpBytes()
    with FlopCounterMode(display=False) as bwd_flops, counter_b:
        out.backward(torch.ones_like(out))
    return {
        "params": sum(p.numel() for p in module.parameters()),
        "act_bytes": sum(saved.values()),
        "saves_input": _key(first) in saved,
        "input_bytes": first.numel() * first.element_size(),
        "output_bytes": out.numel() * out.element_size(),
        "workspace_bytes": workspace,
        "fwd_flops": float(fwd_flops.get_total_flops()),
        "bwd_flops": float(bwd_flops.get_total_flops()),
        "fwd_mem_bytes": float(fwd_mem),
        "bwd_mem_bytes": float(counter_b.mem_bytes),
    }


def trace_model(cfg: ModelConfig, microbatch: int, recipe: str = "mixed-fp16", name: str | None = None) -> Trace:
    """Trace ``cfg`` at ``microbatch`` under FakeTensor mode (see the module docstring)."""
    precision = RECIPES[recipe]
    dtype = _DTYPES[precision.compute_dtype]
    b = microbatch
    previous_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build parameters in the compute dtype directly
    try:
        fields = _trace_layers(cfg, b, dtype)
    finally:
        torch.set_default_dtype(previous_default)
    emb, layer, head = fields
    return _assemble(cfg, microbatch, recipe, name, emb, layer, head)


def _trace_layers(cfg: ModelConfig, b: int, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    s, h = cfg.seq_len, cfg.hidden
    with FakeTensorMode():
        tokens = torch.zeros(b, s, dtype=torch.long)
        emb = _trace_module(Embedding(cfg), [tokens], False, lambda m, x: m(x))
        x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        layer = _trace_module(TransformerLayer(cfg), [x], True, lambda m, x: m(x))
        x2 = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
        head = _trace_module(LossHead(cfg), [x2, tokens], True, lambda m, x, y: m(x, y))
    return emb, layer, head


def _assemble(cfg: ModelConfig, microbatch: int, recipe: str, name: str | None, emb: dict, layer: dict,
              head: dict, source: Source | None = None) -> Trace:
    """One trace row per layer from the fields measured on the embedding, one transformer
    layer (repeated) and the loss head."""
    precision = RECIPES[recipe]

    def row(name: str, kind: LayerKind, fields: dict) -> LayerRow:
        n = fields["params"]
        return LayerRow(name=name, kind=kind, param_bytes=n * precision.weight_bytes_per_param,
                        grad_bytes=n * precision.grad_bytes_per_param,
                        optimizer_bytes=n * precision.optimizer_bytes_per_param,
                        split_dims=["batch"] if kind != "head" else ["batch", "sequence"], **fields)

    rows = [row("embedding", "embedding", emb)]
    rows += [row(f"layer{i}", "transformer", layer) for i in range(cfg.layers)]
    rows.append(row("head", "head", head))
    spec = TraceFile(
        schema=SCHEMA_VERSION,
        name=name or f"{cfg.family}-{cfg.layers}l-{cfg.hidden}h",
        model=cfg.to_dict(),
        params=cfg.param_count(),
        microbatch=microbatch,
        precision=precision,
        source=source or Source(kind="derived",
                                tool="mpsim trace (FakeTensorMode, FlopCounterMode, saved_tensors_hooks)",
                                torch_version=torch.__version__.split("+")[0]),
        layers=rows,
    )
    return Trace(spec, "<traced>")

