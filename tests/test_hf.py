"""`mpsim trace --hf`: Hugging Face models traced with their own modules from config.json."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from mpsim.cli import main  # noqa: E402
from mpsim.errors import MpsimError  # noqa: E402
from mpsim.models import hf  # noqa: E402
from mpsim.models.tracer import trace_model  # noqa: E402
from mpsim.models.workloads import PRESETS  # noqa: E402

PUBLIC_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "gpt2-xl": 1_557_611_200,
    "tinyllama-1.1b": 1_100_048_384,  # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    # mixture-of-experts presets (their active counts: tests/test_moe_trace.py)
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_620_634_112,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v3": 671_026_404_352,
    "llama-4-scout": 107_769_861_120,  # the text model: Meta's 109B counts the vision tower too
}
TINY = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 1024,
        "vocab_size": 1000, "max_position_embeddings": 512}


def _config(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def test_every_preset_is_shipped_and_has_its_public_parameter_count():
    assert set(hf.shipped_configs()) == set(PUBLIC_PARAMS)
    for name, params in PUBLIC_PARAMS.items():
        # the count does not depend on the sequence; a short one keeps the test fast
        assert hf.trace_hf(name, overrides={"seq_len": 64}).spec.params == params, name


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "gpt2", "gpt_neox", "bert"])
def test_every_family_traces_with_rows_and_its_source(tmp_path, model_type):
    fields = dict(TINY, model_type=model_type)
    if model_type in ("llama", "mistral", "qwen2"):
        fields["num_key_value_heads"] = 2  # grouped-query attention
    if model_type == "gpt2":
        fields = {"model_type": "gpt2", "n_embd": 256, "n_layer": 3, "n_head": 4, "vocab_size": 1000,
                  "n_positions": 512}
    t = hf.trace_hf(str(_config(tmp_path / model_type, **fields)), attention="flash", overrides={"seq_len": 128})
    kinds = [row.kind for row in t.spec.layers]
    assert kinds == ["embedding", "transformer", "transformer", "transformer", "head"]
    assert t.spec.model["source"] == f"hf:{model_type}" and t.spec.model["layers"] == 3
    block = t.spec.layers[1]
    assert block.act_bytes > 0 and block.fwd_flops > 0 and block.bwd_flops > block.fwd_flops
    # attention FLOPs 4*b*a*s^2*d: in full for BERT (bidirectional), the lower triangle for decoders
    full = 4 * 1 * 4 * 128 * 128 * 64
    expected = full if model_type == "bert" else full * (128 * 129 / 2) / 128**2
    assert block.fwd_attention_flops == pytest.approx(expected)


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b"])
def test_llama_block_matches_our_own_llama_layer_up_to_the_eager_norms(preset):
    """The same Llama block, transformers' modules against mpsim's megatron layer (flash,
    bf16, two layers). The saved bytes differ by exactly 8*s*b*h - 2*s*b*(h + kv*d) - 8*s*d:

    - +8*s*b*h: each of HF's two eager RMSNorms keeps an fp32 copy of its input
      (4 B/element) and the bf16 normalised tensor (2 B) where a fused kernel keeps the
      bf16 input (2 B): +4 B/element per norm;
    - -2*s*b*(h + kv*d): mpsim's fused qkv projection hands v to the attention as a view
      of the whole q|k|v output, 2*(h + 2*kv*d) bytes a row, where HF's own v_proj output
      is 2*kv*d (with kv = heads, as Llama-2-7B, that is -4*s*b*h);
    - -8*s*d: mpsim's megatron layer builds cos and sin for q and for k (four s x d bf16
      tensors); HF's block reads the one cos and sin the model builds for every block,
      which the embedding's row keeps once: +4*s*d there.

    The head's final norm adds +4*s*b*h the same way. Parameters and FLOPs agree exactly."""
    cfg, mb, recipe = PRESETS[preset]
    s, b, h, d, kv = 1024, mb, cfg.hidden, cfg.head_dim, cfg.kv
    ours = trace_model(replace(cfg, layers=2, seq_len=s), mb, recipe).spec.layers
    theirs = hf.trace_hf(preset, overrides={"layers": 2, "seq_len": s}).spec.layers
    assert [r.params for r in theirs] == [r.params for r in ours]
    assert [r.fwd_flops for r in theirs] == [r.fwd_flops for r in ours]
    assert theirs[1].act_bytes - ours[1].act_bytes == 8 * s * b * h - 2 * s * b * (h + kv * d) - 8 * s * d
    assert theirs[-1].act_bytes - ours[-1].act_bytes == 4 * s * b * h
    assert theirs[0].act_bytes - ours[0].act_bytes == 4 * s * d


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b", "qwen2.5-7b"])
def test_transformers_own_block_keeps_exactly_what_our_hf_framework_layer_keeps(preset):
    """mpsim's hf framework (separate q, k, v, eager fp32 RMSNorm, RoPE tables built once)
    is transformers' LlamaDecoderLayer byte for byte: every row's saved bytes, whether it
    keeps its input, parameters and FLOPs; the block's forward moves the same bytes too (its
    backward not quite: mpsim's one gate|up matmul concatenates two gradients that HF's
    gate_proj and up_proj add into the input's)."""
    cfg, mb, recipe = PRESETS[preset]
    ours = trace_model(replace(cfg, layers=2, seq_len=512, framework="hf"), mb, recipe).spec.layers
    theirs = hf.trace_hf(preset, overrides={"layers": 2, "seq_len": 512}).spec.layers
    for mine, their in zip(ours, theirs, strict=True):
        assert (their.act_bytes, their.saves_input, their.params) == (mine.act_bytes, mine.saves_input, mine.params)
        assert (their.fwd_flops, their.bwd_flops) == (mine.fwd_flops, mine.bwd_flops)
    assert theirs[1].fwd_mem_bytes == ours[1].fwd_mem_bytes


