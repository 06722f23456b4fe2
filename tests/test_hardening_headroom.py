"""``--headroom nan`` was accepted (issue 45): click's FloatRange compares the value with its
bounds, and every comparison with nan is false, so nan passed and, as the margin of every
at-risk check, cleared every at-risk mark. nan and infinities are refused in one line by
every command that takes ``--headroom`` (simulate, fits, choose)."""

from __future__ import annotations

import pytest

from mpsim.cli import main

COMMANDS = {
    "simulate": ["simulate"],
    "fits": ["fits", "--family", "gpt"],
    "choose": ["choose", "--model", "gpt-5.3b"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("value", "says"), [
    ("nan", "'nan' is not a finite number; expected one from 0 to 1024"),
    ("NaN", "'NaN' is not a finite number; expected one from 0 to 1024"),
    ("inf", "inf is not in the range 0<=x<=1024.0."),
    ("-inf", "-inf is not in the range 0<=x<=1024.0."),
    ("1e400", "inf is not in the range 0<=x<=1024.0."),
    ("-1", "-1.0 is not in the range 0<=x<=1024.0."),
])
def test_headroom_that_is_not_a_finite_margin_is_refused_in_one_line(capsys, command, value, says):
    assert main([*COMMANDS[command], "--headroom", value]) == 2
    err = capsys.readouterr().err
    assert err == f"mpsim: error: Invalid value for '--headroom': {says}\n"


def test_a_margin_in_range_still_marks_the_gpus_that_come_closer(capsys):
    # the largest margin puts every GPU at risk: the marks that nan used to clear
    assert main(["simulate", "--headroom", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FITS on every GPU, AT RISK:") and "within 1024 GiB of the GPU's memory" in out
    assert main(["simulate", "--headroom", "0"]) == 0
    assert "AT RISK" not in capsys.readouterr().out.splitlines()[0]
