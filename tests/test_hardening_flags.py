"""Every flag means one thing (issue 45): a combination that contradicts itself, or that a
mode ignores, is refused in one line naming both options, where it used to be overridden or
dropped without a word; an option left at its default is nobody's choice and never refused.
Also: ``engine build`` interrupted exits with the signal's code, ``--memory-mib`` and
``--dropout`` refuse nan, and ``validate`` checks its process count before torchrun starts."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mpsim import api
from mpsim.cli import main
from mpsim.errors import MpsimError


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (argv, captured.out, err)
    assert err.startswith("mpsim: error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, (name, err)
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("argv", "names"), [
    # the offload strategies ran FSDP whatever --zero said
    (["simulate", "--strategy", "zero-infinity", "--zero", "1"], ("--zero 1", "--strategy zero-infinity")),
    (["simulate", "--strategy", "zero-offload", "--zero", "3"], ("--zero 3", "--strategy zero-offload")),
    (["simulate", "--strategy", "zero-infinity", "--zero", "0"], ("--zero 0", "--strategy zero-infinity")),
    (["plan", "--strategy", "zero-offload", "--zero", "1", "-o", "p.json"], ("--zero 1", "--strategy zero-offload")),
    (["simulate", "--strategy", "zero-offload", "--hsdp"], ("--hsdp", "--strategy zero-offload")),
    # --hsdp ran HSDP whatever --zero said
    (["simulate", "--hsdp", "--zero", "1"], ("--hsdp", "--zero 1")),
    (["simulate", "--hsdp", "--zero", "0"], ("--hsdp", "--zero 0")),
    (["validate", "--hsdp", "--zero", "2"], ("--hsdp", "--zero 2")),
])
def test_a_zero_stage_that_contradicts_the_strategy_or_hsdp_is_refused(capsys, tmp_path, monkeypatch, argv, names):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, argv, *names)
    assert not (tmp_path / "p.json").exists()


def test_the_strategy_s_own_stage_or_none_given_still_runs(capsys):
    # --zero left at its default (0) is the strategy's to raise; its own stage is no contradiction
    for argv in (["simulate", "--strategy", "zero-infinity", "--model", "gpt-5.3b"],
                 ["simulate", "--strategy", "zero-infinity", "--zero", "3", "--model", "gpt-5.3b"],
                 ["simulate", "--strategy", "zero-offload", "--zero", "2", "--model", "gpt-5.3b"]):
        assert main(argv) in (0, 1), capsys.readouterr().err
        assert "error" not in capsys.readouterr().err


def test_the_facade_refuses_the_same_contradiction():
    with pytest.raises(MpsimError, match=r"--zero 1 and --strategy zero-infinity"):
        api.plan("dgx1-v100", "gpt-5.3b", strategy="zero-infinity", parallelism=api.data_parallel(2, 1, None))


@pytest.mark.parametrize(("option", "value"), [
    ("--schedule", "gpipe"), ("--schedule", "1f1b"),  # even the default's value, when given, is a choice
    ("--strategy", "none"), ("--layouts", "fsdp"), ("--rank-by", "throughput"), ("--headroom", "2"),
    ("--price", "dgx-h100=55"), ("--microbatches", "8"),
])
def test_choose_tokens_refuses_the_options_it_ignores(capsys, option, value):
    _refused(capsys, ["choose", "--model", "bert-0.35b", "--tokens", "1e9", "--clusters", "aws-p4d",
                      "--max-servers", "1", option, value], f"{option} and --tokens")


@pytest.mark.parametrize(("option", "value"), [
    ("--clusters", "aws-p4d"), ("--batch-tokens", "4096"), ("--discount", "0.1"), ("--min-servers", "2"),
    ("--max-servers", "4"),
])
def test_choose_without_tokens_refuses_the_options_of_the_cluster_search(capsys, option, value):
    _refused(capsys, ["choose", "--model", "gpt-5.3b", "--servers", "dgx1-v100", option, value],
             option, "--tokens")


def test_engine_build_interrupted_exits_with_the_signal_s_code_in_one_line(capsys, monkeypatch, tmp_path):
    from mpsim.native_build import BuildInterrupted

    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        def stopped(signum: int = signum) -> None:
            raise BuildInterrupted(signum, tmp_path)

        monkeypatch.setattr("mpsim.native_build.build_engine", stopped)
        monkeypatch.delitem(vars(api), "build_engine", raising=False)  # the facade's cached name
        assert main(["engine", "build"]) == code
        err = capsys.readouterr().err.splitlines()
        assert err[0] == "compiling the engine with mypyc ..."
        assert len(err) == 2 and err[1].startswith(f"mpsim: engine build interrupted by {signal.Signals(signum).name}")
    assert api.BuildInterrupted is BuildInterrupted


@pytest.mark.parametrize("argv", [
    ["validate", "--memory-mib", "nan"],
    ["topo", "probe", "--memory-mib", "nan"],
    ["trace", "--preset", "gpt-tiny", "--dropout", "nan", "-o", "t.json"],
    ["trace", "--preset", "gpt-tiny", "--dropout", "NaN", "-o", "t.json"],
])
def test_nan_is_refused_where_a_number_is_asked(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, argv, "is not a finite number")
    assert "Invalid value for '--" in err and not Path("t.json").exists()


def test_validate_refuses_more_processes_than_the_machine_holds_before_torchrun(capsys, monkeypatch):
    import mpsim.studies.hardware_check as hc

    monkeypatch.setattr(hc.os, "cpu_count", lambda: 2)

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may be measured, probed or started")

    monkeypatch.setattr(hc, "run_executor", no_run)
    monkeypatch.setattr("mpsim.models.profiler.measure_trace", no_run)
    err = _refused(capsys, ["validate", "--dp", "16", "--stages", "4"], "64 processes", "2 CPU core(s)")
    assert "at most 8" in err
    # the cap: RANKS_PER_CORE per core, never under MIN_CPU_RANKS
    hc.check_processes(8, "cpu")
    with pytest.raises(MpsimError, match="needs 9 processes"):
        hc.check_processes(9, "cpu")
    with pytest.raises(MpsimError, match="4 processes x 3 thread"):
        hc.check_processes(4, "cpu", threads=3)
    monkeypatch.setattr(hc.os, "cpu_count", lambda: 16)
    hc.check_processes(64, "cpu")
