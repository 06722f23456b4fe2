"""Fine-tuning: LoRA and DoRA adapters on a frozen base, and QLoRA's quantized base (what
trains and how the base is stored; the torch side is ``mpsim.models.adapters``).

- **LoRA** (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", section
  4.1): each adapted linear layer keeps its weight frozen and adds ``B(A(dropout(x))) *
  alpha / r`` with ``A`` (r x in) and ``B`` (out x r) trained. The adapters are PEFT's own
  (``peft.inject_adapter_in_model`` on the model's transformers modules under FakeTensor),
  so their parameters, FLOPs and saved tensors are what PEFT builds and autograd keeps; DoRA
  (Liu et al. 2024) where PEFT has it (``use_dora``).
- **Frozen weights** get no gradient, no master copy and no optimizer state; autograd keeps
  what a frozen layer's backward needs (a frozen linear keeps its weight, not its input,
  unless an adapter reads the input). ``mpsim.models.tracer.trace_layer`` records each row's
  frozen parameters and their bytes (``mpsim.models.adapters.frozen_state``), so any module traced with frozen
  parameters is counted this way, not only adapters.
- **QLoRA** (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", section 3):
  every linear layer of the transformer blocks stored in 4 bits (NF4 or FP4) in blocks of 64
  with an absmax scale per block; with double quantization the absmaxes are themselves 8-bit
  in blocks of 256 with an fp32 scale each. Bytes per parameter as bitsandbytes lays them
  out (``QUANT_BYTES``): 0.5 + 4/64 = 0.5625 plain, 0.5 + 1/64 + 4/(64 x 256) = 0.5159 with
  double quantization (the paper's 0.127 bits of constants), plus its 256-entry fp32 code
  and offset per tensor. ``int8``: LLM.int8()'s 1 byte per weight and an fp32 scale per row.
  The weight is dequantized to the compute dtype for each GEMM, in the forward and again in
  the backward (bitsandbytes' ``MatMul4Bit`` keeps only the quantized weight): a
  memory-bound kernel reading the packed weight and writing the full one, whose output is
  the layer's transient workspace. bitsandbytes has no CPU or FakeTensor path, so the
  storage and the dequantization are modelled (``mpsim.models.adapters.QuantizedLinear``),
  as bitsandbytes documents them.

Adapters and the trained parameters keep the recipe's bytes per parameter (mixed-bf16: 2 +
2 + 12 = 16; PEFT's fp32 adapters under autocast hold the same 4 + 4 + 8). The embedding's
output is made to require gradients when the embedding is frozen, as PEFT's
``enable_input_require_grads`` does for gradient checkpointing, so every block computes its
input gradient.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from mpsim.datafile import FileModel, read_bounded
from mpsim.errors import MpsimError

QuantType = Literal["nf4", "fp4", "int8"]
BLOCK = 64
"""bitsandbytes' 4-bit block: one absmax scale per 64 weights."""
NESTED_BLOCK = 256
"""Double quantization: one fp32 scale per 256 of the 8-bit absmaxes."""
CODE_BYTES = 256 * 4 + 4
"""Double quantization's per-tensor state: the 256-entry fp32 code of the 8-bit absmaxes and their offset."""
ALL_LINEAR = "all-linear"
DEFAULT_RANK = 16
DEFAULT_ALPHA = 32.0
DEFAULT_DROPOUT = 0.05


class FineTune(FileModel):
    """What trains (recorded in the trace file as ``finetune``): LoRA adapters of ``r`` on
    ``target_modules`` (PEFT's names: a list, a regular expression or ``all-linear``), the
    base frozen in the compute dtype, or with ``quant`` stored quantized (QLoRA)."""

    method: Literal["lora", "qlora"]
    r: int = Field(default=DEFAULT_RANK, ge=1, le=1 << 16)
    lora_alpha: float = Field(default=DEFAULT_ALPHA, gt=0, le=1e6)
    lora_dropout: float = Field(default=DEFAULT_DROPOUT, ge=0, lt=1)
    target_modules: list[str] | str = ALL_LINEAR
    use_dora: bool = False
    modules_to_save: list[str] = Field(default_factory=list)
    quant: QuantType | None = Field(default=None, description="QLoRA: how the frozen base's linear weights are stored")
    double_quant: bool = Field(default=True, description="4-bit: the absmax scales quantized again (QLoRA section 3)")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str] | str) -> list[str] | str:
        if not value:
            raise ValueError("expected at least one target module")
        if isinstance(value, str) and value != ALL_LINEAR:  # PEFT matches a string as a regular expression
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"{value!r} is not a regular expression ({e})") from None
        return value

    def describe(self) -> str:
        """One line: 'LoRA r 16 on all-linear (dropout 0.05)', with the base's storage for QLoRA."""
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        name = "DoRA" if self.use_dora else "LoRA"
        if self.method == "qlora":
            name = "Q" + name
        base = ""
        if self.quant is not None:
            nested = " with double quantization" if self.double_quant and self.quant != "int8" else ""
            base = f", base in {self.quant}{nested}"
        saved = f", {', '.join(self.modules_to_save)} trained whole" if self.modules_to_save else ""
        return f"{name} r {self.r} on {targets} (dropout {self.lora_dropout:g}){base}{saved}"


