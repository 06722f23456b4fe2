"""Phi-3, Gemma 2 and Gemma 3 traced from their configs with their own transformers
modules (mpsim.models.hf): the parameter count is the full model's, Gemma's logit soft-capping
keeps its tanh for the backward, Gemma 3's local and global layers each get their RoPE
tables (built once, kept by the embedding row), and a tensor-parallel split is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra")

import torch  # noqa: E402
import transformers  # noqa: E402

from mpsim.errors import MpsimError  # noqa: E402
from mpsim.models.hf import trace_hf  # noqa: E402
from mpsim.models.tensor_parallel import check_shardable  # noqa: E402

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 256, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 1}
CONFIGS: dict[str, dict[str, object]] = {
    "phi3": {**BASE, "num_key_value_heads": 4},
    "gemma2": {**BASE, "head_dim": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 64},
    "gemma3_text": {**BASE, "head_dim": 16, "sliding_window": 64},
}
SEQ = 256


def _trace(tmp_path: Path, model_type: str, **fields: object):
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **CONFIGS[model_type], **fields}))
    return trace_hf(str(path), microbatch=1)


def _full_params(model_type: str, **fields: object) -> int:
    config = transformers.CONFIG_MAPPING[model_type].from_dict({**CONFIGS[model_type], **fields})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_each_family_traces_with_the_full_models_parameters(tmp_path, model_type):
    trace = _trace(tmp_path, model_type)
    assert trace.spec.params == _full_params(model_type)
    assert [r.kind for r in trace.layers] == ["embedding", "transformer", "transformer", "transformer", "head"]
    assert trace.name == f"hf-{model_type}-3l-64h-{SEQ}s" and trace.spec.model["framework"] == "hf"


def test_gemmas_logit_soft_capping_keeps_its_tanh(tmp_path):
    """cap x tanh(logits / cap): the tanh's output (the logits' size, in the compute dtype)
    is kept for the backward on top of what the plain head keeps."""
    capped = _trace(tmp_path, "gemma2").layers[-1].act_bytes
    plain = _trace(tmp_path, "gemma2", final_logit_softcapping=None).layers[-1].act_bytes
    logits = 1 * SEQ * 1000
    assert capped - plain >= logits * 2  # at least one bf16 logits-sized tensor more


def test_gemma3s_local_and_global_layers_each_get_their_rope_tables_once(tmp_path):
    """Six layers: five local, one global (Gemma 3's pattern), so two (cos, sin) pairs are
    built once and kept by the embedding row; three local layers need one pair."""
    local_only = _trace(tmp_path, "gemma3_text").layers[0].act_bytes
    both = _trace(tmp_path, "gemma3_text", num_hidden_layers=6).layers[0].act_bytes
    pair = 2 * SEQ * 16 * 2  # cos and sin, (1, seq, head_dim), bf16
    assert both - local_only == pair


@pytest.mark.parametrize("model_type", ["phi3", "gemma2"])
def test_tensor_parallelism_refuses_blocks_that_are_not_mpsims_llama_layer(tmp_path, model_type):
    trace = _trace(tmp_path, model_type)
    with pytest.raises(MpsimError, match="tensor parallelism needs a trace of an mpsim model"):
        check_shardable(trace, 2)
