"""Measured traces: run each distinct layer for real on the device at hand and time it.

``mpsim trace --measure`` builds the same modules as ``mpsim.models.tracer`` (embedding, one
transformer layer, the loss head) with real tensors on ``cpu`` or ``cuda``, and records:

- the byte counts and FLOPs exactly as the FakeTensor tracer does (same hooks, same
  counters), but from real storages, so saved-for-backward bytes are what the device holds;
- ``fwd_ms`` and ``bwd_ms``: the median of ``repeats`` timed forward and backward passes
  after ``warmup`` untimed ones (CUDA: synchronised before each clock read);
- ``bwd_workspace_bytes``: the peak of what the backward allocates, less the input
  gradient it leaves behind (``MemTracker``, gradients of the weights already allocated,
  so steady state). The backward's transients (gradients of scores, of the MLP's inner
  activations ...) are larger than the forward's largest temporary.

On CPU the number of intra-op threads is fixed (``threads``), because the executor runs one
process per stage with the same setting; a layer timed on all cores would not predict a
stage that shares them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mpsim.errors import MpsimError
from mpsim.models.trace import RECIPES, Source, Trace
from mpsim.models.tracer import DTYPES, _assemble, trace_layer
from mpsim.models.workloads import Embedding, LossHead, ModelConfig, TransformerLayer


def check_device(device: str) -> torch.device:
    """The torch device for ``cpu``, ``cuda`` or ``cuda:N``; refuses one that is not there."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MpsimError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MpsimError(f"--device {device}: no CUDA GPU is visible on this machine (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MpsimError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type != "cpu":
        raise MpsimError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    return dev


def device_name(dev: torch.device, threads: int) -> str:
    """What the trace's ``source.device`` says: the GPU model, or the CPU and its threads."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.machine()}, {threads} thread{'s' if threads > 1 else ''})"


def sync_device(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_layer(module: torch.nn.Module, inputs: list[torch.Tensor], run: Callable[..., torch.Tensor],
               dev: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """Median forward and backward milliseconds of ``module`` over ``repeats`` runs."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        module.zero_grad(set_to_none=False)
        sync_device(dev)
        t0 = time.perf_counter()
        out = run(module, *inputs)
        sync_device(dev)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        sync_device(dev)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
        for t in inputs:
            t.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def measure_trace(cfg: ModelConfig, microbatch: int, recipe: str = "fp32", device: str = "cpu", threads: int = 1,
                  warmup: int = 3, repeats: int = 10, name: str | None = None, seed: int = 0) -> Trace:
    """A trace of ``cfg`` with byte counts from real tensors and times measured on ``device``."""
    if recipe not in RECIPES:
        raise MpsimError(f"unknown recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if microbatch < 1 or warmup < 0 or repeats < 1 or threads < 1:
        raise MpsimError("microbatch, repeats and threads must be positive and warmup not negative")
    dev = check_device(device)
    dtype = DTYPES[RECIPES[recipe].compute_dtype]
    if dev.type == "cpu" and dtype != torch.float32:
        raise MpsimError(f"recipe {recipe} computes in {RECIPES[recipe].compute_dtype}; "
                         "measure on CPU with --recipe fp32")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        fields = [_measure(module, inputs, run, dev, warmup, repeats)
                  for module, inputs, run in _layer_cases(cfg, microbatch, dtype, dev)]
    finally:
        torch.set_num_threads(previous_threads)
    source = Source(kind="measured", tool=f"mpsim trace --measure (median of {repeats} after {warmup} warm-up)",
                    torch_version=torch.__version__.split("+")[0], device=device_name(dev, threads))
    emb, layer, head = fields
    return _assemble(cfg, microbatch, recipe, name, emb, layer, head, source)


def _layer_cases(cfg: ModelConfig, b: int, dtype: torch.dtype, dev: torch.device) -> list[tuple]:
    s, h = cfg.seq_len, cfg.hidden
    tokens = torch.randint(0, cfg.vocab, (b, s), device=dev)

    def hidden() -> torch.Tensor:
        return torch.randn(b, s, h, dtype=dtype, device=dev, requires_grad=True)

    return [
        (Embedding(cfg).to(dev, dtype), [tokens], lambda m, x: m(x)),
        (TransformerLayer(cfg).to(dev, dtype), [hidden()], lambda m, x: m(x)),
        (LossHead(cfg).to(dev, dtype), [hidden(), tokens], lambda m, x, y: m(x, y)),
    ]


def backward_workspace_bytes(module: torch.nn.Module, inputs: list[torch.Tensor],
                             run: Callable[..., torch.Tensor]) -> int:
    """Peak bytes the backward allocates beyond the input gradient (see the module doc).

    The forward runs inside the tracker too: the tensors it saves must be known to it, or
    their release during the backward (a log-softmax's output once its backward has run)
    goes unseen and the peak comes out one such tensor too high; the peak is the module's
    own backward peak (``_ModState.PEAK_BW``), over what stood after its forward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    out = run(module, *inputs)  # steady state: weight gradients exist from here on
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None
    dev = inputs[0].device
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        out = run(module, *inputs)
        grad = torch.ones_like(out)
        base = tracker.get_tracker_snapshot()[dev]["Total"]
        out.backward(grad)
    peaks = tracker.memory_tracking[module].snapshots[_ModState.PEAK_BW]
    peak = max(snap[dev]["Total"] for snap in peaks if dev in snap)
    grad_in = sum(t.numel() * t.element_size() for t in inputs if t.requires_grad)
    for t in inputs:
        t.grad = None
    return max(0, int(peak - base - grad_in))


def _measure(module: torch.nn.Module, inputs: list[torch.Tensor], run: Callable[..., torch.Tensor],
             dev: torch.device, warmup: int, repeats: int) -> dict:
    fields = trace_layer(module, inputs, run, fixed_traffic=False)  # measured times; no second run on the device
    for t in inputs:
        t.grad = None
    bwd_ws = backward_workspace_bytes(module, inputs, run)
    fwd_ms, bwd_ms = time_layer(module, inputs, run, dev, warmup, repeats)
    return dict(fields, fwd_ms=fwd_ms, bwd_ms=bwd_ms, bwd_workspace_bytes=bwd_ws)
