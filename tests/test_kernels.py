"""GPU kernel semantics: what each kernel keeps for the backward, its FLOPs, its results.

Saved bytes are checked against an independent count of what the CUDA kernels keep
(Korthikanti et al. 2022, section 4.1, generalised to the byte width B of the data type):

- every block keeps 16*B*s*b*h bytes of layer inputs and matmul inputs (1 + 1 + 3 + 1
  attention, 1 + 1 + 4 + 4 MLP, in units of B*s*b*h), plus 1 byte per element for each of
  the two residual dropout masks;
- written-out attention adds (2B + 1)*a*s^2*b (softmax output, 1-byte mask, dropped
  probabilities), or B*a*s^2*b without dropout (the dropped probabilities are the softmax
  output), and a causal mask of s^2 bytes when eager;
- fused kernels add an fp32 log-sum-exp of a*s*b values (the memory-efficient one pads s to 32).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from mpsim.models import kernels
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import PRESETS, ModelConfig

S, B_SAMPLES, H, A = 256, 2, 512, 8
GPT = ModelConfig("gpt", 2, H, A, S, 1000)
BERT = ModelConfig("bert", 2, H, A, S, 1000)
RECIPE = {"gpt": "mixed-fp16", "bert": "fp32"}
WIDTH = {"gpt": 2, "bert": 4}


def expected_block_bytes(cfg: ModelConfig, b: int, width: int) -> float:
    """Independent count of a block's saved bytes (module docstring)."""
    s, h, a = cfg.seq_len, cfg.hidden, cfg.heads
    sbh = s * b * h
    dropout = cfg.dropout > 0
    total = 16 * width * sbh + (2 * sbh if dropout else 0)
    if cfg.attention in ("eager", "fused-softmax"):
        total += (2 * width + 1 if dropout else width) * a * s * s * b
        if cfg.attention == "eager" and cfg.family == "gpt":
            total += s * s
    else:
        rows = math.ceil(s / 32) * 32 if cfg.attention == "mem-efficient" else s
        total += 4 * a * rows * b
    return total


@pytest.mark.parametrize("family", ["gpt", "bert"])
@pytest.mark.parametrize("backend", kernels.ATTENTION_BACKENDS)
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_block_keeps_what_the_cuda_kernels_keep(family: str, backend: str, dropout: float) -> None:
    cfg = replace(GPT if family == "gpt" else BERT, attention=kernels.check_backend(backend), dropout=dropout)
    block = trace_model(cfg, B_SAMPLES, RECIPE[family]).layers[1]
    expected = expected_block_bytes(cfg, B_SAMPLES, WIDTH[family])
    assert block.act_bytes == pytest.approx(expected, rel=0.03)


def test_eager_gpt_block_matches_korthikanti_formula() -> None:
    """s*b*h*(34 + 5*a*s/h) bytes in fp16 with dropout (Korthikanti et al., eq. 1)."""
    s, b, h, a = 1024, 2, 5120, 40
    block = trace_model(ModelConfig("gpt", 1, h, a, s, 50257), b, "mixed-fp16").layers[1]
    assert block.act_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.03)
    kept_under_selective = block.act_bytes - block.attention_core_bytes
    assert kept_under_selective == pytest.approx(34 * s * b * h, rel=0.03)


def test_dropout_keeps_a_one_byte_mask() -> None:
    x = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernels.dropout(x, 0.5, True)
    assert [(t.dtype, t.shape) for t in kept] == [(torch.bool, x.shape)]
    assert kernels.dropout(x, 0.5, False) is x and kernels.dropout(x, 0.0, True) is x


@pytest.mark.parametrize("backend", kernels.ATTENTION_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_backends_compute_what_sdpa_computes(backend: str, causal: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    backend_name = kernels.check_backend(backend)
    out = kernels.attention(q, k, v, causal=causal, dropout_p=0.0, training=True, backend=backend_name)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_rms_norm_gradients_are_right() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: kernels.rms_norm(x, w), (x, w))
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(kernels.rms_norm(x, w), ref)


def test_fused_attention_flops_are_the_kernels() -> None:
    """Forward 4*b*a*s^2*d, backward 2.5 times that (the scores are recomputed), halved
    (with the diagonal) under a causal mask; written-out attention computes every block."""
    cfg = replace(GPT, attention="flash", layers=1)
    block = trace_model(cfg, B_SAMPLES, "mixed-fp16").layers[1]
    d = H // A
    causal_share = (S + 1) / (2 * S)
    assert block.fwd_attention_flops == pytest.approx(4 * B_SAMPLES * A * S * S * d * causal_share)
    assert block.bwd_attention_flops == pytest.approx(2.5 * block.fwd_attention_flops)
    eager = trace_model(replace(cfg, attention="eager"), B_SAMPLES, "mixed-fp16").layers[1]
    assert eager.fwd_attention_flops == 0
    no_attention = block.fwd_flops - block.fwd_attention_flops
    assert eager.fwd_flops - no_attention == pytest.approx(4 * B_SAMPLES * A * S * S * d)


def test_flash_attention_core_keeps_only_its_output_and_lse() -> None:
    block = trace_model(replace(GPT, attention="flash"), B_SAMPLES, "mixed-fp16").layers[1]
    assert block.attention_core_bytes == 2 * S * B_SAMPLES * H + 4 * A * S * B_SAMPLES
    assert block.attention_core_flops == pytest.approx(block.fwd_attention_flops)


PUBLIC_PARAMETERS = {  # from the models' config.json files, ../shared/reference/models.md
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("preset", sorted(PUBLIC_PARAMETERS))
def test_preset_has_the_public_models_parameter_count(preset: str) -> None:
    cfg, microbatch, recipe = PRESETS[preset]
    assert cfg.param_count() == PUBLIC_PARAMETERS[preset]
    small = replace(cfg, layers=1)
    traced = trace_model(small, 1, recipe)
    assert sum(r.params for r in traced.layers) == small.param_count() + (
        small.vocab * small.hidden if small.tied else 0)  # a tied head holds its own copy


def test_any_models_nn_dropout_keeps_a_one_byte_mask_when_traced() -> None:
    """The tracer runs every layer with ``F.dropout`` sent to CUDA's fused dropout, so a
    user's (or Hugging Face's) ``nn.Dropout`` keeps 1 byte per element, not 4 (fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mpsim.models.tracer import trace_layer

    with FakeTensorMode():
        block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 64))
        x = torch.randn(32, 64, requires_grad=True)
        fields = trace_layer(block, [x], lambda m, inp: m(inp))
    elements = 32 * 64
    # the first linear keeps its input (fp32), the mask is 1 byte, the second linear keeps the dropped output
    assert fields["act_bytes"] == 4 * elements + elements + 4 * elements
