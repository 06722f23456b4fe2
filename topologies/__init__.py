"""Shipped server topologies (YAML), installed as the package ``mpsim.data.topologies``."""
