"""Data files are read only if they are regular files of bounded size (issue 45): a server,
cluster, trace, plan or Hugging Face config path that named a FIFO hung (reading blocks
until a writer comes), and one that named ``/dev/zero`` grew past 2 GB. Each is refused
in one line naming the path and why.

Every CLI case runs ``mpsim`` in a subprocess with a timeout, so a regression fails the
test instead of hanging it (the timeout bounds the test only: the refusal is immediate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpsim.datafile import MAX_FILE_BYTES, MAX_SMALL_FILE_BYTES, read_bounded, read_data_file
from mpsim.errors import MpsimError
from mpsim.models.hf_fields import read_checked

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(),
                                reason="needs POSIX FIFOs and /dev/zero")

HANG_BOUND_S = 120
"""A refusal is immediate; this only turns a hang into a failure, even on a busy machine."""


def _mpsim(tmp_path: Path, *args: str) -> str:
    """The one line ``mpsim ARGS`` prints on stderr, run in ``tmp_path``; it must exit 2."""
    try:
        done = subprocess.run([sys.executable, "-m", "mpsim.cli", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=HANG_BOUND_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpsim {' '.join(args)} hung")
    line = done.stderr.strip()
    assert done.returncode == 2, done.stderr
    assert line.startswith("mpsim: error: ") and "\n" not in line, done.stderr
    return line.removeprefix("mpsim: error: ")


@pytest.fixture
def specials(tmp_path: Path) -> Path:
    """In ``tmp_path``: FIFOs and links to /dev/zero under each kind of file's name, and a
    model folder whose config.json is a FIFO."""
    for name in ("fifo.yaml", "fifo.json"):
        os.mkfifo(tmp_path / name)
    for name in ("zero.yaml", "zero.json"):
        (tmp_path / name).symlink_to("/dev/zero")
    (tmp_path / "model").mkdir()
    os.mkfifo(tmp_path / "model" / "config.json")
    return tmp_path


FIFO = "is a named pipe (FIFO), not a regular file"
ZERO = "is a character device, not a regular file"


@pytest.mark.parametrize(("args", "expected"), [
    (["simulate", "--server", "fifo.yaml"], f"fifo.yaml: cannot read topology file: it {FIFO}"),
    (["simulate", "--server", "zero.yaml"], f"zero.yaml: cannot read topology file: it {ZERO}"),
    (["topo", "check", "/dev/zero"], f"/dev/zero: cannot read topology file: it {ZERO}"),
    (["simulate", "--model", "fifo.json"], f"fifo.json: cannot read trace file: it {FIFO}"),
    (["simulate", "--model", "zero.json"], f"zero.json: cannot read trace file: it {ZERO}"),
    (["simulate", "--plan", "fifo.json"], f"fifo.json: cannot read plan file: it {FIFO}"),
    (["simulate", "--plan", "zero.json"], f"zero.json: cannot read plan file: it {ZERO}"),
    (["choose", "--model", "gpt-5.3b", "--tokens", "1e9", "--clusters", "fifo.yaml"],
     f"fifo.yaml: cannot read cluster file: it {FIFO}"),
    (["choose", "--model", "gpt-5.3b", "--tokens", "1e9", "--clusters", "zero.yaml"],
     f"zero.yaml: cannot read cluster file: it {ZERO}"),
    (["trace", "--hf", "model", "-o", "out.json"], f"model/config.json: cannot read config file: it {FIFO}"),
    (["trace", "--hf", "zero.json", "-o", "out.json"], f"zero.json: cannot read config file: it {ZERO}"),
])
def test_fifos_and_dev_zero_are_refused_in_one_line(specials, args, expected):
    assert _mpsim(specials, *args) == expected
    assert not (specials / "out.json").exists()


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate(MAX_FILE_BYTES + 1)
    line = _mpsim(tmp_path, "simulate", "--model", "big.json")
    assert line == (f"big.json: trace file is {MAX_FILE_BYTES + 1:,} bytes; mpsim reads at most "
                    f"{MAX_FILE_BYTES:,} (see MAX_FILE_BYTES in mpsim/datafile.py)")
    server = tmp_path / "big.yaml"
    with server.open("wb") as f:
        f.truncate(MAX_SMALL_FILE_BYTES + 1)
    assert _mpsim(tmp_path, "topo", "check", "big.yaml").startswith(
        f"big.yaml: topology file is {MAX_SMALL_FILE_BYTES + 1:,} bytes; mpsim reads at most")
    config = tmp_path / "config.json"
    with config.open("wb") as f:
        f.truncate(MAX_SMALL_FILE_BYTES + 1)
    with pytest.raises(MpsimError, match=r"config.json: config file is 16,777,217 bytes; mpsim reads at most"):
        read_checked(str(config))


def test_the_reader_says_why_for_folders_missing_files_and_its_bound(specials):
    # (FIFOs only in a subprocess above: here a regression would hang the test run)
    with pytest.raises(MpsimError, match=r"cannot read topology file: it is a folder, not a regular file"):
        read_data_file(specials / "model", "yaml", "topology")
    with pytest.raises(MpsimError, match=r"nothing.json: cannot read plan file \(No such file or directory\)"):
        read_bounded(specials / "nothing.json", "plan")
    ok = specials / "ok.json"
    ok.write_text("{}")
    assert read_bounded(ok, "plan") == b"{}"
    with pytest.raises(MpsimError, match=r"ok.json: plan file is 2 bytes; mpsim reads at most 1 "):
        read_bounded(ok, "plan", limit=1)
