"""Trace any PyTorch model cut into pipeline layers: ``mpsim trace --module SPEC``.

SPEC is ``package.module:function`` (importable from the current environment) or
``path/to/file.py:function``. ``function()`` is called with no arguments and returns

    (blocks, example_input)

where ``blocks`` is the model cut into its pipeline layers, in order: a list of
``nn.Module`` or an ``nn.Sequential`` whose children are the layers (named by their child
names), and ``example_input`` is one input tensor, batch first. ``mpsim.models.cnn`` holds such
builders for the CNNs of TSPLIT and mCAP.

Tracing, as torchgpipe's balancing by profile (Kim et al. 2020, section 3.1) but under
FakeTensor mode (``mpsim.models.tracer``): the builder runs under FakeTensor mode in the recipe's
compute dtype, so no parameter memory is allocated; each block is traced in turn with
``tracer.trace_layer``, the output of one block (detached, requiring grad) being the
input of the next. One trace row per block: kind ``other``, the last block ``head``.
The last block's output goes through a loss so that its backward is traced too:

- a scalar is taken as the loss itself;
- 2-D logits (batch, classes): cross-entropy against fake labels (class 0);
- anything else: the sum of the output.

``microbatch``: the model is traced again at that batch (the example input's first
dimension replaced), not rescaled, so batch-dependent shapes stay exact.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mpsim.errors import MpsimError
from mpsim.limits import check_microbatch
from mpsim.models.trace import Trace
from mpsim.models.tracer import NamedFields, compute_dtype, make_trace, trace_layer

_SPEC = re.compile(r"^(?P<module>[^:]+):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
FAMILY = "module"
"""``model.family`` of a module trace: not a GPT, BERT or Llama shape."""


def parse_spec(spec: str) -> tuple[str, str]:
    """``(module or file, function)`` of ``package.module:function`` or ``file.py:function``."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise MpsimError(f"--module {spec!r}: expected package.module:function or path/to/file.py:function")
    return match["module"], match["function"]


def _import(where: str) -> ModuleType:
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise MpsimError(f"--module: no file {where}")
        name = f"mpsim_user_{abs(hash(path.resolve()))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise MpsimError(f"--module: cannot import {where} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader = spec.loader
    else:
        try:
            return importlib.import_module(where)
        except Exception as exc:  # any import failure is the user's module's
            raise MpsimError(f"--module: cannot import {where} ({type(exc).__name__}: {_first_line(exc)})") from None
    try:
        loader.exec_module(module)
    except Exception as exc:
        raise MpsimError(f"--module: cannot import {where} ({type(exc).__name__}: {_first_line(exc)})") from None
    return module


def load_builder(spec: str) -> Callable[[], Any]:
    """The function SPEC names (see the module doc)."""
    where, function = parse_spec(spec)
    builder = getattr(_import(where), function, None)
    if builder is None:
        raise MpsimError(f"--module: {where} has no function {function!r}")
    if not callable(builder):
        raise MpsimError(f"--module: {where}.{function} is not a function")
    if not _takes_no_arguments(builder):
        raise MpsimError(f"--module: {where}.{function} has parameters without defaults; it is called with none")
    return builder


def _takes_no_arguments(builder: Callable[..., Any]) -> bool:
    """Whether ``builder()`` can be called as the contract says (every parameter defaulted)."""
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return True
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _blocks(built: object, spec: str) -> tuple[list[tuple[str, nn.Module]], Tensor]:
    """Check what the builder returned; the named blocks and the example input."""
    shape = "(blocks, example_input): a list of nn.Module or an nn.Sequential, and a tensor"
    if not isinstance(built, tuple | list) or len(built) != 2:
        raise MpsimError(f"--module {spec}: the builder returned {type(built).__name__}, expected {shape}")
    blocks, example = built
    if isinstance(blocks, nn.Sequential):
        named = [(_block_name(n, m, i), m) for i, (n, m) in enumerate(blocks.named_children())]
    elif isinstance(blocks, list | tuple) and all(isinstance(m, nn.Module) for m in blocks):
        named = [(_block_name(str(i), m, i), m) for i, m in enumerate(blocks)]
    else:
        raise MpsimError(f"--module {spec}: the builder's blocks are a {type(blocks).__name__}, expected {shape}")
    if not named:
        raise MpsimError(f"--module {spec}: the builder returned no blocks")
    if not isinstance(example, Tensor) or example.dim() < 1:
        raise MpsimError(f"--module {spec}: the example input is a {type(example).__name__}, expected {shape} "
                         "(batch first)")
    return named, example


