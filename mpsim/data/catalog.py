"""Shipped servers and models, looked up by name, and loading by name or path."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mpsim.datafile import DATA_PACKAGES, data_dir, read_data_file  # noqa: F401 - read from here as before
from mpsim.errors import MpsimError
from mpsim.hardware.cluster import Cluster, ServerLoader, parse_cluster
from mpsim.hardware.topology import Topology, read_topology_file
from mpsim.models.trace import Trace, read_trace_file


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


def cluster_from_data(data: object, source: str, base: Path | None = None) -> Cluster:
    """A cluster from parsed YAML; its server by shipped name, or a path relative to
    ``base`` (the cluster file's folder)."""
    return parse_cluster(data, source, _server_beside(base))


def read_cluster_file(path: Path) -> Cluster:
    """A cluster YAML file, its server by shipped name or beside it."""
    return cluster_from_data(read_data_file(path, "yaml", "cluster"), str(path), path.parent)


def _server_beside(base: Path | None) -> ServerLoader:
    def load(name: str) -> Topology:
        if name not in shipped_topologies() and base is not None and (base / name).exists():
            name = str(base / name)
        return load_topology(name)
    return load


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