def test_rope_tables_are_counted_once_not_per_block():
    """LlamaModel builds cos and sin once per forward for every block: the embedding row
    keeps them (2 tables of s x d bf16), the blocks none, so a block's bytes do not
    depend on whether the model has one layer or three."""
    s, d = 256, 128
    one, three = (hf.trace_hf("llama-2-7b", overrides={"layers": n, "seq_len": s}).spec.layers for n in (1, 3))
    token_ids = 1 * s * 8  # the embedding keeps its int64 token ids (microbatch 1)
    assert one[0].act_bytes == three[0].act_bytes == token_ids + 2 * 2 * s * d
    assert one[1].act_bytes == three[1].act_bytes == three[3].act_bytes


def test_a_hf_trace_names_its_framework_and_shards_with_the_models_shape():
    """The model block says hf and carries the MLP width, biases and RoPE base, so a
    tensor-parallel shard (re-traced with mpsim's hf layer) is the model's: half the
    layer's parameters at t = 2 but for its two RMSNorms (replicated), and the bytes
    mpsim's own hf shard keeps."""
    from mpsim.models.tensor_parallel import shard_trace
    from mpsim.models.tp_ops import TensorShard

    t = hf.trace_hf("qwen2.5-7b", overrides={"layers": 2, "seq_len": 256})
    assert t.spec.model["framework"] == "hf" and t.spec.model["ffn_hidden"] == 18944 and t.spec.model["qkv_bias"]
    shard = shard_trace(t, 2).spec.layers
    assert 2 * shard[1].params - 2 * 3584 == t.spec.layers[1].params
    cfg, mb, recipe = PRESETS["qwen2.5-7b"]
    own = trace_model(replace(cfg, layers=2, seq_len=256, framework="hf"), mb, recipe, shard=TensorShard(2))
    assert [r.act_bytes for r in shard] == [r.act_bytes for r in own.spec.layers]


def test_flash_keeps_no_s_by_s_tensor_eager_does():
    def block_bytes(attention: str, s: int) -> int:
        t = hf.trace_hf("llama-2-7b", attention=attention, overrides={"layers": 1, "seq_len": s})
        return t.spec.layers[1].act_bytes

    assert block_bytes("flash", 1024) == 2 * block_bytes("flash", 512)  # linear in s
    # eager keeps the b*a*s^2 softmax (bf16): quadratic growth on top of the linear part
    linear = 2 * block_bytes("flash", 512)
    assert block_bytes("eager", 1024) - linear >= 2 * 32 * 1024 * 1024


