"""Moved to :mod:`mpsim.views` (``text``, ``plots``, ``chrome``); the names old code
imports from here."""

from mpsim.views.plots import memory_figure

__all__ = ["memory_figure"]
