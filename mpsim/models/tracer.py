"""Trace generation: run the real PyTorch layers under FakeTensor mode.

No memory is allocated and no arithmetic is done, so a 70B-parameter model traces on a
laptop in seconds. Per distinct layer (embedding, one transformer layer, loss head) we
record, for one forward and backward on a microbatch:

- saved-for-backward bytes, from ``torch.autograd.graph.saved_tensors_hooks`` (each
  storage counted once, parameters excluded), and whether the layer input is among them.
  The layers call ``mpsim.models.kernels``, so these are the bytes the CUDA kernels keep (1-byte
  dropout masks, the attention backend's own saved tensors), not what CPU kernels keep;
- FLOPs, from ``torch.utils.flop_counter.FlopCounterMode``, with those run inside a fused
  attention kernel also counted on their own (they have their own efficiency);
- bytes read and written by non-matmul ops (for the roofline in ``mpsim.timing.costs``);
- the largest transient tensor that is neither saved nor the output (workspace);
- what the attention core keeps beyond q, k and v, and its forward FLOPs and bytes: what
  selective recompute (Korthikanti et al. 2022, section 4.2) drops and pays;
- in a mixture-of-experts layer, the routed experts' part of the parameters, saved bytes
  and FLOPs, and the bytes dispatched to them (``mpsim.models.moe``: uniform load).

The transformer layers of a model are identical, so one is traced and repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from mpsim.limits import check_layer_count
from mpsim.models import adapters, finetune, kernels, low_precision, moe, tp_ops
from mpsim.models.kernels import FUSED_ATTENTION_OPS, storage_key
from mpsim.models.tp_ops import NO_SHARD, TensorShard
from mpsim.models.trace import RECIPES, SCHEMA_VERSION, LayerKind, LayerRow, Source, Trace, TraceFile
from mpsim.models.workloads import Embedding, LossHead, ModelConfig, TransformerLayer

_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_flash_attention", *FUSED_ATTENTION_OPS}
_NO_TRAFFIC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "device", "detach",
                   "alias", "lift_fresh", "_to_copy_meta"}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}
Run = Callable[..., torch.Tensor]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _OpBytes(TorchDispatchMode):
    """Counts bytes touched by non-matmul ops (those inside the attention core apart, too)
    and, with ``remember``, remembers every op output's storage.

    Remembering keeps every output alive, so it is for the forward only: in a backward a
    second reference to a weight gradient stops autograd from taking the tensor as the
    parameter's ``.grad`` (it copies it instead), a copy a GPU run does not make."""

    def __init__(self, probe: kernels.TraceProbe | None = None, remember: bool = True,
                 low: low_precision.LowPrecisionProbe | None = None, backward: bool = False) -> None:
        super().__init__()
        self.low = low
        """Under a low-precision recipe: which GEMMs run in FP8, their casts, the backward's reads."""
        self.backward = backward
        self.launches: list[RawKernel] = []
        """Every kernel the pass launches, in order (``_raw_kernel``)."""
        self.mem_bytes = 0
        self.core_mem_bytes = 0
        self.probe = probe
        self.remember = remember
        self.outputs: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps storages alive so their keys are never reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outs if self.remember else ():
            self.outputs.setdefault(storage_key(t), t.untyped_storage().nbytes())
            self._alive.append(t)
        moved = self._moved(func, outs, args, kwargs)
        launch = _raw_kernel(func, args, outs, moved)
        if self.low is not None:
            launch, cast = self._low_precision(func, args, launch)
            moved += cast
        if launch is not None:
            self.launches.append(launch)
        self.mem_bytes += moved
        if self.probe is not None and self.probe.in_core:
            self.core_mem_bytes += moved
        return out

    def _low_precision(self, func: Any, args: tuple, launch: RawKernel | None) -> tuple[RawKernel | None, int]:
        """Under a low-precision recipe: a GEMM's launch marked FP8 (its casts recorded before
        it, their bytes returned), and in the backward which kernels read which storages
        (``mpsim.models.low_precision``)."""
        assert self.low is not None
        op = func.__name__.split(".")[0]
        fp8, cast = False, 0
        if op in _GEMM_OPS and launch is not None:
            a, b = (args[i] for i in _GEMM_OPS[op])
            fp8, cast = self.low.gemm(a, b, self.backward)
            if cast:
                self.launches.append(("memory", cast))
            launch = (*launch, True) if fp8 else launch
        if self.backward and not getattr(func, "is_view", False) and op not in _NO_TRAFFIC_OPS:
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor):
                    self.low.backward_read(storage_key(t), fp8)
        return launch, cast

    @staticmethod
    def _moved(func, outs: list[torch.Tensor], args, kwargs) -> int:
        op = func.__name__.split(".")[0]
        if not outs or getattr(func, "is_view", False) or op in _NO_TRAFFIC_OPS or op in _MATMUL_OPS:
            return 0  # metadata, views, uninitialised allocations and compute-bound kernels
        if op == "embedding":  # a lookup touches the rows it gathers, not the whole table
            return 2 * _nbytes(outs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return _nbytes(ins + outs)


RawKernel = tuple[Any, ...]
"""One launch as dispatched: ("gemm", m, n, k, batch), ("attention", backend, backward, b,
heads, kv heads, s_q, s_k, d, causal), ("conv", pass, n, c_in, h, w, c_out, r, s, p, q,
stride, groups) or ("memory", bytes)."""
_GEMM_OPS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
"""Operators run as one GEMM, and the positions of their two factors."""


def _raw_kernel(func: Any, args: tuple, outs: list[torch.Tensor], moved: int) -> RawKernel | None:
    """The kernel an operator launches, by shape (``mpsim.hardware.kernel_records``), or None for
    metadata, views and allocations. A convolution's backward is two kernels (data and
    weight gradient), recorded as one entry that ``_kernel_records`` splits."""
    op = func.__name__.split(".")[0]
    if op in _GEMM_OPS:
        a, b = (args[i] for i in _GEMM_OPS[op])
        batch = a.shape[0] if a.dim() == 3 else 1
        return ("gemm", a.shape[-2], b.shape[-1], a.shape[-1], batch)
    if op in FUSED_ATTENTION_OPS:
        return _raw_attention(op, args)
    if op in ("convolution", "convolution_backward") and args[0].dim() == 4:
        return _raw_conv(op, args, outs)
    if moved > 0:
        return ("memory", moved)
    return None


def _raw_attention(op: str, args: tuple) -> RawKernel:
    """mpsim's fused attention operators (``mpsim.models.kernels``): the forward's log-sum-exp row
    padding tells FlashAttention (1) from the memory-efficient kernel (32); a backward is
    marked flash here and takes its forward's backend in ``_kernel_records``."""
    backward = op.endswith("backward")
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    causal = bool(args[6] if backward else args[3])
    backend = "flash" if backward or args[5] == 1 else "mem-efficient"
    b, heads, s_q, d = q.shape
    return ("attention", backend, backward, b, heads, k.shape[1], s_q, k.shape[2], d, causal)


def _raw_conv(op: str, args: tuple, outs: list[torch.Tensor]) -> RawKernel:
    """aten.convolution(input, weight, bias, stride, padding, dilation, transposed,
    output_padding, groups) and convolution_backward(grad_out, input, weight, bias_sizes,
    stride, ..., groups, output_mask)."""
    if op == "convolution":
        x, w, stride, groups, out = args[0], args[1], args[3], args[8], outs[0]
        passes: tuple[str, ...] = ("fwd",)
    else:
        x, w, stride, groups, out = args[1], args[2], args[4], args[9], args[0]
        passes = tuple(p for p, on in zip(("dgrad", "wgrad"), args[10][:2], strict=True) if on)
    n, c_in, h, width = x.shape
    c_out, _per_group, r, s = w.shape
    return ("conv", passes, n, c_in, h, width, c_out, r, s, out.shape[2], out.shape[3], int(stride[0]),
            int(groups))


def _fused_attention_flops(counter: FlopCounterMode) -> float:
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(n for op, n in counts.items() if str(op).split(".")[-1] in FUSED_ATTENTION_OPS))


