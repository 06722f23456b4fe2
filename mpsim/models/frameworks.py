"""How a Llama layer is written (``mpsim.models.workloads`` builds each; ``mpsim trace
--framework``), named without importing torch so that every view can state it."""

from __future__ import annotations

from typing import Literal, get_args

Framework = Literal["megatron", "hf", "torchtitan"]
FRAMEWORKS: tuple[Framework, ...] = get_args(Framework)
FRAMEWORK_LAYERS: dict[str, str] = {
    "megatron": "fused q|k|v projection (pre-RoPE q and k kept with v), fused RMSNorm, RoPE cos/sin rebuilt in "
                "every layer (Megatron-LM)",
    "hf": "separate q, k, v projections, eager fp32 RMSNorm (LlamaRMSNorm), RoPE cos/sin built once per forward and "
          "shared by every layer (transformers)",
    "torchtitan": "separate q, k, v projections, fused RMSNorm (nn.RMSNorm), RoPE freqs_cis built once per model and "
                  "shared by every layer (torchtitan)",
}
"""What each framework means for a Llama layer (``mpsim.models.workloads``' docstring has the details)."""


def framework_line(framework: str, family: str | None = None) -> str:
    """One line naming how a trace's layers are written, for every output that shows
    activations: the framework and, for Llama layers, what it keeps."""
    if not framework:
        return "layers: a traced module (activations as it keeps them)"
    if family == "llama" and framework in FRAMEWORK_LAYERS:
        return f"layers: {framework}, {FRAMEWORK_LAYERS[framework]}"
    return f"layers: {framework}"
