"""Shipped model traces (JSON), installed as the package ``mpsim.data.traces``."""
