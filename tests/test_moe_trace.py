"""Mixture-of-experts models traced from their configs with their own transformers modules
(mpsim.models.hf, mpsim.models.moe): the experts run under uniform load, the router for
real; the rows' expert fields, the parameter counts against transformers' own model and
the public figures, mixed dense and MoE layers, the shipped presets and traces, and the
refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra")

import torch  # noqa: E402
import transformers  # noqa: E402

from mpsim import load_trace  # noqa: E402
from mpsim.errors import MpsimError  # noqa: E402
from mpsim.models import moe  # noqa: E402
from mpsim.models.hf import trace_hf  # noqa: E402
from mpsim.models.hf_fields import config_path, precheck  # noqa: E402
from mpsim.models.tensor_parallel import check_shardable  # noqa: E402

SEQ = 256  # tokens per sample of a small config (its max_position_embeddings)
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": 1000, "max_position_embeddings": SEQ, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
       "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "first_k_dense_replace": 1}
CONFIGS: dict[str, dict[str, object]] = {
    "mixtral": {"intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "num_experts": 6, "num_experts_per_tok": 2, "decoder_sparse_step": 2},
    "qwen3_moe": {"intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "head_dim": 16, "mlp_only_layers": [0]},
    "deepseek_v3": {**MLA, "n_group": 2, "topk_group": 1, "n_shared_experts": 1},
    "deepseek_v2": {**MLA, "q_lora_rank": None, "n_shared_experts": 2},
    "gpt_oss": {"intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                "sliding_window": 64},
    # MoE every other layer, the last two layers NoPE: the four kinds (dense or MoE, RoPE or NoPE)
    "llama4_text": {"intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
                    "num_experts_per_tok": 2, "head_dim": 16, "num_hidden_layers": 4, "interleave_moe_layer_step": 2,
                    "no_rope_layers": [1, 1, 0, 0]},
}
#: Public figures (billions, total and active), from the model cards and papers.
PUBLIC = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39), "qwen3-30b-a3b": (30.5, 3.3),
          "qwen3-235b-a22b": (235, 22), "deepseek-v3": (671, 37), "llama-4-scout": (109, 17)}
#: What the transformers models count (total, active): see hf_configs/README.md.
COUNTS = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248), "mixtral-8x22b": (140_620_634_112, 39_152_031_744),
          "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704), "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
          "deepseek-v3": (671_026_404_352, 37_552_282_624), "llama-4-scout": (107_769_861_120, 17_172_894_720)}
#: Llama 4 Scout's vision tower and projector (``Llama4ForConditionalGeneration``'s ``vision_model`` and
#: ``multi_modal_projector`` built from the public config's ``vision_config``): in its public 109B, not in
#: the text model transformers builds for ``llama4_text`` (``Llama4ForCausalLM``).
SCOUT_VISION: dict[str, Any] = {
    "hidden_size": 1408, "intermediate_size": 5632, "num_attention_heads": 16, "num_hidden_layers": 34,
    "image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
    "projector_output_dim": 4096, "vision_output_dim": 4096, "norm_eps": 1e-05, "rope_theta": 10000}
EXPERTS = re.compile(r"\.(mlp|feed_forward)\.experts\.")


def _write(tmp_path: Path, model_type: str, **fields: object) -> str:
    path = tmp_path / f"{model_type}.json"
    raw = {"model_type": model_type, **BASE, **CONFIGS.get(model_type, {}), **fields}
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not ...}))
    return str(path)


def _trace(tmp_path: Path, model_type: str, **fields: object):
    return trace_hf(_write(tmp_path, model_type, **fields), microbatch=1)


def _theirs(model_type: str, **fields: object) -> Any:
    """transformers' own model of the config, on the meta device."""
    raw = {**BASE, **CONFIGS[model_type], **fields}
    config = transformers.CONFIG_MAPPING[model_type].from_dict(raw)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_each_family_has_transformers_parameter_counts_total_and_active(tmp_path, model_type):
    trace, model = _trace(tmp_path, model_type), _theirs(model_type)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if EXPERTS.search(name))
    block = trace.spec.model["moe"]
    k, experts = block["top_k"], block["experts"]
    assert trace.spec.params == total
    assert trace.active_params == pytest.approx(total - routed * (1 - k / experts))
    assert trace.spec.model["active_params"] == round(trace.active_params)
    assert sum(r.expert_params for r in trace.layers) == routed


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_moe_rows_where_transformers_builds_moe_layers(tmp_path, model_type):
    """Qwen's sparse step and MLP-only layers, DeepSeek's first dense layers: a row routes
    to experts exactly where transformers' decoder layer has them, each row with that
    layer's own parameters."""
    trace, model = _trace(tmp_path, model_type), _theirs(model_type)
    rows = [r for r in trace.layers if r.kind == "transformer"]
    for row, layer in zip(rows, model.model.layers, strict=True):
        assert row.is_moe == hasattr(getattr(layer, "mlp", None) or layer.feed_forward, "experts")
        assert row.params == sum(p.numel() for p in layer.parameters())
    assert trace.spec.model["moe"]["moe_layers"] == sum(r.is_moe for r in rows)
    assert all(r.experts == 0 and r.dispatch_bytes == 0 for r in trace.layers if not r.is_moe)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "llama4_text"])
