"""Shipped data: ``mpsim.data.topologies`` and ``mpsim.data.traces`` are the repository's
top-level ``topologies/`` and ``traces/`` folders, mapped into the package at build time
(``package-dir`` in pyproject.toml). Find them with ``mpsim.catalog.data_dir``."""
