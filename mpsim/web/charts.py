"""The page's charts, drawn with matplotlib on the server (``mpsim.views.plots``): per-GPU
memory at the peak against capacity, memory over time (as ``simulate --plot``), and the
pipeline timeline. Each renders as SVG for the page or PNG to download."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpsim.views.plots import figure_bytes, memory_bars_figure, memory_figure, timeline_figure

if TYPE_CHECKING:
    from mpsim.api import SimResult

CHARTS = {"bars": memory_bars_figure, "memory": memory_figure, "timeline": timeline_figure}
FORMATS = {"svg": "image/svg+xml", "png": "image/png"}


def render(r: SimResult, chart: str, fmt: str) -> bytes:
    """``chart`` of ``CHARTS`` as ``fmt`` of ``FORMATS``."""
    return figure_bytes(CHARTS[chart](r), fmt)
