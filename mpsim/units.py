"""Units at the edges: bytes (int) and seconds (float) inside, units in key names outside.

Binary prefixes (MiB, GiB) are powers of 1024, as nvidia-smi and PyTorch report memory;
bandwidths in files are GB/s (10**9 bytes per second), as vendors state them.
"""

from __future__ import annotations

MiB = 1024**2
GiB = 1024**3


def gbps_to_bytes_per_s(gbps: float) -> float:
    """GB/s (decimal) to bytes per second."""
    return gbps * 1e9
