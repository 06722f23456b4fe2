"""A Hugging Face config whose attention heads do not split its width (issue 45): a Phi-3
config with 8 heads on a hidden size of 60 printed torch's traceback and a broadcast error.
It is refused in one line naming ``hidden_size`` and ``num_attention_heads`` before torch
loads (``mpsim.models.hf_fields.check_heads``), on the command line and on the page's check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from mpsim import api
from mpsim.errors import MpsimError
from mpsim.models.hf_fields import check_shape

PHI3 = {"model_type": "phi3", "hidden_size": 60, "intermediate_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 256,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
NOT_DIVISIBLE = ("hidden_size 60 is not divisible by num_attention_heads 8: "
                 "each head gets hidden_size / num_attention_heads features")


def _config(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PHI3, **fields}))
    return path


def test_heads_that_do_not_divide_the_width_are_named_before_torch(tmp_path):
    with pytest.raises(MpsimError) as info:
        check_shape(PHI3, "c")
    assert str(info.value) == f"c: {NOT_DIVISIBLE}"
    path = _config(tmp_path)
    with pytest.raises(MpsimError) as info:
        api.check_hf(str(path))  # what the page runs on an upload, and trace --hf first
    assert str(info.value) == f"{path}: {NOT_DIVISIBLE}"


def test_each_familys_own_field_names_are_the_ones_named():
    gpt2 = {"model_type": "gpt2", "n_embd": 60, "n_head": 8, "n_layer": 2, "vocab_size": 1000}
    with pytest.raises(MpsimError, match=r"^c: n_embd 60 is not divisible by n_head 8: each head gets n_embd / n_head"):
        check_shape(gpt2, "c")


def test_key_value_heads_must_divide_the_heads():
    with pytest.raises(MpsimError) as info:
        check_shape({**PHI3, "hidden_size": 64, "num_key_value_heads": 3}, "c")
    assert str(info.value) == ("c: num_attention_heads 8 is not a multiple of num_key_value_heads 3: "
                               "each key-value head serves as many query heads")


def test_what_real_configs_do_is_still_taken():
    check_shape({**PHI3, "hidden_size": 64}, "c")  # 8 heads of 8
    check_shape({**PHI3, "head_dim": 8}, "c")  # a head_dim of its own: the width need not split
    check_shape({**PHI3, "hidden_size": 64, "num_key_value_heads": 2}, "c")  # grouped-query
    check_shape({**PHI3, "hidden_size": 64, "num_key_value_heads": None}, "c")
    # trace --hf --hidden/--heads replace the fields: mpsim.models.hf checks the new values
    check_shape(PHI3, "c", overrides={"hidden": 64})


def test_the_command_line_answers_in_one_line(tmp_path):
    path = _config(tmp_path)
    out = tmp_path / "x.json"
    code, _, err = run_cli(300, "trace", "--hf", str(path), "-o", str(out))
    assert code == 2 and err == f"mpsim: error: {path}: {NOT_DIVISIBLE}\n"
    assert not out.exists()


def test_an_override_that_fixes_the_width_traces(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra")
    path = _config(tmp_path)
    out = tmp_path / "x.json"
    code, text, err = run_cli(300, "trace", "--hf", str(path), "--hidden", "64", "-o", str(out))
    assert code == 0 and out.exists(), err
    assert "hf-phi3-2l-64h" in text