def test_expert_fields_have_the_closed_forms_of_swiglu_experts(tmp_path, model_type):
    """T tokens, top-k, width h, expert MLP width f: forward 2 T k (3 h f) FLOPs, the
    backward twice that (data and weight gradients), T k h bf16 bytes dispatched; Qwen2's
    6 experts take 512 copies unevenly (86, 86, 85, 85, 85, 85) with the same FLOPs; Llama 4's
    k copies of each token, not transformers' every expert on every token (E/k times these)."""
    trace = _trace(tmp_path, model_type)
    row = next(r for r in trace.layers if r.is_moe)
    cfg = CONFIGS[model_type]
    k, experts = int(cfg["num_experts_per_tok"]), row.experts  # type: ignore[call-overload]
    f = int(cfg.get("moe_intermediate_size", cfg["intermediate_size"]))  # type: ignore[call-overload]
    tokens, h = SEQ, int(BASE["hidden_size"])
    assert (row.experts, row.experts_per_token) == (cfg.get("num_local_experts", cfg.get("num_experts")), k)
    assert row.expert_params == experts * 3 * h * f
    assert row.expert_fwd_flops == 2 * tokens * k * 3 * h * f
    assert row.expert_bwd_flops == 2 * row.expert_fwd_flops
    assert row.dispatch_bytes == tokens * k * h * 2
    # the experts keep the dispatched copies, the gate|up output, the activation and the product
    assert row.expert_act_bytes >= tokens * k * (h + 2 * f + f + f + h) * 2
    assert row.expert_act_bytes < row.act_bytes and row.expert_fwd_flops < row.fwd_flops


def test_the_experts_gemms_are_one_batched_kernel_per_share():
    assert moe.expert_groups(512, 8) == [(8, 64)]
    assert moe.expert_groups(512, 6) == [(2, 86), (4, 85)]
    assert moe.expert_groups(3, 8) == [(3, 1), (5, 0)]
    assert moe.expert_groups(512, 8, moe.capacity(512, 8, 0.5)) == [(8, 32)]
    assert moe.kept_copies(512, 8, moe.capacity(512, 8, 1.0)) == 512


def test_the_expert_gemms_in_the_kernel_records(tmp_path):
    """Mixtral-style: 4 experts, 512 copies, one batched GEMM each way (gate|up, down), and
    in the backward the data and weight gradients of each (the weight gradient grows in k)."""
    row = next(r for r in _trace(tmp_path, "mixtral").layers if r.is_moe)
    fwd = {(g.m, g.n, g.k, g.batch) for g in row.fwd_kernels if g.op == "gemm" and g.batch > 1}
    assert fwd == {(128, 192, 64, 4), (128, 64, 96, 4)}
    bwd = {(g.m, g.n, g.k, g.batch, g.grows) for g in row.bwd_kernels if g.op == "gemm" and g.batch > 1}
    assert bwd == {(128, 64, 192, 4, "m"), (192, 64, 128, 4, "k"), (128, 96, 64, 4, "m"), (64, 96, 128, 4, "k")}


@pytest.mark.parametrize("factor,dropped", [(None, 0), (1.0, 0), (1.25, 0), (0.5, 256)])
def test_a_capacity_factor_caps_each_experts_share_and_records_the_drops(tmp_path, factor, dropped):
    trace = _trace(tmp_path, "mixtral", capacity_factor=factor if factor is not None else ...)
    row = next(r for r in trace.layers if r.is_moe)
    kept = SEQ * 2 - dropped
    assert trace.spec.model["moe"]["capacity_factor"] == factor
    assert trace.spec.model["moe"]["dropped_copies"] == dropped
    assert row.dispatch_bytes == kept * 64 * 2
    assert row.expert_fwd_flops == 2 * kept * 3 * 64 * 96
    from mpsim.models.expert_parallel import UNIFORM, experts_line

    said = experts_line(trace, 1, UNIFORM)
    assert (f"{dropped:,} routed copies dropped per MoE layer" in said) == (factor is not None)


