"""A Hugging Face config.json given to ``--model`` (issue 45) was answered "schema: required
field is missing (and 28 more problem(s))". It is refused in one line with the command that
traces it, and that command runs, and its trace then goes to ``--model``."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from mpsim.cli import main

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
              "max_position_embeddings": 128}


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpsim: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err.removeprefix("mpsim: error: ").rstrip("\n")


@pytest.mark.parametrize("command", [["simulate"], ["plan", "-o", "p.json"], ["fits"]])
def test_a_config_json_given_as_a_model_names_the_command_that_traces_it(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    line = _refusal(capsys, *command, "--model", "config.json")
    assert line == ("config.json: a Hugging Face config.json (it has model_type), not an mpsim trace: trace it "
                    "with `mpsim trace --hf config.json -o config-trace.json` and give --model config-trace.json")


def test_the_named_command_runs_and_its_trace_simulates(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="the hf extra")
    folder = tmp_path / "my model"  # a path the shell would split: quoted in the hint
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    monkeypatch.chdir(tmp_path)
    line = _refusal(capsys, "simulate", "--model", "my model/config.json")
    assert "(it has architectures)" in line
    m = re.search(r"`(mpsim trace [^`]+)` and give --model (.+)$", line)
    assert m is not None, line
    argv = shlex.split(m[1])
    assert argv[:3] == ["mpsim", "trace", "--hf"]
    # the config lacks model_type here, so the named command answers that in one line ...
    assert main(argv[1:]) == 2
    assert "no model_type in the config" in capsys.readouterr().err
    # ... and with it, the command writes the trace the hint names, which --model takes
    config.write_text(json.dumps(TINY_LLAMA))
    assert main(argv[1:]) == 0, capsys.readouterr().err
    capsys.readouterr()
    trace = shlex.split(m[2])
    assert trace == ["my model/config-trace.json"] and (tmp_path / trace[0]).is_file()
    assert main(["simulate", "--model", trace[0], "--stages", "2"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("FITS")


def test_a_trace_is_still_read_as_a_trace(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # a file with neither key still gets the schema's own answer
    (tmp_path / "x.json").write_text(json.dumps({"name": "x"}))
    assert "schema: required field is missing" in _refusal(capsys, "simulate", "--model", "x.json")