def _selective_saving(probe: kernels.TraceProbe, saved: dict[int, int]) -> int:
    """Bytes selective recompute frees: what the attention core keeps beyond its inputs,
    less its inputs where nothing else keeps them (they become the checkpoint)."""
    dropped = sum(n for k, n in probe.core_saved.items() if k in saved)
    checkpoint = sum(n for k, n in probe.core_inputs.items() if k not in saved)
    return max(0, dropped - checkpoint)


def _traffic(module: torch.nn.Module, inputs: list[torch.Tensor], run: Run,
             low_precision_gemms: bool = False) -> tuple[_OpBytes, _OpBytes]:
    """The forward's and the backward's traffic and kernels of ``run(module, *inputs)``,
    from fresh gradients (``low_precision_gemms``: as ``trace_layer`` traced them)."""
    for p in module.parameters():
        p.grad = None
    recipe = low_precision.active() if low_precision_gemms else None
    low = (None if recipe is None else
           low_precision.LowPrecisionProbe(recipe, {storage_key(p) for p in (*module.parameters(), *module.buffers())},
                                           low_precision.routers(module)))
    fwd, bwd = _OpBytes(remember=False, low=low), _OpBytes(remember=False, low=low, backward=True)
    with kernels.CudaDropout(), fwd:
        out = run(module, *inputs)
    with bwd:
        out.backward(torch.ones_like(out))
    for p in module.parameters():
        p.grad = None
    return fwd, bwd