def _block_name(child: str, module: nn.Module, index: int) -> str:
    """A child's own name, or ``block<i>-<class>`` for a numbered one."""
    return f"block{index}-{type(module).__name__.lower()}" if child.isdigit() else child


def loss_of(output: Tensor) -> Tensor:
    """The scalar the last block's backward starts from (module doc)."""
    if output.dim() == 0:
        return output
    if output.dim() == 2 and output.is_floating_point():
        labels = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
        return F.cross_entropy(output, labels)
    return output.sum()


class _LastOp(TorchDispatchMode):
    """Remembers the operator being run, to name the one that fails."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = str(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _input(example: Tensor, microbatch: int | None, dtype: torch.dtype) -> Tensor:
    x = example.to(dtype) if example.is_floating_point() else example
    if microbatch is not None and microbatch != x.shape[0]:
        x = torch.zeros((microbatch, *x.shape[1:]), dtype=x.dtype)
    return x


def _trace_block(index: int, name: str, block: nn.Module, x: Tensor, is_head: bool) -> tuple[dict[str, Any], Tensor]:
    """The measured fields of one block and its output; one line naming the block and the
    operator when it fails."""
    outputs: list[Tensor] = []
    watch = _LastOp()

    def run(m: nn.Module, inp: Tensor) -> Tensor:
        with watch:
            out = m(inp)
            if not isinstance(out, Tensor):
                raise TypeError(f"returned a {type(out).__name__}, expected one tensor")
            outputs.append(out)
            return loss_of(out) if is_head else out

    block.train()
    try:
        fields = trace_layer(block, [x], run)
    except MpsimError:
        raise
    except Exception as exc:
        at = f" at {watch.op}" if watch.op else ""
        raise MpsimError(f"block {index} ({name}) failed under FakeTensor mode{at}: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from None
    return fields, outputs[0]


def _trace_blocks(named: list[tuple[str, nn.Module]], x: Tensor) -> list[NamedFields]:
    """One row per block; each block's output (detached) is the next one's input."""
    rows: list[NamedFields] = []
    last = len(named) - 1
    for i, (name, block) in enumerate(named):
        fields, out = _trace_block(i, name, block, x, i == last)
        rows.append((name, "head" if i == last else "other", fields))
        x = out.detach().requires_grad_(out.is_floating_point())
    return rows


def _unique_params(named: list[tuple[str, nn.Module]]) -> int:
    seen: dict[int, int] = {id(p): p.numel() for _, m in named for p in m.parameters()}
    return sum(seen.values())


def trace_builder(spec: str, microbatch: int | None = None, recipe: str = "fp32", name: str | None = None,
                  builder: Callable[[], Any] | None = None) -> Trace:
    """Trace the model SPEC builds, one row per block (module doc). ``builder``, when
    given, is called instead of the function SPEC names (SPEC still labels the trace):
    a builder with arguments bound, e.g. ``functools.partial(cnn.vgg, "vgg16", width=4)``."""
    if microbatch is not None:
        check_microbatch(microbatch)
    builder = builder or load_builder(spec)
    where, function = parse_spec(spec)
    with compute_dtype(recipe) as dtype, FakeTensorMode():
        try:
            built = builder()
        except Exception as exc:
            raise MpsimError(f"--module {spec}: the builder failed under FakeTensor mode "
                             f"({type(exc).__name__}: {_first_line(exc)})") from None
        named, example = _blocks(built, spec)
        x = _input(example, microbatch, dtype)
        rows = _trace_blocks(named, x)
    params = _unique_params(named)
    if params == 0:
        raise MpsimError(f"--module {spec}: the model has no parameters to train")
    model = {"family": FAMILY, "builder": spec, "blocks": len(named), "input_shape": list(x.shape)}
    title = name or (Path(where).stem if where.endswith(".py") else function)
    return make_trace(title, model, params, int(x.shape[0]), recipe, rows,
                      split_dims={"head": ["batch"], "other": ["batch"]})

