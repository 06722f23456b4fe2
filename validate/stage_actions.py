"""A plan's actions on one layer, with PyTorch's own mechanisms.

- ``recompute``: ``torch.utils.checkpoint`` (non-reentrant): the layer keeps only its
  input and re-runs its forward inside the backward.
- ``selective``: the same around the attention core alone (Korthikanti et al. 2022,
  section 4.2): it keeps q, k, v and re-runs inside the backward (``selective``).
- ``host`` / ``peer``: ``torch.autograd.graph.saved_tensors_hooks``. The pack hook copies
  each saved storage once (views share it) to host memory (pinned on CUDA) or, striped
  by the plan's fractions, to peer GPUs, on a side stream; the unpack hook brings it back.
  The restore of a layer starts when the backward reaches the swapped layer above it
  (one layer of lookahead, MPress III-B, as the simulator times swap-ins), on CUDA on a
  side stream the compute stream then waits for. On CPU the copies are synchronous and
  the "host" copy is kept out of the stage's memory accounting (it stands for memory that
  is not the device's).
- ``split``: the layer runs as ``p`` micro-ops over the batch dimension (TSPLIT III-A);
  each micro-output is written into the layer's output and freed.

Parameters are never swapped: they stay resident and are not saved copies.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from mpsim.models.workloads import SelfAttention


def untracked() -> AbstractContextManager[object]:
    """Allocations made here are invisible to the stage's memory tracker (host memory on CPU)."""
    return _disable_current_modes()


