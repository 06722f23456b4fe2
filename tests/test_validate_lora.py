"""``mpsim validate --lora`` through the command line (``mpsim.cli.main``): the tiny Llama config
the executor's LoRA tests fine-tune (tests/test_executor_lora.py), traced with PEFT's adapters
and run by the fine-tuning worker on one rank (about 10 s on 2 cores); the report names the
fine-tune, prints the plain prediction against the measured peak with the measured-head
prediction labelled beside it, and PEFT's trainable count equals the trace's. What the worker
cannot run is refused in one line before anything is traced or started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpsim.cli import main

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "attention_dropout": 0.0, "hidden_act": "silu", "rope_theta": 10000.0}
MIXTRAL = str(Path(__file__).resolve().parent / "data" / "tiny-mixtral.json")
RUN = ["--stages", "1", "--microbatches", "2", "--steps", "1", "--warmup", "0"]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.mark.torchrun
def test_validate_lora_prints_the_comparison_and_peft_trainable_count(config, tmp_path, capsys):
    pytest.importorskip("peft", reason="the hf extra")
    out_json = tmp_path / "report.json"
    code = main(["validate", "--model", config, "--lora", "--lora-rank", "8", *RUN, "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["fine_tune"].startswith("LoRA r 8 on all-linear")
    assert "fine-tune: LoRA r 8 on all-linear" in out
    (row,) = report["stages"]  # one rank
    assert row["peft_params"]["trainable"] == row["predicted_trainable_params"] == 16384
    assert row["peft_params"]["all"] == report["predicted_params"]
    assert "16,384 / 16,384" in out
    # the plain prediction is the report's (a derived trace under-counts the head's backward
    # workspace); the measured-head one is a second, labelled column
    assert row["peak_error_pct"] < 0
    assert abs(row["peak_error_pct_measured_head"]) < abs(row["peak_error_pct"])
    assert "with measured head bwd workspace" in out
    assert report["head_backward_workspace_bytes"]["measured"] > report["head_backward_workspace_bytes"]["trace"]
    assert f"{row['peak_error_pct']:+6.2f}%" in out


@pytest.mark.parametrize("argv, says", [
    (["--tp", "2"], "validate: the executor fine-tunes with no tensor parallelism"),
    (["--dp", "2", "--zero", "1"], "validate: the executor fine-tunes with no ZeRO"),
    (["--cp", "2"], "validate: the executor fine-tunes with no context parallelism"),
])
def test_validate_lora_refuses_layouts_the_worker_cannot_run_in_one_line(config, capsys, argv, says):
    code = main(["validate", "--model", config, "--lora", *RUN, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpsim: error: {says}")


def test_validate_lora_refuses_more_than_one_stage(config, capsys):
    code = main(["validate", "--model", config, "--qlora", "--steps", "1"])  # --stages defaults to 2
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "fine-tunes with one pipeline stage (give --stages 1)" in err


@pytest.mark.parametrize("model, says", [
    ("gpt-tiny", "the executor fine-tunes the model of a transformers config.json"),
    (MIXTRAL, "the executor fine-tunes Llama decoders (model_type llama), not mixtral"),
])
def test_validate_lora_refuses_a_model_that_is_no_llama_config_in_one_line(capsys, model, says):
    code = main(["validate", "--model", model, "--lora", *RUN])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err


def test_validate_lora_flags_are_checked_as_everywhere(config, capsys):
    code = main(["validate", "--model", config, "--lora", "--qlora", *RUN])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "give one" in err
