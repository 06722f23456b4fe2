"""The framework a Llama layer is written in (``ModelConfig.framework``): megatron, hf, torchtitan.

Saved bytes are derived by hand for a tiny grouped-query Llama at bf16 with FlashAttention
(b, s, h, a heads, kv heads of d, MLP width f; ``megatron_layer_bytes``), and the
megatron layer is also held to the values the presets were traced with before frameworks
existed (``BEFORE``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from mpsim.models.tp_ops import NO_SHARD, TensorShard
from mpsim.models.trace import LayerRow
from mpsim.models.tracer import trace_model
from mpsim.models.workloads import (
    FRAMEWORK_LAYERS,
    FRAMEWORKS,
    PRESETS,
    Framework,
    ModelConfig,
    TransformerLayer,
    build_layers,
)

B, S, H, HEADS, KV, F = 2, 128, 256, 4, 2, 512
D = H // HEADS
KV_DIM = KV * D
TINY = ModelConfig("llama", 3, H, HEADS, S, 1000, ffn_hidden=F, dropout=0.0, kv_heads=KV, attention="flash")
LIMIT_S = 120
SHARED: tuple[Framework, ...] = ("hf", "torchtitan")
"""The frameworks with separate q, k, v projections and one shared RoPE table."""

#: The transformer row's act_bytes of each preset, from `mpsim trace --preset NAME` run
#: before frameworks existed (mpsim at 9136264, torch 2.13): megatron must keep them.
BEFORE = {"llama-2-7b": 701_005_824, "llama-3-8b": 1_469_120_512, "llama-3-70b": 2_879_455_232,
          "mistral-7b": 1_469_120_512, "qwen2.5-7b": 843_546_624}


def megatron_layer_bytes(b: int, s: int, h: int, kv_dim: int, f: int, heads: int, d: int) -> int:
    """One megatron Llama layer's saved bytes at bf16 with flash attention:

    - 2 fused RMSNorms: input (2 B) and an fp32 reciprocal RMS per row: 2*(2sbh + 4sb);
    - the q|k|v projection's input (2sbh) and its whole output, alive as v's storage:
      2sb(h + 2 kv_dim);
    - RoPE: cos and sin (s x d, 2 B) built for q and again for k: 8sd;
    - flash: rotated q (2sbh) and k (2sb kv_dim), the output (2sbh; the output projection
      reads it as a view) and an fp32 log-sum-exp per head and row (4 b heads s);
    - the MLP's input (2sbh), its gate|up output (4sbf), silu(gate) and the product (2sbf each).
    """
    norms = 2 * (2 * s * b * h + 4 * s * b)
    attention = 2 * s * b * h + 2 * s * b * (h + 2 * kv_dim) + 8 * s * d
    attention += 2 * s * b * h + 2 * s * b * kv_dim + 2 * s * b * h + 4 * b * heads * s
    mlp = 2 * s * b * h + 8 * s * b * f
    return norms + attention + mlp


def shared_table_saving(b: int, s: int, h: int, kv_dim: int, d: int, degree: int = 1) -> int:
    """What separate projections and a shared RoPE table save per layer against megatron:
    the pre-RoPE q and k, which v no longer keeps alive (2sb(h + kv_dim)/t), and the four
    per-layer tables (8sd)."""
    return 2 * s * b * (h + kv_dim) // degree + 8 * s * d


def rows(framework: Framework, cfg: ModelConfig = TINY, shard: TensorShard = NO_SHARD) -> list[LayerRow]:
    return trace_model(replace(cfg, framework=framework), B, "mixed-bf16", shard=shard).spec.layers


def test_megatron_keeps_todays_bytes():
    assert rows("megatron")[1].act_bytes == megatron_layer_bytes(B, S, H, KV_DIM, F, HEADS, D)
    for name, act_bytes in BEFORE.items():
        cfg, mb, recipe = PRESETS[name]
        assert cfg.framework == "megatron"
        layer = trace_model(replace(cfg, layers=1), mb, recipe).spec.layers[1]
        assert layer.act_bytes == act_bytes == megatron_layer_bytes(mb, cfg.seq_len, cfg.hidden, cfg.kv * cfg.head_dim,
                                                                     cfg.ffn, cfg.heads, cfg.head_dim), name


def test_shared_tables_and_separate_projections_keep_less_by_the_pre_rope_q_and_k_and_the_tables():
    """torchtitan = megatron less the pre-RoPE q and k and the per-layer tables; hf keeps
    4 B more per element in each of its two eager fp32 RMSNorms (and in the head's). The
    shared table, 4sd bytes (hf: cos and sin, s x d bf16; torchtitan: s x d/2 complex64),
    is on the embedding's row."""
    megatron, hf, titan = (rows(fw) for fw in ("megatron", "hf", "torchtitan"))
    assert megatron[1].act_bytes - titan[1].act_bytes == shared_table_saving(B, S, H, KV_DIM, D)
    assert hf[1].act_bytes - titan[1].act_bytes == 2 * 4 * S * B * H
    assert hf[0].act_bytes - megatron[0].act_bytes == titan[0].act_bytes - megatron[0].act_bytes == 4 * S * D
    assert titan[-1].act_bytes == megatron[-1].act_bytes == hf[-1].act_bytes - 4 * S * B * H


def test_the_shared_table_is_counted_once_in_the_trace():
    """Per layer the saving is the same for 3 layers or 9; the table is added once."""
    for layers in (3, 9):
        cfg = replace(TINY, layers=layers)
        megatron, titan = (sum(r.act_bytes for r in rows(fw, cfg)) for fw in ("megatron", "torchtitan"))
        assert megatron - titan == layers * shared_table_saving(B, S, H, KV_DIM, D) - 4 * S * D


def test_parameters_and_flops_are_the_same_in_every_framework():
    traces = [trace_model(replace(TINY, framework=fw), B, "mixed-bf16") for fw in FRAMEWORKS]
    assert len({t.spec.params for t in traces}) == 1 and traces[0].spec.params == TINY.param_count()
    for fields in ("params", "fwd_flops", "bwd_flops", "fwd_attention_flops"):
        assert len({tuple(getattr(r, fields) for r in t.spec.layers) for t in traces}) == 1, fields


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shard", [TensorShard(2), TensorShard(2, True), TensorShard(2, True, True)])
def test_tensor_parallel_shards_trace_for_every_framework(framework, shard):
    """One rank of t = 2: the same parameters in every framework, and against megatron the
    shard keeps 1/t of the pre-RoPE q and k less, and the four per-layer tables (whole:
    every rank rotates with all d columns). Without sequence parallelism, or keeping the
    gathered input, the collectives are megatron's; with Megatron's sequence parallelism
    each of q, k, v is its own ColumnParallelLinear (an all-gather each)."""
    megatron, mine = rows("megatron", shard=shard), rows(framework, shard=shard)
    assert [r.params for r in mine] == [r.params for r in megatron]
    extra_norms = 2 * 4 * S * B * H // (2 if shard.sequence_parallel else 1) if framework == "hf" else 0
    saving = shared_table_saving(B, S, H, KV_DIM, D, 2) if framework != "megatron" else 0
    assert mine[1].act_bytes == megatron[1].act_bytes - saving + extra_norms
    gathers = [c.op for c in mine[1].fwd_collectives].count("all-gather")
    expected = (4 if framework != "megatron" else 2) if shard.sequence_parallel and not shard.saves_gathered else None
    if expected is None:
        assert mine[1].fwd_collectives == megatron[1].fwd_collectives
        assert mine[1].bwd_collectives == megatron[1].bwd_collectives
    else:
        assert gathers == expected


def _interleaved(weight: torch.Tensor) -> torch.Tensor:
    """q or k rows of each head reordered from the half-split layout (i, i + d/2) to
    adjacent pairs (2i, 2i + 1): torchtitan's RoPE then rotates what megatron's rotates."""
    pairs = torch.stack((torch.arange(D // 2), torch.arange(D // 2) + D // 2), dim=1).flatten()
    return weight.reshape(-1, D, weight.shape[1])[:, pairs].reshape(weight.shape)


def test_every_framework_computes_the_same_layer():
    """With megatron's weights (q, k, v split out of q|k|v; torchtitan's q and k rows in
    adjacent pairs), the three layers give the same output in fp32."""
    torch.manual_seed(0)
    layers = {fw: TransformerLayer(replace(TINY, framework=fw, seq_len=16)) for fw in FRAMEWORKS}
    megatron = layers["megatron"]
    wq, wk, wv = megatron.attn.qkv.weight.split([H, KV_DIM, KV_DIM])
    with torch.no_grad():
        for fw in SHARED:
            layer = layers[fw]
            layer.load_state_dict({k: v for k, v in megatron.state_dict().items() if "qkv" not in k}, strict=False)
            order = _interleaved if fw == "torchtitan" else (lambda w: w)
            layer.attn.q.weight.copy_(order(wq))
            layer.attn.k.weight.copy_(order(wk))
            layer.attn.v.weight.copy_(wv)
    x = torch.randn(2, 16, H)
    expected = megatron(x)
    for fw in SHARED:
        torch.testing.assert_close(layers[fw](x), expected, rtol=1e-5, atol=1e-5)


def test_a_built_model_shares_one_table_and_trains():
    model = build_layers(replace(TINY, framework="torchtitan", seq_len=16))
    first, second = model[1], model[2]
    assert isinstance(first, TransformerLayer) and isinstance(second, TransformerLayer)
    assert first.attn.rope is second.attn.rope
    tokens = torch.zeros(2, 16, dtype=torch.long)
    x = model[0](tokens)
    for layer in model[1:-1]:
        x = layer(x)
    model[-1](x, tokens).backward()
    assert first.attn.q.weight.grad is not None


def test_a_bad_framework_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="^framework 'deepspeed': expected one of megatron, hf, torchtitan$"):
        replace(TINY, framework="deepspeed")  # type: ignore[arg-type]
    out = str(tmp_path / "t.json")
    code, _, err = run_cli(LIMIT_S, "trace", "--preset", "llama-3-8b", "--framework", "deepspeed", "-o", out)
    assert code == 2 and err.count("\n") == 1 and "'deepspeed' is not one of 'megatron', 'hf', 'torchtitan'" in err
    code, _, err = run_cli(LIMIT_S, "trace", "--hf", "llama-2-7b", "--framework", "megatron", "-o", out)
    assert code == 2 and err.count("\n") == 1 and "--hf traces transformers' own modules, the hf framework" in err
    code, _, err = run_cli(LIMIT_S, "trace", "--module", "mpsim.models.cnn:vgg11", "--framework", "hf", "-o", out)
    assert code == 2 and err.count("\n") == 1 and "--framework is for presets and shapes" in err
    assert not Path(out).exists()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_cli_framework_round_trips_into_the_traces_model(tmp_path, framework: Framework):
    out = tmp_path / "t.json"
    code, _, err = run_cli(LIMIT_S, "trace", "--preset", "llama-3-8b", "--layers", "1", "--seq-len", "256",
                           "--framework", framework, "-o", str(out))
    assert code == 0, err
    spec = json.loads(out.read_text())
    assert spec["model"]["framework"] == framework
    cfg = replace(PRESETS["llama-3-8b"][0], layers=1, seq_len=256, framework=framework)
    assert spec["layers"][1]["act_bytes"] == trace_model(cfg, 1, "mixed-bf16").spec.layers[1].act_bytes


def test_a_preset_at_its_own_framework_keeps_its_name_and_no_framework_means_megatron(tmp_path):
    for extra in ((), ("--framework", "megatron")):
        out = tmp_path / "t.json"
        assert run_cli(LIMIT_S, "trace", "--preset", "llama-2-7b", *extra, "-o", str(out))[0] == 0
        spec = json.loads(out.read_text())
        assert (spec["name"], spec["model"]["framework"]) == ("llama-2-7b", "megatron")


def test_cli_choices_and_descriptions_name_every_framework():
    from mpsim.cli.trace_cmd import trace

    option = next(p for p in trace.params if p.name == "framework")
    assert tuple(option.type.choices) == FRAMEWORKS == tuple(FRAMEWORK_LAYERS)  # type: ignore[attr-defined]


def test_cli_hf_names_the_hf_framework(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "t.json"
    code, _, err = run_cli(LIMIT_S, "trace", "--hf", "llama-2-7b", "--layers", "1", "--seq-len", "64",
                           "--framework", "hf", "-o", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["model"]["framework"] == "hf"
