"""The hint under a job that does not fit names commands that run as written: the model
and server as the user gave them (a trace file's path, not the name inside it), a sharded
layout only where there are GPUs to shard over, and on a cluster a `choose --tokens`
over that cluster instead of a `fits --server` that cannot name a cluster (issue 45)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import click
import pytest

from mpsim.cli import app, main
from mpsim.data.catalog import data_dir


def _hint(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["simulate", *argv]) == 1
    out = capsys.readouterr().out
    return next(line for line in out.splitlines() if line.startswith("hint: "))


def _commands(hint: str) -> list[list[str]]:
    return [shlex.split(c)[1:] for c in re.findall(r"`(mpsim [^`]+)`", hint)]


def _parses(argv: list[str]) -> None:
    """The command's options parse as click reads them (no usage error)."""
    command = app.commands[argv[0]]
    with command.make_context(argv[0], argv[1:]) as ctx:
        assert ctx.params


def test_a_trace_file_is_named_by_its_path_and_the_hinted_fits_runs(tmp_path: Path, capsys) -> None:
    model = tmp_path / "my model.json"
    shutil.copy(data_dir("traces") / "gpt-10.3b.json", model)
    hint = _hint(capsys, "--model", str(model), "--server", "titanrtx-x1")
    assert "--dp" not in hint  # one GPU: nothing to shard over
    fits, choose = _commands(hint)
    assert fits == ["fits", "--model", str(model), "--server", "titanrtx-x1"]
    assert choose == ["choose", "--model", str(model)]
    assert main(fits) in (0, 1)
    _parses(choose)


def test_a_server_with_gpus_to_shard_over_is_hinted_its_fsdp_layout(capsys) -> None:
    hint = _hint(capsys, "--model", "gpt-10.3b", "--server", "dgx1-v100")
    assert "--dp 8 --zero 3" in hint
    for argv in _commands(hint):
        _parses(argv)


def test_a_cluster_job_is_hinted_choose_over_its_cluster(capsys) -> None:
    hint = _hint(capsys, "--cluster", "dgx-h100-superpod", "--servers", "2", "--model", "llama-3-70b",
                 "--microbatch", "1", "--dp", "2", "--stages", "8")
    (argv,) = _commands(hint)
    assert argv == ["choose", "--model", "llama-3-70b", "--clusters", "dgx-h100-superpod", "--tokens", "1e12"]
    _parses(argv)
    assert "x dgx-h100 (" not in hint  # the view's name is no --server


def test_the_parse_check_catches_a_bad_option() -> None:
    with pytest.raises(click.UsageError):
        _parses(["fits", "--no-such-option"])