def _doubled_run(module: torch.nn.Module, inputs: list[torch.Tensor], run: Run,
                 low_precision_gemms: bool = False) -> tuple[_OpBytes, _OpBytes] | None:
    """The layer run again on every input doubled along its first dimension: what tells the
    traffic and the kernel dimensions that grow with the batch from those that do not
    (``_fixed``, ``_kernel_records``). None for a layer whose inputs do not double that way."""
    doubled = [torch.cat([t, t]).detach().requires_grad_(t.requires_grad) for t in inputs]
    try:
        return _traffic(module, doubled, run, low_precision_gemms)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None


def _fixed(at_b: float, at_2b: float) -> float:
    """The part of traffic affine in the batch, m(b) = fixed + b x per-sample, that does
    not grow: fixed = 2 m(b) - m(2b), within [0, m(b)]."""
    return min(at_b, max(0.0, 2 * at_b - at_2b))


_GEMM_DIMS = ("m", "n", "k", "batch")


def _kernel_records(at_b: list[RawKernel], at_2b: list[RawKernel] | None,
                    attention_backend: str | None = None) -> list[dict[str, Any]]:
    """The records of ``mpsim.hardware.kernel_records`` for a pass's launches at the traced batch,
    identical ones counted once; ``at_2b``, the same pass at twice the batch, tells each
    record how it grows (unaligned or absent: a GEMM grows in m, no traffic is fixed).
    ``attention_backend`` overrides the attention kernels' backend (a backward's is its
    forward's)."""
    aligned = (at_2b is not None and len(at_2b) == len(at_b)
               and all(x[0] == y[0] for x, y in zip(at_b, at_2b, strict=True)))
    counts: dict[tuple[tuple[str, Any], ...], int] = {}
    for i, raw in enumerate(at_b):
        twin = at_2b[i] if aligned and at_2b is not None else None
        for record in _records(raw, twin, attention_backend):
            key = tuple(record.items())
            counts[key] = counts.get(key, 0) + 1
    return [dict(key, count=n) for key, n in counts.items()]


def _records(raw: RawKernel, twin: RawKernel | None, attention_backend: str | None) -> list[dict[str, Any]]:
    kind = raw[0]
    if kind == "gemm":
        grown = [d for d, a, b in zip(_GEMM_DIMS, raw[1:5], twin[1:5], strict=True) if a != b] if twin else ["m"]
        return [{"op": "gemm", **dict(zip(_GEMM_DIMS, raw[1:5], strict=True)),
                 "grows": grown[0] if grown else "none", **({"low_precision": True} if len(raw) > 5 else {})}]
    if kind == "attention":
        fields = ("backend", "backward", "batch", "heads", "kv_heads", "s_q", "s_k", "head_dim", "causal")
        record = {"op": "attention", **dict(zip(fields, raw[1:], strict=True))}
        if attention_backend is not None:
            record["backend"] = attention_backend
        return [record]
    if kind == "conv":
        shape = dict(zip(("n", "c_in", "h", "w", "c_out", "r", "s", "p", "q", "stride", "groups"), raw[2:],
                         strict=True))
        return [{"op": "conv", "pass": p, **shape} for p in raw[1]]
    fixed = round(_fixed(raw[1], twin[1])) if twin is not None else 0
    return [{"op": "memory", "bytes": raw[1], "fixed_bytes": fixed}]