class Recompute(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


def selective(layer: nn.Module) -> nn.Module:
    """``layer`` with every attention core in it checkpointed (``SelfAttention.checkpoint_core``)."""
    for m in layer.modules():
        if isinstance(m, SelfAttention):
            m.checkpoint_core = True
    return layer


class Split(nn.Module):
    """``p`` micro-ops along dimension 0 (the batch); a scalar output (the loss) is averaged."""

    def __init__(self, inner: nn.Module, p: int) -> None:
        super().__init__()
        self.inner = inner
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = x.chunk(self.p, dim=0)
        out: torch.Tensor | None = None
        total: torch.Tensor | None = None
        start = 0
        for c in chunks:
            y = self.inner(c)
            if y.dim() == 0:  # the loss head: mean over equal chunks
                total = y * (c.shape[0] / x.shape[0]) if total is None else total + y * (c.shape[0] / x.shape[0])
                continue
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[start:start + c.shape[0]] = y
            start += c.shape[0]
            del y
        if out is None:
            assert total is not None  # every chunk gave a scalar (there is at least one chunk)
            return total
        return out


class _Stored:
    """One saved storage away from the device: its parts and, once restored, the copy back."""

    def __init__(self, parts: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self.parts = parts
        self.done = done
        self.restored: torch.UntypedStorage | None = None
        self.ready: torch.cuda.Event | None = None


_Packed = tuple[_Stored, torch.dtype, int | torch.SymInt, tuple[int, ...], tuple[int, ...]]
"""What the pack hook keeps for a swapped tensor: its storage's copy, dtype, offset, shape, stride."""


class SwapSpace:
    """Where one stage's swapped tensors go: ``host`` or the ``peers`` [(device, fraction)]."""

    def __init__(self, device: torch.device, target: str, peers: list[tuple[torch.device, float]]) -> None:
        self.device = device
        self.target = target
        self.peers = peers
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def _split_bytes(self, n: int) -> list[tuple[torch.device, int]]:
        if self.target == "host":
            return [(torch.device("cpu"), n)]
        sizes = [int(n * f) for _, f in self.peers]
        sizes[-1] = n - sum(sizes[:-1])
        return [(d, k) for (d, _), k in zip(self.peers, sizes)]

    def store(self, st: torch.UntypedStorage) -> _Stored:
        flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
        parts: list[torch.Tensor] = []
        if not self.cuda:
            with untracked():
                off = 0
                for _dev, k in self._split_bytes(st.nbytes()):
                    parts.append(flat[off:off + k].clone())
                    off += k
            return _Stored(parts, None)
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            off = 0
            for dev, k in self._split_bytes(st.nbytes()):
                pin = dev.type == "cpu"
                dst = torch.empty(k, dtype=torch.uint8, device=dev, pin_memory=pin)
                dst.copy_(flat[off:off + k], non_blocking=True)
                parts.append(dst)
                off += k
            flat.record_stream(self.stream)  # the source may not be reused before the copy ends
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Stored(parts, done)

    def restore(self, s: _Stored) -> None:
        """Start bringing ``s`` back (CUDA: on the side stream); idempotent."""
        if s.restored is not None:
            return
        n = sum(p.numel() for p in s.parts)
        back = torch.empty(n, dtype=torch.uint8, device=self.device)
        if not self.cuda:
            off = 0
            for p in s.parts:
                back[off:off + p.numel()].copy_(p)
                off += p.numel()
            s.restored = back.untyped_storage()
            return
        assert self.stream is not None and s.done is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(s.done)
            off = 0
            for p in s.parts:
                back[off:off + p.numel()].copy_(p, non_blocking=True)
                off += p.numel()
            back.record_stream(self.stream)
            s.ready = torch.cuda.Event()
            s.ready.record(self.stream)
        s.restored = back.untyped_storage()

    def wait(self, s: _Stored) -> torch.UntypedStorage:
        self.restore(s)
        if s.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(s.ready)
        assert s.restored is not None
        return s.restored


class Swap(nn.Module):
    """Saved activations of ``inner`` leave the device after its forward (see the module doc).

    ``previous`` is the swapped layer just below in the same stage: when this layer's
    backward begins, its restore starts too (lookahead)."""

    def __init__(self, inner: nn.Module, space: SwapSpace) -> None:
        super().__init__()
        self.inner = inner
        self.space = space
        self.previous: Swap | None = None
        self._pending: list[dict[int, _Stored]] = []
        """Stored tensors of microbatches whose backward has not begun, oldest first."""
        self._param_keys: set[int] | None = None

    def _restore_all(self, stored: dict[int, _Stored]) -> None:
        for s in stored.values():
            self.space.restore(s)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if any(a.device != self.space.device for a in args):  # the pipeline's shape inference (meta tensors)
            return self.inner(*args)
        if self._param_keys is None:
            self._param_keys = {p.untyped_storage().data_ptr() for p in self.inner.parameters()}
        stored: dict[int, _Stored] = {}
        alive: list[torch.UntypedStorage] = []  # until the forward ends, so no address is reused
        space = self.space
        params = self._param_keys

        def pack(t: torch.Tensor) -> torch.Tensor | _Packed:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in params or t.device != space.device or st.nbytes() == 0:
                return t
            if key not in stored:
                stored[key] = space.store(st)
                alive.append(st)
            return (stored[key], t.dtype, t.storage_offset(), tuple(t.shape), t.stride())

        def unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            s, dtype, offset, shape, stride = packed
            restored = space.wait(s)
            return torch.empty(0, dtype=dtype, device=space.device).set_(restored, offset, shape, stride)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = self.inner(*args)
        alive.clear()
        if out.requires_grad:
            prev = self.previous
            self._pending.append(stored)

            box = [stored]  # emptied when the hook fires: the graph keeps hooks alive until it dies

            def lookahead(grad: torch.Tensor) -> None:
                # Backwards run microbatches first in, first out (GPipe and 1F1B alike), so
                # the oldest pending entry below is the microbatch this backward works on.
                if not box:
                    return
                mine = box.pop()
                self._restore_all(mine)
                self._pending = [x for x in self._pending if x is not mine]
                if prev is not None and prev._pending:
                    prev._restore_all(prev._pending[0])

            out.register_hook(lookahead)
        return out