def test_deepseeks_latent_attention_runs_as_transformers_writes_it(tmp_path):
    """MLA: 24-wide queries and keys (16 + 8 rotary), 16-wide values, padded to the
    queries' width for the flash kernel; the router scores by sigmoid within groups."""
    trace = _trace(tmp_path, "deepseek_v3")
    attention = [k for k in trace.layers[1].fwd_kernels if k.op == "attention"]
    assert [(k.heads, k.head_dim) for k in attention] == [(4, 24)]
    assert trace.spec.model["moe"]["scoring"] == "sigmoid, group-limited"
    assert trace.spec.model["moe"]["first_dense_layers"] == 1 and trace.spec.model["family"] == "deepseek-v3"


def test_depth_keeps_the_first_dense_layers_and_repeats_the_moe_block(tmp_path):
    """``with_layers`` (fits' knob) on DeepSeek-style layers: the traced pattern kept, the
    last layer repeated; parameters, active parameters and rows as a deeper config traces."""
    deeper = _trace(tmp_path, "deepseek_v3").with_layers(5)
    traced = _trace(tmp_path, "deepseek_v3", num_hidden_layers=5)
    assert [r.is_moe for r in deeper.layers] == [r.is_moe for r in traced.layers]
    assert deeper.spec.params == traced.spec.params
    assert deeper.spec.model["active_params"] == traced.spec.model["active_params"]
    assert deeper.active_params == traced.active_params
    shallower = _trace(tmp_path, "mixtral").with_layers(1)
    assert [r.is_moe for r in shallower.layers] == [False, True, False]


def test_llama4_traces_one_block_of_each_kind_as_transformers_builds_it(tmp_path):
    """Dense or MoE (``moe_layers`` from ``interleave_moe_layer_step``), RoPE or NoPE
    (``no_rope_layers``): four kinds, four traced blocks. A NoPE layer skips the rotary
    embedding and the queries' and keys' L2 norm, and scales its queries by position (less
    kept than a RoPE layer's); the shared expert (one, as wide as a routed one) runs on every
    token, the router scores by the sigmoid of its top-k logits."""
    trace = _trace(tmp_path, "llama4_text")
    rows = [r for r in trace.layers if r.kind == "transformer"]
    assert [r.is_moe for r in rows] == [False, True, False, True]
    assert rows[0].params == rows[2].params and rows[1].params == rows[3].params
    assert rows[2].act_bytes < rows[0].act_bytes and rows[3].act_bytes < rows[1].act_bytes
    assert rows[1].expert_fwd_flops == rows[3].expert_fwd_flops
    block = trace.spec.model["moe"]
    assert (block["shared_experts"], block["shared_expert_ffn_hidden"], block["expert_ffn_hidden"]) == (1, 32, 32)
    assert (block["scoring"], block["first_dense_layers"], block["moe_layers"]) == ("sigmoid of the top-k", 1, 2)
    assert trace.spec.model["family"] == "llama4"


def test_a_multimodal_llama4_config_traces_its_text_model(tmp_path):
    """A ``llama4`` config (``Llama4Config``) is traced by its ``text_config``; Meta's
    released ``attn_temperature_tuning: 4``, which transformers' strict config refuses, is read
    as the flag its attention reads."""
    text = json.loads(Path(_write(tmp_path, "llama4_text")).read_text())
    path = tmp_path / "multimodal.json"
    path.write_text(json.dumps({"model_type": "llama4", "text_config": {**text, "attn_temperature_tuning": 4},
                                "vision_config": SCOUT_VISION}))
    made, plain = trace_hf(str(path), microbatch=1), _trace(tmp_path, "llama4_text")
    assert made.spec.params == plain.spec.params
    assert made.spec.model["active_params"] == plain.spec.model["active_params"]
    assert [r.act_bytes for r in made.layers] == [r.act_bytes for r in plain.layers]


@pytest.mark.parametrize("fields,overrides,message", [
    ({"no_rope_layers": [1, 2, 0, 0]}, None, "no_rope_layers: expected a list of 0 and 1 per layer"),
    ({"moe_layers": [1, "3"]}, None, "moe_layers: expected a list of layer indices"),
    ({}, {"layers": 8}, "no_rope_layers gives 4 layers' attention, not 8"),
])
def test_bad_llama4_layer_lists_are_refused_in_one_line(tmp_path, fields, overrides, message):
    with pytest.raises(MpsimError, match=message) as e:
        trace_hf(_write(tmp_path, "llama4_text", **fields), overrides=overrides)
    assert "\n" not in str(e.value)


def _scout_vision_params() -> int:
    """Scout's vision tower and projector as transformers builds them (``SCOUT_VISION``)."""
    from transformers.models.llama4 import modeling_llama4 as m

    text = json.loads(config_path("llama-4-scout").read_text())
    config = transformers.Llama4Config(text_config={**text, "attn_temperature_tuning": True},
                                       vision_config=SCOUT_VISION)
    with torch.device("meta"):
        parts = [m.Llama4VisionModel(m.Llama4VisionConfig(**SCOUT_VISION)), m.Llama4MultiModalProjector(config)]
    return sum(p.numel() for part in parts for p in part.parameters())