def trace_layer(module: torch.nn.Module, inputs: list[torch.Tensor], run: Run,
                fixed_traffic: bool = True, keep_precision: bool = False) -> dict[str, Any]:
    """Forward and backward of ``run(module, *inputs)`` (fake or real tensors); returns the
    measured fields of a trace row. The first input is the one a pipeline passes between layers.
    Parameters and buffers (batch norm's running statistics) are model state, not saved activations.
    ``fixed_traffic``: also run at twice the batch to find the traffic that does not scale
    (``_fixed_traffic``); off where a second run costs real device memory. ``keep_precision``:
    the layer runs in the compute dtype under a low-precision recipe too (the output head, as
    Megatron-LM's output layer and DeepSeek-V3's head do: ``mpsim.models.low_precision``)."""
    param_keys = {storage_key(p) for p in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}
    itemsize: dict[int, int] = {}
    keep: list[torch.Tensor] = []
    recipe = None if keep_precision else low_precision.active()
    low = None if recipe is None else low_precision.LowPrecisionProbe(recipe, param_keys,
                                                                     low_precision.routers(module))

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k not in param_keys:
            saved.setdefault(k, t.untyped_storage().nbytes())
            itemsize.setdefault(k, t.element_size())
            kernels.note_saved(t)
            moe.note_saved(t)
            keep.append(t)
        return t

    probe = kernels.TraceProbe()
    experts = moe.ExpertProbe()
    counter = _OpBytes(probe, low=low)
    comms = tp_ops.CommProbe()
    with (kernels.CudaDropout(), kernels.probing(probe), moe.probing(experts),
          FlopCounterMode(display=False) as fwd_flops, counter,
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tp_ops.recording(comms)):
        out = run(module, *inputs)
    out_key = storage_key(out)
    first = inputs[0]
    workspace = max((n for k, n in counter.outputs.items()
                     if k not in saved and k != out_key and k not in param_keys), default=0)
    counter_b = _OpBytes(remember=False, low=low, backward=True)
    with FlopCounterMode(display=False) as bwd_flops, counter_b, tp_ops.recording(comms):
        if out.requires_grad:  # nothing before it trains (a frozen embedding): no backward
            out.backward(torch.ones_like(out))
    if low is not None:  # what the recipe keeps of the saved GEMM inputs
        saved = low.saved_bytes(saved, itemsize, {storage_key(inputs[0])})
    core_bytes = _selective_saving(probe, saved)
    with tp_ops.recording(tp_ops.CommProbe()):  # the doubled run's collectives are not the layer's
        doubled = _doubled_run(module, inputs, run, low is not None) if fixed_traffic else None
    fixed = ((0.0, 0.0) if doubled is None else
             (_fixed(counter.mem_bytes, doubled[0].mem_bytes), _fixed(counter_b.mem_bytes, doubled[1].mem_bytes)))
    fwd_kernels = _kernel_records(counter.launches, doubled[0].launches if doubled else None)
    backend = next((k["backend"] for k in fwd_kernels if k["op"] == "attention"), None)
    bwd_kernels = _kernel_records(counter_b.launches, doubled[1].launches if doubled else None, backend)
    frozen_params, frozen_bytes = adapters.frozen_state(module)
    return {
        "params": frozen_params + sum(p.numel() for p in module.parameters() if p.requires_grad),
        "frozen_params": frozen_params,
        "frozen_param_bytes": frozen_bytes,
        "act_bytes": sum(saved.values()),
        "saves_input": storage_key(first) in saved,
        "input_bytes": _nbytes([first]),
        "output_bytes": _nbytes([out]),
        "workspace_bytes": workspace,
        "fwd_flops": float(fwd_flops.get_total_flops()),
        "bwd_flops": float(bwd_flops.get_total_flops()),
        "fwd_mem_bytes": float(counter.mem_bytes),
        "bwd_mem_bytes": float(counter_b.mem_bytes),
        "fwd_fixed_mem_bytes": fixed[0],
        "bwd_fixed_mem_bytes": fixed[1],
        "fwd_attention_flops": _fused_attention_flops(fwd_flops),
        "bwd_attention_flops": _fused_attention_flops(bwd_flops),
        "attention_core_bytes": core_bytes,
        "attention_core_flops": float(probe.core_fwd_flops) if core_bytes else 0.0,
        "attention_core_mem_bytes": float(counter.core_mem_bytes) if core_bytes else 0.0,
        "fwd_collectives": [{"op": op, "n_bytes": n} for op, n in comms.forward],
        "bwd_collectives": [{"op": op, "n_bytes": n} for op, n in comms.backward],
        "fwd_kernels": fwd_kernels,
        "bwd_kernels": bwd_kernels,
        **moe.row_fields(experts, saved),
    }


class compute_dtype:
    """Context in which new parameters are built in a recipe's compute dtype (no casts to
    trace), and a low-precision recipe's GEMMs traced as it runs them."""

    def __init__(self, recipe: str) -> None:
        self.dtype = DTYPES[RECIPES[recipe].compute_dtype]
        self._low = low_precision.recipe(RECIPES[recipe])
        """A low-precision recipe's FP8 GEMMs, casts and saved copies (``mpsim.models.low_precision``)."""

    def __enter__(self) -> torch.dtype:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        self._low.__enter__()
        return self.dtype

    def __exit__(self, *exc: object) -> None:
        self._low.__exit__(None, None, None)
        torch.set_default_dtype(self._previous)