def quant_bytes_per_param(quant: QuantType, double_quant: bool = True) -> float:
    """Bytes a quantized weight takes per parameter, its scales included (per-tensor
    constants aside): QLoRA section 3 and bitsandbytes' layout (module doc)."""
    if quant == "int8":
        return 1.0
    scales = (1 / BLOCK + 4 / (BLOCK * NESTED_BLOCK)) if double_quant else 4 / BLOCK
    return 0.5 + scales


def lora(rank: int | None = None) -> FineTune:
    """``--lora``: adapters of ``rank`` (16) on every linear layer of the blocks, alpha 32, dropout 0.05."""
    return FineTune(method="lora", r=rank or DEFAULT_RANK)


def qlora(rank: int | None = None, quant: QuantType = "nf4") -> FineTune:
    """``--qlora``: ``lora``'s adapters on a base stored in 4-bit NF4 with double quantization."""
    return FineTune(method="qlora", r=rank or DEFAULT_RANK, quant=quant)


_PEFT_KEYS = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_dora", "modules_to_save"}
_IGNORED_KEYS = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
                 "init_lora_weights", "fan_in_fan_out", "use_rslora", "peft_version", "megatron_core",
                 "qalora_group_size"}
"""Keys of an adapter_config.json that change neither memory nor time (``use_rslora`` and
``init_lora_weights`` change values only; ``qalora_group_size`` and ``megatron_core`` apply
only with options refused below)."""
_DEFAULTS: tuple[object, ...] = (None, False, {}, [], "", "none")
"""Any other key is modelled only at such a value (``bias`` at "none"): every layer gets the
same adapters (no ``layers_to_transform``, ``rank_pattern`` ...) and no bias trains."""


def fine_tune_of(lora_flag: bool, qlora_flag: bool, peft_config: Path | None, rank: int | None) -> FineTune | None:
    """What ``--lora``, ``--qlora``, ``--peft-config`` and ``--lora-rank`` ask for: None
    (every parameter trains) when none is given. ``--qlora`` puts the adapters (its own, or
    the config's) on a 4-bit NF4 base; ``--lora-rank`` sets their rank. Refused in one line:
    ``--lora`` with ``--qlora``, ``--lora-rank`` alone or with a config (which has its ``r``)."""
    if lora_flag and qlora_flag:
        raise MpsimError("--lora and --qlora: give one (--qlora is LoRA on a 4-bit base)")
    if rank is not None and peft_config is not None:
        raise MpsimError("--lora-rank with --peft-config: the config's r is the rank; give one of them")
    if peft_config is not None:
        return read_peft_config(peft_config, "nf4" if qlora_flag else None)
    if rank is not None and not (lora_flag or qlora_flag):
        raise MpsimError("--lora-rank: give --lora or --qlora too")
    if qlora_flag:
        return qlora(rank)
    return lora(rank) if lora_flag else None


def read_peft_config(path: Path, quant: QuantType | None = None) -> FineTune:
    """The adapters of a PEFT ``adapter_config.json`` (a file, or a folder holding one); with
    ``quant``, QLoRA's quantized base under them. Refused in one line: not LoRA, per-layer
    patterns (every layer gets the same adapters here), a trained bias, any other option
    away from its default."""
    file = path / "adapter_config.json" if path.is_dir() else path
    try:
        raw = read_bounded(file, "PEFT config")  # not a FIFO, a device or a huge file
    except MpsimError as e:
        raise MpsimError(f"--peft-config {e}") from None
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except MpsimError as e:  # a repeated key
        raise MpsimError(f"--peft-config {file}: {e}") from None
    except UnicodeDecodeError as e:
        raise MpsimError(f"--peft-config {file}: not UTF-8 text (byte {e.start}): expected PEFT's "
                         "adapter_config.json") from None
    except json.JSONDecodeError as e:
        raise MpsimError(f"--peft-config {file}: not JSON ({e.msg}, line {e.lineno})") from None
    except (RecursionError, ValueError) as e:  # nested too deeply, a number of thousands of digits
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]
        raise MpsimError(f"--peft-config {file}: not JSON ({why})") from None
    if not isinstance(data, dict):
        raise MpsimError(f"--peft-config {path}: expected a JSON object (PEFT's adapter_config.json)")
    kind = data.get("peft_type", "LORA")
    if kind != "LORA":
        raise MpsimError(f"--peft-config {path}: peft_type {kind!r} is not modelled; expected LORA")
    for key, value in data.items():
        if key not in _PEFT_KEYS | _IGNORED_KEYS and not any(value == d and type(value) is type(d) for d in _DEFAULTS):
            raise MpsimError(f"--peft-config {path}: {key} = {json.dumps(value)[:60]} is not modelled: mpsim gives "
                             "every layer the same adapters and trains no bias")
    fields = {k: data[k] for k in _PEFT_KEYS if data.get(k) is not None}
    try:  # strict: JSON's own types (no "8" or true for a rank, no "yes" for a switch)
        return FineTune.model_validate({"method": "qlora" if quant else "lora", "quant": quant, **fields}, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise MpsimError(f"--peft-config {path}: {where}: {err['msg']}") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object's keys, refused in one line where one repeats (``json`` would keep the last)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise MpsimError(f"repeats the key {key!r}; give it once")
        out[key] = value
    return out


def trainable_share(trainable: float, total: float) -> str:
    """PEFT's ``print_trainable_parameters`` line: trainable, all, and the share in percent."""
    share = 100 * trainable / total if total else math.nan
    return f"trainable params: {trainable:,.0f} || all params: {total:,.0f} || trainable%: {share:.4f}"
