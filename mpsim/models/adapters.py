"""The torch side of fine-tuning (``mpsim.models.finetune`` says what and why): a frozen
linear layer stored quantized as bitsandbytes stores it, the frozen parameters a traced
module holds, and PEFT's adapters injected into transformers modules under FakeTensor."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mpsim.errors import MpsimError
from mpsim.models.finetune import BLOCK, CODE_BYTES, NESTED_BLOCK, FineTune, QuantType


def _dequantize_impl(packed: torch.Tensor, scales: list[torch.Tensor], rows: int, cols: int,
                     dtype: torch.dtype) -> torch.Tensor:
    return packed.new_zeros((rows, cols), dtype=dtype)


dequantize = torch.library.custom_op("mpsim::dequantize", mutates_args=())(_dequantize_impl)
"""The dequantization kernel: reads the packed weight and its scales, writes the full
weight in the compute dtype. Only its shape and bytes matter (the trace never runs it on
real data)."""


@dequantize.register_fake
def _dequantize_fake(packed: torch.Tensor, scales: list[torch.Tensor], rows: int, cols: int,
                     dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((rows, cols), dtype=dtype)


class _MatMulQuantized(torch.autograd.Function):
    """``x W^T + b`` with W dequantized for the forward and again for the backward, nothing
    saved but the quantized weight (a parameter): bitsandbytes' ``MatMul4Bit`` with a frozen
    weight, which computes only the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype), layer.bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad @ ctx.layer.dequantized(grad.dtype), None


class QuantizedLinear(nn.Linear):
    """A frozen linear layer stored as bitsandbytes stores it (``mpsim.models.finetune``'s
    doc): ``weight`` the packed values (uint8), ``scales`` the absmaxes (with double
    quantization: 8-bit, their fp32 scales, the code and offset; int8: one fp32 per row);
    the bias, if any, in the compute dtype. An ``nn.Linear`` so PEFT wraps it with adapters
    as it wraps bitsandbytes' ``Linear4bit``."""

    def __init__(self, base: nn.Linear, quant: QuantType, double_quant: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.quant, self.double_quant = quant, double_quant and quant != "int8"
        n = base.in_features * base.out_features
        packed = n if quant == "int8" else -(-n // 2)
        self.weight = nn.Parameter(torch.empty(packed, dtype=torch.uint8), requires_grad=False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scales = nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in _scales(n, base, quant,
                                                                                             self.double_quant))

    @property
    def logical_params(self) -> int:
        """Parameters the layer stands for: the full weight and the bias."""
        return self.in_features * self.out_features + (self.bias.numel() if self.bias is not None else 0)

    @property
    def stored_bytes(self) -> int:
        """Bytes the layer holds: packed weight, scales and bias."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, list(self.scales), self.out_features, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMulQuantized.apply(x, self)


def _scales(n: int, base: nn.Linear, quant: QuantType, double_quant: bool) -> list[torch.Tensor]:
    """A quantized weight's scales as bitsandbytes keeps them: int8, one fp32 per row;
    4-bit, an absmax per block of 64 (fp32, or with double quantization uint8 plus an fp32
    per 256 of them and the fp32 code and offset)."""
    if quant == "int8":
        return [torch.empty(base.out_features, dtype=torch.float32)]
    blocks = -(-n // BLOCK)
    if not double_quant:
        return [torch.empty(blocks, dtype=torch.float32)]
    return [torch.empty(blocks, dtype=torch.uint8), torch.empty(-(-blocks // NESTED_BLOCK), dtype=torch.float32),
            torch.empty(CODE_BYTES // 4, dtype=torch.float32)]


def frozen_state(module: nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of ``module``'s frozen weights: parameters that do not require
    gradients, a quantized layer's counted as the weight it stands for and the bytes it
    stores. Each tensor once."""
    params = stored = 0
    seen: set[int] = set()
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            params += m.logical_params
            stored += m.stored_bytes
            seen.update(id(p) for p in m.parameters())
    for p in module.parameters():
        if id(p) not in seen and not p.requires_grad:
            params += p.numel()
            stored += p.numel() * p.element_size()
            seen.add(id(p))
    return params, stored


def logical_params(module: nn.Module) -> int:
    """Parameters of ``module``, a quantized layer's counted as the weight it stands for."""
    frozen, _ = frozen_state(module)
    return frozen + sum(p.numel() for p in module.parameters() if p.requires_grad)


def _quantize(blocks: nn.Module, quant: QuantType, double_quant: bool) -> None:
    """Every ``nn.Linear`` inside ``blocks`` replaced by its quantized store (as transformers
    quantizes a model for bitsandbytes: the blocks' linear layers, not the output head)."""
    for parent in list(blocks.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, QuantizedLinear(child, quant, double_quant))


@contextmanager
def _adapters_in_place() -> Iterator[None]:
    """PEFT moves each new adapter to its base layer's device and dtype (``Module.to``),
    which FakeTensor parameters refuse (torch cannot swap them); they are built there
    already (the trace's default dtype and device), so the move is skipped while PEFT
    injects them."""
    to = nn.Module.to
    nn.Module.to = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = to  # type: ignore[method-assign]


class _SavedWhole(nn.Module):
    """A module of ``modules_to_save``: PEFT keeps the frozen original and trains a copy,
    which the forward runs (``ModulesToSaveWrapper``)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original_module = original
        self.trained = _trainable_copy(original)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.trained(*args, **kwargs)


def _trainable_copy(module: nn.Module) -> nn.Module:
    """``module`` with new trainable parameters of the same shapes (PEFT deep-copies it;
    FakeTensor parameters cannot be deep-copied into the same fake mode)."""
    clone = copy.copy(module)
    clone._parameters = {k: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                         for k, p in module._parameters.items()}
    clone._modules = {k: None if m is None else _trainable_copy(m) for k, m in module._modules.items()}
    clone._buffers = dict(module._buffers)
    return clone


def _save_whole(model: nn.Module, names: list[str]) -> None:
    """Every module named (by its last name) in ``names`` wrapped as ``_SavedWhole``, once
    however many modules hold it."""
    wrapped: dict[int, _SavedWhole] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in names and child is not None and not isinstance(child, _SavedWhole):
                if id(child) not in wrapped:
                    wrapped[id(child)] = _SavedWhole(child)
                setattr(parent, name, wrapped[id(child)])


def prepare(model: nn.Module, blocks: nn.Module, spec: FineTune) -> None:
    """``model`` (transformers modules under FakeTensor) made ready to fine-tune as ``spec``
    says: its weights frozen, the blocks' linear layers quantized for QLoRA, and PEFT's
    adapters injected (``peft.inject_adapter_in_model``), which alone train with any
    ``modules_to_save``. Refused in one line where PEFT refuses the config."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise MpsimError("fine-tuning traces PEFT's own adapters: install it with pip install 'mpsim[hf]' "
                         "(or pip install peft)") from None
    for p in model.parameters():
        p.requires_grad_(False)
    if spec.quant is not None:
        _quantize(blocks, spec.quant, spec.double_quant)
    config = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha,  # type: ignore[arg-type]  # any number works
                        lora_dropout=spec.lora_dropout, target_modules=spec.target_modules,
                        use_dora=spec.use_dora)
    try:
        with _adapters_in_place():
            inject_adapter_in_model(config, model)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise MpsimError(f"PEFT could not add the adapters ({spec.describe()}): {str(e).splitlines()[0]}") from None
    _save_whole(model, spec.modules_to_save)
    if not any(p.requires_grad for p in model.parameters()):
        raise MpsimError(f"{spec.describe()}: no module of the model matched, so nothing would train")