def trace_model(cfg: ModelConfig, microbatch: int, recipe: str = "mixed-fp16", name: str | None = None,
                shard: TensorShard = NO_SHARD) -> Trace:
    """Trace ``cfg`` at ``microbatch`` under FakeTensor mode (see the module docstring); with
    a tensor-parallel ``shard``, one rank's shard of every layer (``mpsim.models.tp_ops``): its
    parameters, FLOPs, saved bytes and collectives."""
    check_layer_count(cfg.layers + 2, f"{name or 'the model'} ({cfg.layers} transformer layers, an embedding and "
                                      "a head)")
    with compute_dtype(recipe) as dtype:
        emb, layer, head = _trace_layers(cfg, microbatch, dtype, shard)
    model = cfg.to_dict()
    if shard.degree > 1:
        model["tensor_parallel"] = {"degree": shard.degree, "sequence_parallel": shard.sequence_parallel,
                                    "saves_gathered": shard.saves_gathered}
    return _assemble(cfg, microbatch, recipe, name, emb, layer, head, model=model)


def _trace_layers(cfg: ModelConfig, b: int, dtype: torch.dtype,
                  shard: TensorShard = NO_SHARD) -> tuple[dict, dict, dict]:
    s, h = cfg.seq_len, cfg.hidden
    s_local = s // shard.degree if shard.sequence_parallel else s  # a sequence shard between the layers
    with FakeTensorMode():
        tokens = torch.zeros(b, s, dtype=torch.long)
        emb = trace_layer(Embedding(cfg, shard), [tokens], lambda m, x: m(x))
        x = torch.randn(b, s_local, h, dtype=dtype, requires_grad=True)
        layer = trace_layer(TransformerLayer(cfg, shard), [x], lambda m, x: m(x))
        x2 = torch.randn(b, s_local, h, dtype=dtype, requires_grad=True)
        head = trace_layer(LossHead(cfg, shard), [x2, tokens], lambda m, x, y: m(x, y), keep_precision=True)
    return emb, layer, head


NamedFields = tuple[str, LayerKind, dict[str, Any]]
"""A row to be: its name, kind and the fields ``trace_layer`` measured."""


def default_source() -> Source:
    return Source(kind="derived", tool="mpsim trace (FakeTensorMode, FlopCounterMode, saved_tensors_hooks)",
                  torch_version=torch.__version__.split("+")[0])


def make_trace(name: str, model: dict, params: int, microbatch: int, recipe: str, named: list[NamedFields],
               source: Source | None = None, split_dims: dict[LayerKind, list] | None = None,
               fine_tune: finetune.FineTune | None = None) -> Trace:
    """A trace from measured rows: the trained parameters' weight, gradient and optimizer
    bytes from the recipe, frozen ones as stored (``frozen_param_bytes``) with no gradient
    or optimizer state. Layers split along the batch; heads also along the sequence unless
    ``split_dims`` says. More rows than ``mpsim.limits.MAX_LAYERS`` are refused before any is
    built. ``fine_tune``: what trains, recorded in the file."""
    check_layer_count(len(named), name)
    precision = RECIPES[recipe]
    dims: dict[LayerKind, list] = {"head": ["batch", "sequence"]}
    dims.update(split_dims or {})

    def row(row_name: str, kind: LayerKind, fields: dict) -> LayerRow:
        trained = fields["params"] - fields.get("frozen_params", 0)
        return LayerRow(name=row_name, kind=kind,
                        param_bytes=trained * precision.weight_bytes_per_param + fields.get("frozen_param_bytes", 0),
                        grad_bytes=trained * precision.grad_bytes_per_param,
                        optimizer_bytes=trained * precision.optimizer_bytes_per_param,
                        split_dims=dims.get(kind, ["batch"]), **fields)

    spec = TraceFile(schema=SCHEMA_VERSION, name=name, model=model, params=params, microbatch=microbatch,
                     precision=precision, source=source or default_source(),
                     layers=[row(*n) for n in named], finetune=fine_tune)
    return Trace(spec, "<traced>")


def _assemble(cfg: ModelConfig, microbatch: int, recipe: str, name: str | None, emb: dict, layer: dict,
              head: dict, source: Source | None = None, model: dict | None = None) -> Trace:
    """One trace row per layer from the fields measured on the embedding, one transformer
    layer (repeated) and the loss head."""
    named: list[NamedFields] = [("embedding", "embedding", emb)]
    named += [(f"layer{i}", "transformer", layer) for i in range(cfg.layers)]
    named.append(("head", "head", head))
    return make_trace(name or f"{cfg.family}-{cfg.layers}l-{cfg.hidden}h", model or cfg.to_dict(),
                      cfg.param_count(), microbatch, recipe, named, source)