def test_tensor_parallelism_refuses_a_moe_trace_in_one_line(tmp_path):
    trace = _trace(tmp_path, "mixtral")
    with pytest.raises(MpsimError, match="tensor parallelism needs a trace of an mpsim model") as e:
        check_shardable(trace, 2)
    assert "\n" not in str(e.value)


def test_presets_have_the_public_parameter_counts():
    """Totals and active counts as transformers counts them, within 4% of the public
    figures (Mixtral-8x22B's 141B is 140.6B). DeepSeek-V3: transformers builds the 61 main
    layers without the multi-token-prediction module (layer 61, 11.5B of its own,
    ``num_nextn_predict_layers``), so the total is the main model's 671B; the active count
    includes the 0.93B input embedding, which DeepSeek's 37B (36.6B) leaves out. Llama 4
    Scout: the text model (107.77B) and its 0.87B vision tower and projector make Meta's
    109B (108.64B)."""
    beside_text = {"llama-4-scout": _scout_vision_params()}
    assert beside_text["llama-4-scout"] == 871_932_416
    for name, (total, active) in COUNTS.items():
        trace = trace_hf(name, overrides={"seq_len": 64})
        assert (trace.spec.params, trace.spec.model["active_params"]) == (total, active), name
        assert round(trace.active_params) == active
        public_total, public_active = PUBLIC[name]
        assert (total + beside_text.get(name, 0)) / 1e9 == pytest.approx(public_total, rel=0.01), name
        assert active / 1e9 == pytest.approx(public_active, rel=0.04), name


def test_shipped_moe_traces_are_the_presets_at_4096_tokens():
    for name, (total, active) in COUNTS.items():
        trace = load_trace(name)
        assert (trace.spec.params, trace.spec.model["active_params"], trace.seq_len) == (total, active, 4096)
        assert trace.is_moe and trace.microbatch == 1 and trace.spec.precision.recipe == "mixed-bf16"
        assert round(trace.active_params) == active


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "llama-4-scout"])
def test_a_shipped_trace_is_what_the_tracer_makes_today(name):
    made = trace_hf(name, overrides={"seq_len": 4096}, name=name)
    assert json.loads(made.to_json()) == json.loads(load_trace(name).to_json())


@pytest.mark.parametrize("fields,message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_local_experts 4"),
    ({"num_local_experts": 0}, "num_local_experts: expected 1 to 8,192, got 0"),
    ({"num_local_experts": 1 << 20}, "num_local_experts: expected 1 to 8,192"),
    ({"num_experts_per_tok": "2"}, "num_experts_per_tok: expected a whole number"),
    ({"capacity_factor": -1}, "capacity_factor: expected a number"),
])
def test_out_of_range_expert_fields_are_refused_in_one_line(tmp_path, fields, message):
    path = _write(tmp_path, "mixtral", **fields)
    for check in (precheck, trace_hf):  # before torch is imported, and when tracing
        with pytest.raises(MpsimError, match=message) as e:
            check(path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields,message", [
    ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 8"),
    ({"topk_group": 4}, "topk_group 4 is more than n_group 2"),
    ({"n_shared_experts": -1}, "n_shared_experts: expected a whole number from 0"),
    ({"first_k_dense_replace": 1.5}, "first_k_dense_replace: expected a whole number from 0"),
])
def test_bad_deepseek_routing_fields_are_refused(tmp_path, fields, message):
    with pytest.raises(MpsimError, match=message):
        precheck(_write(tmp_path, "deepseek_v3", **fields))


def test_bad_mlp_only_layers_are_refused(tmp_path):
    with pytest.raises(MpsimError, match="mlp_only_layers: expected a list of layer indices"):
        precheck(_write(tmp_path, "qwen3_moe", mlp_only_layers=["0"]))


def test_a_mixtral_relabelled_as_mistral_is_refused_naming_the_fields(tmp_path):
    """Traced as mistral it would be a dense 7.24B model; refused, the fields named."""
    raw = json.loads(config_path("mixtral-8x7b").read_text())
    path = tmp_path / "relabelled.json"
    path.write_text(json.dumps({**raw, "model_type": "mistral"}))
    for check in (precheck, trace_hf):
        with pytest.raises(MpsimError, match=r"mixture-of-experts fields \(num_local_experts, num_experts_per_tok\) "
                                             r"under model_type 'mistral'") as e:
            check(str(path))
        assert "\n" not in str(e.value)
