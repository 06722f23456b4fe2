"""The compiled engine (``mpsim.native``, ``mpsim.native_build``): which engine a run
uses, a stale or incomplete build never loaded, one-line refusals, and a real build of
one module, loaded by a new process, that computes what the Python engine does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mpsim import native, native_build

MPSIM = [sys.executable, "-m", "mpsim.cli"]


def _env(cache: Path, mode: str | None = None) -> dict[str, str]:
    env = {**os.environ, "MPSIM_CACHE_DIR": str(cache)}
    env.pop("MPSIM_ENGINE", None)
    if mode is not None:
        env["MPSIM_ENGINE"] = mode
    return env


def _fake_build(where: Path, root: Path, sources: dict[str, bytes]) -> None:
    """A manifest over ``sources`` (written under ``root``), without extensions."""
    where.mkdir(parents=True)
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
    manifest = {"modules": ["mpsim.sim.channels"], "group": native.GROUP,
                "sources": {rel: native.file_sha256(root / rel) for rel in sources}}
    (where / native.MANIFEST).write_text(json.dumps(manifest))


def test_engine_mode_reads_the_environment_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPSIM_ENGINE", raising=False)
    assert native.engine_mode() == "auto"
    monkeypatch.setenv("MPSIM_ENGINE", " Compiled ")
    assert native.engine_mode() == "compiled"
    monkeypatch.setenv("MPSIM_ENGINE", "fast")
    with pytest.raises(native.EngineError, match=r"^MPSIM_ENGINE='fast': expected one of auto, python, compiled$"):
        native.engine_mode()


def test_without_a_build_or_when_turned_off_the_python_engine_runs(tmp_path: Path) -> None:
    absent = native.engine_status("auto", tmp_path / "none")
    assert not absent.in_use and absent.reason.startswith("not built")
    assert absent.describe() == "python (not built: `mpsim engine build` compiles it)"
    off = native.engine_status("python", tmp_path / "none")
    assert not off.in_use and off.reason == "MPSIM_ENGINE=python"


def test_a_build_whose_sources_changed_or_went_is_stale(tmp_path: Path) -> None:
    root, where = tmp_path / "pkg", tmp_path / "build"
    _fake_build(where, root, {"sim/a.py": b"x = 1\n", "job.py": b"y = 2\n"})
    manifest = native.read_manifest(where)
    assert manifest is not None and native.stale_file(manifest, root) is None
    (root / "job.py").write_bytes(b"y = 3\n")
    assert native.stale_file(manifest, root) == "job.py"
    assert native.engine_status("auto", where, root).reason.startswith("stale: job.py changed since the build")
    (root / "job.py").write_bytes(b"y = 2\n")
    (root / "sim/a.py").unlink()
    assert native.stale_file(manifest, root) == "sim/a.py"


def test_a_build_with_matching_sources_but_no_extensions_is_not_loaded(tmp_path: Path) -> None:
    root, where = tmp_path / "pkg", tmp_path / "build"
    _fake_build(where, root, {"sim/a.py": b"x = 1\n"})
    state = native.engine_status("auto", where, root)
    assert not state.in_use and state.reason.startswith("incomplete build in")
    (where / native.MANIFEST).write_text("{not json")
    assert native.engine_status("auto", where, root).reason.startswith("not built")


def test_asking_for_the_compiled_engine_without_a_build_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([*MPSIM, "simulate", "--server", "dgx1-v100", "--model", "gpt-5.3b"],
                          env=_env(tmp_path, "compiled"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "mpsim: error: MPSIM_ENGINE=compiled, but the compiled engine cannot be used: not built: "
        "`mpsim engine build` compiles it"]


def test_engine_status_and_clean_on_an_empty_cache(tmp_path: Path) -> None:
    done = subprocess.run([*MPSIM, "engine", "status", "--json", "-"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120, check=True)
    status = json.loads(done.stdout)
    assert status["engine"] == "python" and status["modules"] == [] and status["mode"] == "auto"
    assert status["build_dir"] == str(tmp_path / "engine" / native.abi_tag())
    clean = subprocess.run([*MPSIM, "engine", "clean"], env=_env(tmp_path), capture_output=True, text=True,
                           timeout=120, check=True)
    assert clean.stdout.strip() == f"no build in {tmp_path / 'engine' / native.abi_tag()}"


def test_the_build_refuses_modules_outside_the_engine(tmp_path: Path) -> None:
    with pytest.raises(native.EngineError, match="cannot compile mpsim.plans.job: the compiled engine's modules are"):
        native_build.build_engine(["mpsim.plans.job"], tmp_path)


def test_the_build_names_a_missing_c_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("mypyc")
    monkeypatch.setattr(native_build.shutil, "which", lambda _name: None)
    with pytest.raises(native.EngineError, match="needs a C compiler: .* is not on PATH"):
        native_build.build_engine(["mpsim.sim.channels"], tmp_path)
    assert not (tmp_path / native.MANIFEST).exists()


DIGEST = """
import json, sys
import mpsim.sim.channels as channels
from mpsim import native
from mpsim.api import simulate
r = simulate("dgx1-v100", "gpt-5.3b", schedule="1f1b", microbatch=2, strategy="cpu-swap")
res = r
print(json.dumps({"engine": native.state().describe(), "channels": channels.__file__,
                  "iteration_s": res.iteration_s, "events": res.sim_events,
                  "peaks": [g.peak_bytes for g in res.gpus], "spans": [repr(s) for s in res.spans]}))
"""


@pytest.mark.skipif(shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) is None,
                    reason="no C compiler")
def test_a_compiled_module_is_loaded_by_a_new_process_and_computes_the_same(tmp_path: Path) -> None:
    """A real build of one small module (``channels``: every pipeline's sends), then the
    same plan simulated by the Python engine and the compiled one in new processes."""
    pytest.importorskip("mypyc")
    where = tmp_path / "engine" / native.abi_tag()
    report = native_build.build_engine(["mpsim.sim.channels"], where)
    assert report.modules == ("mpsim.sim.channels",) and report.n_sources > 10
    runs = {}
    for mode in ("python", "compiled"):
        done = subprocess.run([sys.executable, "-c", DIGEST], env=_env(tmp_path, mode), capture_output=True,
                              text=True, timeout=300, check=True)
        runs[mode] = json.loads(done.stdout)
    assert runs["python"]["channels"].endswith("channels.py")
    assert runs["compiled"]["channels"].startswith(str(where)) and runs["compiled"]["channels"].endswith(".so")
    assert runs["compiled"]["engine"] == f"compiled (1 module from {where})"
    for key in ("iteration_s", "events", "peaks", "spans"):
        assert runs["compiled"][key] == runs["python"][key], key


def test_a_new_build_replaces_the_old_whole_and_a_failed_one_leaves_it(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    where = tmp_path / "engine" / "abi"
    where.mkdir(parents=True)
    (where / "old.txt").write_text("old")
    new = tmp_path / "engine" / ".abi.new-1"
    new.mkdir()
    (new / "new.txt").write_text("new")
    native_build.swap_in(new, where)
    assert sorted(p.name for p in where.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in where.parent.iterdir()) == ["abi"]

    def failing(*_args: object) -> None:
        raise native.EngineError("mypyc or the C compiler failed (exit 1)")

    monkeypatch.setattr(native_build, "check_toolchain", lambda: None)
    monkeypatch.setattr(native_build, "compile_into", failing)
    with pytest.raises(native.EngineError, match="failed"):
        native_build.build_engine(["mpsim.sim.channels"], where)
    assert sorted(p.name for p in where.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in where.parent.iterdir()) == ["abi"]
