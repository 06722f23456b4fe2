"""The installed package finds its data and its executor through importlib.resources, not
through the repository's layout (topologies/, traces/ and validate/ are mapped into the
package by pyproject.toml)."""

import fnmatch
import importlib
import importlib.util
import shutil
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from mpsim.data.catalog import data_dir, load_topology, load_trace, shipped_topologies, shipped_traces
from mpsim.studies.hardware_check import EXECUTOR_MODULE, executor_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("MPSIM_DATA", raising=False)


def _names(package, suffix):
    return sorted(p.name.removesuffix(suffix) for p in resources.files(package).iterdir() if p.name.endswith(suffix))


def test_shipped_topologies_come_from_the_package():
    names = _names("mpsim.data.topologies", ".yaml")
    assert "dgx1-v100" in names and "a100-40gb-nvswitch" in names
    assert list(shipped_topologies()) == names
    assert data_dir("topologies") == Path(str(resources.files("mpsim.data.topologies")))
    assert load_topology("dgx1-v100").spec.gpu.count == 8


def test_shipped_traces_come_from_the_package():
    names = _names("mpsim.data.traces", ".json")
    assert {"gpt-5.3b", "gpt-25.5b", "bert-0.35b"} <= set(names)
    assert list(shipped_traces()) == names
    assert load_trace("gpt-5.3b").name == "gpt-5.3b"


def test_every_data_file_of_the_repository_ships():
    """Each file in the top-level data folders matches a package-data pattern, and the
    installed packages hold the same topologies and traces as the checkout."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    for package, folder in dirs.items():
        assert package in config["packages"]
        patterns = ["*.py", *config["package-data"].get(package, [])]
        for f in (ROOT / folder).iterdir():
            if f.is_file():
                assert any(fnmatch.fnmatch(f.name, pat) for pat in patterns), f"{folder}/{f.name} would not ship"
    assert list(shipped_topologies()) == sorted(p.stem for p in (ROOT / dirs["mpsim.data.topologies"]).glob("*.yaml"))
    assert list(shipped_traces()) == sorted(p.stem for p in (ROOT / dirs["mpsim.data.traces"]).glob("*.json"))


def test_executor_is_a_module_of_the_package():
    assert executor_module() == EXECUTOR_MODULE == "mpsim.executor.executor"
    for name in (EXECUTOR_MODULE, "mpsim.executor.stage_actions"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin and Path(spec.origin).is_file(), name
    executor = importlib.import_module(EXECUTOR_MODULE)  # its imports resolve inside the package
    assert callable(executor.main) and executor.Recompute.__module__ == "mpsim.executor.stage_actions"


def test_mpsim_data_overrides_the_shipped_files(tmp_path, monkeypatch):
    (tmp_path / "topologies").mkdir()
    (tmp_path / "traces").mkdir()
    shutil.copy(data_dir("topologies") / "h100-x1.yaml", tmp_path / "topologies" / "my-box.yaml")
    monkeypatch.setenv("MPSIM_DATA", str(tmp_path))
    assert data_dir("topologies") == tmp_path / "topologies"
    assert list(shipped_topologies()) == ["my-box"] and shipped_traces() == {}
    assert load_topology("my-box").spec.gpu.count == 1


def test_every_package_folder_ships():
    """Each folder of mpsim/ with an __init__.py is a package the wheel lists (a folder left
    out installs without its modules: mpsim.launch once did)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mpsim").rglob("__init__.py")}
    assert folders - listed == set()
