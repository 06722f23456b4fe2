"""Shipped clusters (YAML), installed as the package ``mpsim.data.clusters``."""