def test_dropout_keeps_one_byte_masks(tmp_path):
    """GPT-2 drops out after the attention projection and after the MLP: two s*b*h masks
    of 1 byte (CUDA's fused dropout), none inside the flash kernel; CPU's F.dropout would
    keep a bf16 noise tensor of 2 bytes each."""
    gpt2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 1, "n_head": 4, "vocab_size": 1000, "n_positions": 512}
    on = _config(tmp_path / "on", **gpt2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    off = _config(tmp_path / "off", **gpt2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    s, b, h = 128, 2, 256
    with_masks, without = (hf.trace_hf(str(p), microbatch=b, attention="flash", overrides={"seq_len": s})
                           for p in (on, off))
    assert with_masks.spec.layers[1].act_bytes - without.spec.layers[1].act_bytes == 2 * s * b * h
    assert with_masks.spec.layers[0].act_bytes - without.spec.layers[0].act_bytes == s * b * h


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "llama", "num_hidden_layers": 2}, "llama config lacks hidden_size, num_attention_heads"),
    ({"model_type": "whisper", "d_model": 64}, "model_type 'whisper' is not supported"),
    ({"hidden_size": 64}, "no model_type"),
])
def test_a_bad_config_is_one_clear_line(tmp_path, fields, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(MpsimError, match=message) as e:
        hf.trace_hf(str(path))
    assert "\n" not in str(e.value)


def test_bad_overrides_are_one_line():
    with pytest.raises(MpsimError, match="not divisible by heads"):
        hf.trace_hf("llama-2-7b", overrides={"heads": 3, "layers": 1, "seq_len": 64})
    with pytest.raises(MpsimError, match="unknown --hf override"):
        hf.trace_hf("llama-2-7b", overrides={"vocab": 3})


def test_a_data_dependent_op_names_the_op_and_the_model(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: x[x.nonzero(as_tuple=True)])
    with pytest.raises(MpsimError, match=r"llama: aten\.nonzero.* depends on the data") as e:
        hf.trace_hf("llama-2-7b", overrides={"layers": 1, "seq_len": 64})
    assert "\n" not in str(e.value)


def test_without_transformers_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MpsimError, match=r"pip install 'mpsim\[hf\]'"):
        hf.trace_hf("llama-2-7b")


def test_cli_trace_hf_then_simulate_on_two_servers(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["trace", "--hf", "llama-2-7b", "-o", str(out)]) == 0
    assert "llama-2-7b, 6.74B parameters, 34 layers" in capsys.readouterr().out
    spec = json.loads(out.read_text())
    assert spec["model"]["source"] == "hf:llama" and spec["model"]["attention"] == "flash"
    for server in ("dgx-a100-80gb", "dgx-h100"):
        code = main(["simulate", "--model", str(out), "--server", server])
        printed = capsys.readouterr().out
        assert code in (0, 1) and ("FITS" in printed or "DOES NOT FIT" in printed), server


def test_cli_trace_hf_rejects_what_it_cannot_honour(tmp_path, capsys):
    assert main(["trace", "--hf", "gpt2-xl", "--vocab", "7", "-o", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip() == "mpsim: error: --hf does not take --vocab: set them in the config.json"
    assert main(["trace", "--hf", "no-such-model", "-o", str(tmp_path / "x.json")]) == 2
    assert "no such config.json, model folder or preset" in capsys.readouterr().err


GPT2_SMALL = {"model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 512,
              "activation_function": "gelu", "eos_token_id": 0, "bos_token_id": 0}
BERT_SMALL = {"model_type": "bert", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.mark.parametrize("attention", ["eager", "flash"])
@pytest.mark.parametrize(("fields", "family", "recipe"),
                         [(GPT2_SMALL, "gpt", "mixed-fp16"), (BERT_SMALL, "bert", "fp32")])
def test_our_gpt_and_bert_layers_keep_what_hf_gpt2block_and_bertlayer_keep(tmp_path, fields, family, recipe, attention):
    """The known result behind the 1-byte masks: with CUDA's dropout, Hugging Face's own
    GPT2Block (exact GELU; its default tanh GELU written in Python keeps its intermediates,
    about half as much again) and BertLayer keep exactly the bytes of mpsim's layers, and
    do the same FLOPs."""
    from mpsim.models.workloads import ModelConfig

    theirs = hf.trace_hf(str(_config(tmp_path / family, **fields)), microbatch=2, recipe=recipe, attention=attention,
                         overrides={"seq_len": 128}).spec.layers[1]
    ours = trace_model(ModelConfig(family, 2, 256, 4, 128, 1000, attention=attention), 2, recipe).spec.layers[1]
    assert theirs.act_bytes == ours.act_bytes
    assert (theirs.fwd_flops, theirs.bwd_flops) == (ours.fwd_flops, ours.bwd_flops)


def test_a_tied_output_projection_is_counted_once_in_the_embeddings_row(tmp_path):
    """``tie_word_embeddings``: the head's projection is the embedding's table, one tensor;
    a GPU holding both rows holds it once, so the rows add up to the model's parameters."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 1000, "max_position_embeddings": 128, "tie_word_embeddings": True}))
    trace = hf.trace_hf(str(config))
    assert sum(r.params for r in trace.layers) == trace.spec.params
    assert trace.layers[0].params == 1000 * 256 and trace.layers[-1].params == 256  # the final norm alone
