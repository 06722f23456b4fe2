"""Units at the edges: bytes (int) and seconds (float) inside, units in key names outside.

Binary prefixes (MiB, GiB) are powers of 1024, as nvidia-smi and PyTorch report memory;
bandwidths in files are GB/s (10**9 bytes per second), as vendors state them.
"""

from __future__ import annotations

import math

MiB = 1024**2
GiB = 1024**3
PiB = 1024**5

MAX_BYTES = PiB
"""The largest byte count mpsim accepts anywhere (a size, a field of a trace, a trace's
total): far beyond any server, and small enough that sums over every microbatch of a
job stay exact in 64-bit integers."""


def gbps_to_bytes_per_s(gbps: float) -> float:
    """GB/s (decimal) to bytes per second."""
    return gbps * 1e9


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'216MB', '1.5 GiB', '4096' (bytes) to bytes; MB/GB are decimal, MiB/GiB binary."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _BYTE_UNITS and unit != "":
        raise ValueError(f"not a size: {text!r} (expected a number with B, KB, MB, GB, KiB, MiB or GiB)")
    n = float(m.group(1)) * _BYTE_UNITS.get(unit, 1)
    if n <= 0:
        raise ValueError(f"a size must be positive: {text!r}")
    if n > MAX_BYTES:
        raise ValueError(f"a size must be at most 1 PiB ({MAX_BYTES} bytes): {text!r}")
    return int(round(n))


def rate_decimals(per_s: float) -> int:
    """Decimals that show a rate to three significant figures (none at 100 and above)."""
    if not math.isfinite(per_s) or per_s == 0:
        return 0
    rounded = float(f"{abs(per_s):.3g}")  # 9.996 rounds to 10.0: three figures after rounding
    return max(0, 2 - math.floor(math.log10(rounded)))


def format_rate(per_s: float) -> str:
    """A throughput to three significant figures, so two plans that differ print apart:
    0.0912, 7.28, 12.3, 1234 (samples/s, tokens/s; the unit is the caller's)."""
    return f"{per_s:.{rate_decimals(per_s)}f}"


def format_rate_band(per_s: float, band_per_s: float) -> str:
    """A rate and its band either side, the band to the rate's decimals: ``7.28 ± 0.36``."""
    return f"{format_rate(per_s)} ± {band_per_s:.{rate_decimals(per_s)}f}"
