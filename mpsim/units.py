"""Units at the edges: bytes (int) and seconds (float) inside, human strings outside.

Decimal prefixes (kB, MB, GB) are powers of 1000, binary ones (KiB, MiB, GiB) powers of
1024, as in IEC 80000-13. Bandwidths in files are GB/s (10**9 bytes per second).
"""

from __future__ import annotations

import re

from mpsim.errors import MpsimError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9
MB = 10**6

_SIZE_FACTORS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse "216MB", "32 GiB" or "1024" (bytes) into a whole number of bytes."""
    match = _SIZE_RE.match(text)
    if not match:
        raise MpsimError(f"cannot read size {text!r}: expected a number and a unit such as 216MB or 32GiB")
    value, unit = float(match.group(1)), match.group(2).lower() or "b"
    if unit not in _SIZE_FACTORS:
        raise MpsimError(f"unknown size unit {match.group(2)!r} in {text!r}: use B, kB, MB, GB, KiB, MiB or GiB")
    return int(round(value * _SIZE_FACTORS[unit]))


def gbps_to_bytes_per_s(gbps: float) -> float:
    """GB/s (decimal) to bytes per second."""
    return gbps * 1e9


def fmt_bytes(n_bytes: float) -> str:
    """Bytes as GiB with two decimals (the unit nvidia-smi and PyTorch report)."""
    return f"{n_bytes / GiB:.2f} GiB"


def fmt_seconds(seconds: float) -> str:
    """Seconds as ms below 1 s, else s."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"
