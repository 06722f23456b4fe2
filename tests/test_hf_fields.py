"""A Hugging Face config's fields checked before anything is built (mpsim.models.hf_fields):
every bad field refused in one line that names it, a config asking for too much refused
before torch is imported, on the command line and on the page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from mpsim.errors import MpsimError
from mpsim.limits import MAX_LAYERS
from mpsim.models.hf_fields import MAX_CONFIG_DEPTH, check_shape, precheck, read_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 128}


def _config(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **fields}))
    return path


@pytest.mark.parametrize("field,value,says", [
    ("num_hidden_layers", 20_000, f"num_hidden_layers: expected 1 to {MAX_LAYERS - 2:,}, got 20000"),
    ("num_hidden_layers", -4, "num_hidden_layers: expected 1 to"),
    ("num_hidden_layers", True, "num_hidden_layers: expected a whole number, got True"),
    ("vocab_size", "abc", "vocab_size: expected a whole number, got 'abc'"),
    ("hidden_size", 64.5, "hidden_size: expected a whole number, got 64.5"),
    ("hidden_size", 10**9, "hidden_size: expected 1 to 262,144"),
    ("num_key_value_heads", 8, "num_key_value_heads 8 is more than num_attention_heads 4"),
    ("rope_theta", "x", "rope_theta: expected a number from"),
    ("rms_norm_eps", -1, "rms_norm_eps: expected a number from 0 to 1, got -1"),
    ("hidden_act", 3, "hidden_act: expected a name (a string), got 3"),
])
def test_each_bad_field_is_refused_in_one_line_that_names_it(tmp_path, field, value, says):
    path = _config(tmp_path, **{field: value})
    with pytest.raises(MpsimError) as err:
        precheck(str(path))
    assert str(err.value) == f"{path}: {says}" or str(err.value).startswith(f"{path}: {says}")
    assert "\n" not in str(err.value)


def test_gpt2s_own_names_are_checked_and_nulls_allowed_where_the_config_may_leave_them(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab_size": 50257, "n_inner": None}
    check_shape(gpt2, "c")
    with pytest.raises(MpsimError, match=r"^c: n_layer: expected 1 to"):
        check_shape(dict(gpt2, n_layer=0), "c")
    with pytest.raises(MpsimError, match=r"^c: n_head: expected a whole number"):
        check_shape(dict(gpt2, n_head=None), "c")


def test_overrides_are_bounded_like_the_fields(tmp_path):
    path = _config(tmp_path)
    precheck(str(path), {"layers": 96})
    with pytest.raises(MpsimError, match=r"^--layers \(num_hidden_layers\): expected 1 to 9,998, got 100000$"):
        precheck(str(path), {"layers": 100_000})


def test_a_config_nested_too_deep_is_refused_before_json_recurses(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(MpsimError, match=rf"nested 100001 levels deep; a config nests at most {MAX_CONFIG_DEPTH}$"):
        read_config(path)
    brackets_in_strings = tmp_path / "strings.json"
    brackets_in_strings.write_text(json.dumps({**LLAMA, "name": "[" * 1000}))
    assert read_config(brackets_in_strings)["name"] == "[" * 1000


def test_the_command_line_refuses_20000_layers_before_torch_loads(tmp_path):
    """The refusal comes from the config alone: torch is never imported."""
    path = _config(tmp_path, num_hidden_layers=20_000)
    code = ("import sys; from mpsim.cli import main; "
            f"rc = main(['trace', '--hf', {str(path)!r}, '-o', {str(tmp_path / 'x.json')!r}]); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.stdout.strip() == "2 False", proc.stderr
    assert proc.stderr.strip().splitlines() == [f"mpsim: error: {path}: num_hidden_layers: expected 1 to 9,998, "
                                                "got 20000"]
    assert not (tmp_path / "x.json").exists()


def test_values_only_the_modules_reject_are_one_line_too(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra")
    for fields, says in (({"hidden_act": "nope"}, "hidden_act: unknown activation 'nope'"),
                         ({"attention_bias": "yes"}, "bad llama config: Validation error for field 'attention_bias'"),
                         ({"rope_scaling": {"type": "nope"}}, "the llama model cannot be built from this config"),
                         ({"pad_token_id": 32000}, "(AssertionError: Padding_idx must be within num_embeddings)")):
        path = _config(tmp_path, **fields)
        code, _, err = run_cli(120, "trace", "--hf", str(path), "-o", str(tmp_path / "x.json"))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and says in lines[0], err


def test_the_sequence_length_is_in_the_name_and_printed(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra")
    path = _config(tmp_path)
    names = []
    for seq_len in (64, 128):
        out = tmp_path / f"t{seq_len}.json"
        code, text, _ = run_cli(300, "trace", "--hf", str(path), "--seq-len", str(seq_len), "-o", str(out))
        assert code == 0 and f"microbatch 1 x {seq_len} tokens" in text, text
        names.append(json.loads(out.read_text())["name"])
    assert names == ["hf-llama-2l-64h-64s", "hf-llama-2l-64h-128s"]
