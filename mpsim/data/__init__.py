"""Shipped data: ``mpsim.data.topologies``, ``mpsim.data.traces`` and
``mpsim.data.hf_configs`` are the repository's top-level ``topologies/``, ``traces/`` and
``hf_configs/`` folders, mapped into the package at build time (``package-dir`` in
pyproject.toml). Find them with ``mpsim.datafile.data_dir``; loaded by name with ``mpsim.data.catalog``."""
