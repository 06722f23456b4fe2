"""Shipped servers and models, looked up by name, and loading by name or path."""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

from mpsim.cluster import Cluster, read_cluster_file
from mpsim.errors import MpsimError
from mpsim.topology import Topology, read_topology_file
from mpsim.trace import Trace, read_trace_file

#: The packages the shipped files are installed as (the top-level ``topologies/`` and
#: ``traces/`` folders, mapped into the package at build time, see pyproject.toml).
DATA_PACKAGES = {"topologies": "mpsim.data.topologies", "traces": "mpsim.data.traces",
                 "hf_configs": "mpsim.data.hf_configs", "clusters": "mpsim.data.clusters"}
_CHECKOUT_PATHS = {"clusters": "topologies/clusters"}
"""Where a folder sits under ``MPSIM_DATA`` when not at its top (clusters live with servers)."""


def data_dir(kind: str) -> Path:
    """The folder of shipped ``topologies`` or ``traces``, found with ``importlib.resources``.

    Set ``MPSIM_DATA`` to a folder with ``topologies/`` and ``traces/`` in it (a checkout
    of the repository, say) to use those files instead.
    """
    if kind not in DATA_PACKAGES:
        raise ValueError(f"unknown data folder {kind!r}: expected one of {', '.join(DATA_PACKAGES)}")
    env = os.environ.get("MPSIM_DATA")
    if env:
        return Path(env) / _CHECKOUT_PATHS.get(kind, kind)
    root = resources.files(DATA_PACKAGES[kind])
    if not isinstance(root, Path):  # a zipped install: the files have no path of their own
        raise MpsimError(f"{DATA_PACKAGES[kind]} is not installed as files; set MPSIM_DATA to a folder with {kind}/")
    return root


def shipped_topologies() -> dict[str, Path]:
    return {p.stem: p for p in sorted(data_dir("topologies").glob("*.yaml"))}


def shipped_clusters() -> dict[str, Path]:
    return {p.stem: p for p in sorted(data_dir("clusters").glob("*.yaml"))}


def shipped_traces() -> dict[str, Path]:
    return {p.stem: p for p in sorted(data_dir("traces").glob("*.json"))}


def _resolve(name_or_path: str, shipped: dict[str, Path], what: str) -> Path:
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if path.suffix and path.exists():
        return path
    if path.suffix:
        raise MpsimError(f"{what} file {name_or_path} does not exist")
    names = ", ".join(shipped) or "(none shipped)"
    raise MpsimError(f"unknown {what} {name_or_path!r}: give a file path or one of {names}")


@lru_cache(maxsize=128)
def _load_cached(path: str, mtime: float, kind: str) -> Topology | Trace | Cluster:
    """Parsed files are immutable, so each is read once per modification time."""
    if kind == "cluster":
        return read_cluster_file(Path(path))
    return read_topology_file(Path(path)) if kind == "server" else read_trace_file(Path(path))


def is_cluster(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a shipped cluster or a YAML file with a ``fabric``."""
    if name_or_path in shipped_clusters():
        return True
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        return False
    try:  # its head only: a regular file (is_file), but of any size
        with path.open("rb") as f:
            head = f.read(65536).decode("utf-8", errors="replace")
    except OSError:
        return False
    return any(line.startswith("fabric:") for line in head.splitlines())


def load_cluster(name_or_path: str) -> Cluster:
    """A shipped cluster by name (``dgx-h100-superpod``) or a cluster YAML file."""
    path = _resolve(name_or_path, shipped_clusters(), "cluster")
    return _load_cached(str(path), path.stat().st_mtime, "cluster")  # type: ignore[return-value]


def load_topology(name_or_path: str) -> Topology:
    """A shipped server by name (``dgx1-v100``) or a topology YAML file."""
    path = _resolve(name_or_path, shipped_topologies(), "server")
    return _load_cached(str(path), path.stat().st_mtime, "server")  # type: ignore[return-value]


def load_trace(name_or_path: str) -> Trace:
    """A shipped model by name (``gpt-5.3b``) or a trace JSON file."""
    path = _resolve(name_or_path, shipped_traces(), "model")
    return _load_cached(str(path), path.stat().st_mtime, "model")  # type: ignore[return-value]
